package e2e

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// rig is one deployment on loopback: the Envoy emulator in front of extproc,
// prefill and decode engine simulators (two of each by default). It can be
// built to be broken: pool addresses can point anywhere (dead ports,
// simulators in the wrong role, recorders), the Envoy config can be tweaked,
// a simulator can be started again in place, and extproc can be killed and
// started again on the same gRPC port.
type rig struct {
	mode, connector string
	proxy           *envoyemu.Proxy
	extproc         *extproc
	replicas        []*extproc // every extproc behind the emulator, extproc first
	config          string     // extproc's config
	args            []string   // extproc's flags besides the rig's own
	prefill, decode []*pdsim.Server
	decodeAddrs     []string          // the decode pool as configured
	sim             testbed.SimConfig // what the rig's simulators share: protocol, shared dir, bootstrap port, timings
	mtls            *testbed.MTLS     // the certificates of the Envoy-extproc link
}

type rigOptions struct {
	mode, connector string // default full_duplex, kv-nixl
	prefills        int    // prefill simulators (default 2; -1 none)
	decodes         int    // decode simulators (default 2)
	replicas        int    // extproc processes behind the emulator, one config (default 1)
	// prefillAddrs and decodeAddrs override the pools' endpoints, given the
	// simulators (e.g. a dead endpoint, or recorders in front of them).
	prefillAddrs func(sims []*pdsim.Server) []string
	decodeAddrs  func(sims []*pdsim.Server) []string
	prefillRole  string        // a decode-role "prefill" is an engine without a KV connector
	outputTokens int           // decode answer length (default 5)
	handshake    time.Duration // SGLang bootstrap handshake bound of the simulators (default 10s)
	// promptTokensDetails: the simulators report cached tokens in their
	// usage (vLLM's --enable-prompt-tokens-details).
	promptTokensDetails bool
	extra               string // more top-level extproc config
	prefillPool         string // more keys of pools.prefill / pools.decode, e.g. "policy: round-robin"
	decodePool          string
	envoy               func(*envoyemu.Config) // changes the Envoy config before the emulator starts
	// mtls replaces the certificates of the Envoy-extproc link (by default
	// the shipped names: extproc pd-extproc.pd-extproc.svc, Envoy
	// envoy.pd-extproc, the one extproc admits).
	mtls *testbed.MTLS
	// kvEvents, when set, has every simulator publish its KV events (and
	// serve replays) on ports of its own IP, and both pools follow them
	// with these kv_events keys besides the ports (e.g. "stale_after: 2s"):
	// their policy must be prefix-affinity (the prefill pool's only when it
	// has simulators).
	kvEvents []string
	// prefixCacheBlocks sizes the simulators' prefix caches, and kvBlocks
	// their KV caches, whose size they report (0: pdsim's).
	prefixCacheBlocks, kvBlocks int
	// noRender: the simulators have no render endpoints (older vLLM).
	noRender bool
	lora     []string // LoRA adapters the simulators serve besides pdsim
	// maxModelLen is the simulators' context (0: pdsim's, 32768).
	maxModelLen int
	// stopOneToken: a prefill's one-token answer stops on a stop token
	// where the request allows it, and a NIXL prefill then gives no params.
	stopOneToken bool
	apiKey       string // the key every simulator asks of its callers (--api-key)
	// ipv6 puts every simulator on ::1 (one host, so at most one SGLang
	// prefill: its bootstrap port is the pool's).
	ipv6 bool
	// oneClient keeps the shipped configs' hash on the client's address
	// (docs/envoy.md §14): the rig's requests, all from 127.0.0.1, then all
	// meet one replica. Without it, testbed.ManyClients.
	oneClient bool
	args      []string // more extproc flags
	// gatewayFallbacks: the emulator is a gateway that takes the fallback
	// list and reports the endpoint that served (testbed.GatewayFallbacks).
	gatewayFallbacks bool
}

// simIP is the loopback IP of the rig's i-th simulator of a role: each has
// its own, like engines on their own hosts, so SGLang prefills can share one
// bootstrap port as the pool config says.
func simIP(role string, i int) string {
	if role == pdsim.RoleDecode {
		return fmt.Sprintf("127.0.0.%d", 40+i)
	}
	return fmt.Sprintf("127.0.0.%d", 30+i)
}

func startRig(t *testing.T, o rigOptions) *rig {
	t.Helper()
	o.mode = cmp.Or(o.mode, "full_duplex")
	o.connector = cmp.Or(o.connector, "kv-nixl")
	o.prefillRole = cmp.Or(o.prefillRole, pdsim.RolePrefill)
	if o.prefills == 0 {
		o.prefills = 2
	}
	if o.decodes == 0 {
		o.decodes = 2
	}
	r := &rig{mode: o.mode, connector: o.connector, args: o.args, sim: testbed.SimConfig{
		Protocol: testbed.Protocols[o.connector], SharedDir: t.TempDir(),
		Timings: testbed.Timings{
			TTFT: time.Millisecond, TPOT: time.Millisecond, KVTransfer: time.Millisecond,
			OutputTokens: cmp.Or(o.outputTokens, 5), HandshakeTimeout: cmp.Or(o.handshake, 10*time.Second),
		},
		PromptTokensDetails: o.promptTokensDetails,
		PrefixCacheBlocks:   o.prefixCacheBlocks,
		KVBlocks:            o.kvBlocks,
		NoRender:            o.noRender,
		LoRA:                o.lora,
		MaxModelLen:         o.maxModelLen,
		StopOneToken:        o.stopOneToken,
		APIKey:              o.apiKey,
		Log:                 logTo(t),
	}}
	if _, err := testbed.WithFreshPorts(func() (struct{}, error) { return struct{}{}, r.startSims(t, o) }); err != nil {
		t.Fatal(err)
	}
	if o.kvEvents != nil {
		keys := append([]string{fmt.Sprint("connect_port: ", r.sim.KVEventsPort), fmt.Sprint("replay_port: ", r.sim.KVReplayPort)}, o.kvEvents...)
		events := "kv_events: {" + strings.Join(keys, ", ") + "}"
		with := func(keys string) string {
			return strings.Join(slices.DeleteFunc([]string{keys, events}, func(s string) bool { return s == "" }), ", ")
		}
		if o.prefills > 0 {
			o.prefillPool = with(o.prefillPool)
		}
		o.decodePool = with(o.decodePool)
	}
	prefillAddrs, decodeAddrs := testbed.Addrs(r.prefill), testbed.Addrs(r.decode)
	if o.prefillAddrs != nil {
		prefillAddrs = o.prefillAddrs(r.prefill)
	}
	if o.decodeAddrs != nil {
		decodeAddrs = o.decodeAddrs(r.decode)
	}
	r.decodeAddrs = decodeAddrs
	more := func(keys string) string {
		if keys == "" {
			return ""
		}
		return ", " + keys
	}
	r.config = fmt.Sprintf("connector: %s\npools:\n  prefill: {endpoints: [%s], bootstrap_port: %d%s}\n  decode: {endpoints: [%s]%s}\n%s\n",
		o.connector, testbed.QuoteAll(prefillAddrs), r.sim.BootstrapPort, more(o.prefillPool), testbed.QuoteAll(decodeAddrs), more(o.decodePool), o.extra)
	// Envoy and extproc speak mTLS, as every shipped config has them do.
	r.mtls = o.mtls
	if r.mtls == nil {
		r.mtls = testbed.MustNewMTLS(t, testbed.MTLSConfig{})
	}
	r.extproc = r.startExtproc(t, "")
	r.replicas = []*extproc{r.extproc}
	for range o.replicas - 1 {
		r.replicas = append(r.replicas, r.startExtproc(t, ""))
	}
	var addrs []string
	for _, x := range r.replicas {
		addrs = append(addrs, x.GRPCAddr)
		if o.connector == "kv-mooncake" { // a prefill engine whose id is not read yet takes no P/D request
			for _, p := range prefillAddrs {
				series := fmt.Sprintf(`pd_extproc_endpoint_engine_ranks{endpoint=%q,pool="prefill"}`, p)
				waitFor(t, 10*time.Second, "the engine ids of "+p, func() bool { return x.MustMetric(t, series) >= 1 })
			}
		}
	}

	r.proxy = testbed.MustStartEnvoyOn(t, testbed.EnvoyConfigs[o.mode], addrs, func(cfg *envoyemu.Config) {
		cfg.Logf = t.Logf
		r.mtls.Envoy(cfg)
		if !o.oneClient {
			testbed.ManyClients(cfg)
		}
		if o.gatewayFallbacks {
			testbed.GatewayFallbacks(cfg)
		}
		if o.envoy != nil {
			o.envoy(cfg)
		}
	})
	return r
}

// startSims runs the rig's simulators on ports they share (the SGLang
// bootstrap port, the KV events ports), each on its own IP. Those ports are
// free on 127.0.0.1 when they are drawn; another rig's simulator on the same
// IPs may hold one. On an error every simulator started is closed again; a
// port taken wraps EADDRINUSE, for the caller to draw again.
func (r *rig) startSims(t *testing.T, o rigOptions) error {
	t.Helper()
	r.prefill, r.decode = nil, nil
	r.sim.BootstrapPort = testbed.MustFreePort(t)
	if o.kvEvents != nil {
		r.sim.KVEventsPort, r.sim.KVReplayPort = testbed.MustFreePort(t), testbed.MustFreePort(t)
	}
	var started testbed.Cleanups
	start := func(sims *[]*pdsim.Server, role, ip string) error {
		s, err := testbed.StartSim(&started, r.simConfig(role, ip, ""))
		if err == nil {
			*sims = append(*sims, s)
		}
		return err
	}
	var err error
	ip := simIP
	if o.ipv6 {
		ip = func(string, int) string { return "::1" }
	}
	for i := 0; i < max(o.prefills, 0) && err == nil; i++ {
		err = start(&r.prefill, o.prefillRole, ip(pdsim.RolePrefill, i))
	}
	for i := 0; i < o.decodes && err == nil; i++ {
		err = start(&r.decode, pdsim.RoleDecode, ip(pdsim.RoleDecode, i))
	}
	if err != nil {
		started.Close()
		return err
	}
	t.Cleanup(started.Close)
	return nil
}

// simConfig is one of the rig's simulators on ip (addr overrides the HTTP
// address, to start one again in place).
func (r *rig) simConfig(role, ip, addr string) testbed.SimConfig {
	cfg := r.sim
	cfg.Role, cfg.IP, cfg.Addr = role, ip, addr
	return cfg
}

// restartDecode starts decode simulator i again on the address it had, after
// it was closed.
func (r *rig) restartDecode(t *testing.T, i int, addr string) {
	t.Helper()
	ip, _ := hostPort(t, addr)
	r.decode[i] = testbed.MustStartSim(t, r.simConfig(pdsim.RoleDecode, ip, addr))
}

// restartExtproc starts extproc again, after it was killed, with the same
// config on the same gRPC port.
func (r *rig) restartExtproc(t *testing.T) {
	t.Helper()
	r.extproc = r.startExtproc(t, r.extproc.GRPCAddr)
	r.replicas[0] = r.extproc
}

// startExtproc runs one extproc of the rig, on grpcAddr when it is given.
func (r *rig) startExtproc(t *testing.T, grpcAddr string) *extproc {
	t.Helper()
	return startExtproc(t, testbed.ExtprocConfig{Config: r.config, GRPCAddr: grpcAddr, MTLS: r.mtls, Args: r.args})
}

// send posts body to path through the emulator; the context bounds it.
func (r *rig) send(ctx context.Context, path, body string, header http.Header) (*http.Response, string, error) {
	return testbed.Post(ctx, r.proxy.URL()+path, body, header)
}

// stream sends a streamed request that has to answer 200 and send its first
// bytes before ctx ends; the caller reads the rest, and the body is closed
// when the test ends.
func (r *rig) stream(t *testing.T, ctx context.Context, path, body string) *http.Response {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.proxy.URL()+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := testbed.Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("stream %s: status %d", path, resp.StatusCode)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 1)); err != nil {
		t.Fatalf("stream %s: no first byte: %v", path, err)
	}
	return resp
}

// get sends GET path, which has to come back whole.
func (r *rig) get(t *testing.T, path string) (*http.Response, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.proxy.URL()+path, nil)
	resp, err := testbed.Client.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return resp, string(b)
}

// must sends a request that has to come back whole.
func (r *rig) must(t *testing.T, path, body string, header http.Header) (*http.Response, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp, got, err := r.send(ctx, path, body, header)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	return resp, got
}

// clearPrefillFaults makes every prefill simulator well again.
func (r *rig) clearPrefillFaults() {
	for _, p := range r.prefill {
		p.SetFaults(pdsim.Faults{})
	}
}

// healthy checks extproc still serves: /healthz answers 200 and an ordinary
// request completes through Envoy.
func (r *rig) healthy(t *testing.T, marker string) {
	t.Helper()
	r.alive(t)
	path, body := request("chat", true, marker)
	if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
		t.Fatalf("an ordinary request after the fault: status %d: %.300s", resp.StatusCode, got)
	} else {
		checkCompletion(t, true, got)
	}
}

// alive checks extproc's /healthz answers 200.
func (r *rig) alive(t *testing.T) {
	t.Helper()
	resp, err := http.Get("http://" + r.extproc.AdminAddr + "/healthz")
	if err != nil {
		t.Fatalf("/healthz: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/healthz answered %d", resp.StatusCode)
	}
}

// metric reads one sample from extproc's /metrics: the first line that starts
// with series (a metric name, with labels if they matter); -1 when absent.
func (r *rig) metric(t *testing.T, series string) float64 {
	t.Helper()
	return r.extproc.MustMetric(t, series)
}
