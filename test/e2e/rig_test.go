package e2e

import (
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
)

// rig is one deployment on loopback: the Envoy emulator in front of extproc, two
// prefill and two decode engine simulators.
type rig struct {
	proxy            *envoyemu.Proxy
	extproc          *extproc
	prefill, decode  []*pdsim.Server
	connector, proto string
}

// envoyYAML is the bootstrap for each request body mode: the files users run.
var envoyYAML = map[string]string{
	"full_duplex": "config/envoy/envoy.yaml",
	"buffered":    "config/envoy/envoy-buffered.yaml",
}

// protocols maps a connector to the simulators' protocol.
var protocols = map[string]string{
	"kv-nixl":           pdsim.ProtocolNIXL,
	"kv-shared-storage": pdsim.ProtocolSharedStorage,
	"kv-sglang":         pdsim.ProtocolSGLang,
}

type rigOptions struct {
	decodeAddrs []string // overrides the decode pool (e.g. a dead endpoint)
	prefillPool string   // more keys of pools.prefill, e.g. "policy: round-robin"
	extra       string   // more top-level extproc config
}

func startRig(t *testing.T, mode, connector string, opts rigOptions) *rig {
	t.Helper()
	r := &rig{connector: connector, proto: protocols[connector]}
	shared := t.TempDir()
	// Each simulator has its own loopback IP, like engines on their own hosts, so
	// SGLang prefills can share one bootstrap port as the pool config says.
	bootstrapPort := freePort(t)
	start := func(role string, ip string) *pdsim.Server {
		s, err := pdsim.Start(pdsim.Config{
			Role: role, Protocol: r.proto, SharedDir: shared,
			Addr: ip + ":0", KVAddr: ip + ":0", BootstrapAddr: fmt.Sprintf("%s:%d", ip, bootstrapPort),
			TTFT: time.Millisecond, TPOT: time.Millisecond, KVTransfer: time.Millisecond,
			OutputTokens: 5, HandshakeTimeout: 10 * time.Second, Log: testWriter{t},
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	var prefillAddrs, decodeAddrs []string
	for i := range 2 {
		p, d := start(pdsim.RolePrefill, fmt.Sprintf("127.0.0.%d", 10+i)), start(pdsim.RoleDecode, fmt.Sprintf("127.0.0.%d", 20+i))
		r.prefill, r.decode = append(r.prefill, p), append(r.decode, d)
		prefillAddrs, decodeAddrs = append(prefillAddrs, p.Addr()), append(decodeAddrs, d.Addr())
	}
	if opts.decodeAddrs != nil {
		decodeAddrs = opts.decodeAddrs
	}
	r.extproc = startExtproc(t, fmt.Sprintf(`connector: %s
pools:
  prefill: {endpoints: [%s], bootstrap_port: %d, %s}
  decode: {endpoints: [%s]}
%s`, connector, quoteAll(prefillAddrs), bootstrapPort, opts.prefillPool, quoteAll(decodeAddrs), opts.extra))

	cfg, err := envoyemu.LoadConfig(filepath.Join(repoRoot(), envoyYAML[mode]))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Logf = t.Logf
	r.proxy, err = envoyemu.Start(cfg, r.extproc.GRPCAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.proxy.Close() })
	return r
}

// freePort returns a TCP port that is free on loopback now.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func quoteAll(addrs []string) string {
	q := make([]string, len(addrs))
	for i, a := range addrs {
		q[i] = fmt.Sprintf("%q", a)
	}
	return strings.Join(q, ", ")
}

// served returns the record of requestID on whichever simulator saw it.
func served(t *testing.T, sims []*pdsim.Server, pick func(pdsim.Record) bool) (*pdsim.Server, pdsim.Record) {
	t.Helper()
	var found *pdsim.Server
	var rec pdsim.Record
	for _, s := range sims {
		for _, r := range s.Requests() {
			if pick(r) {
				if found != nil {
					t.Fatalf("two simulators served the same leg: %s and %s", found.Addr(), s.Addr())
				}
				found, rec = s, r
			}
		}
	}
	if found == nil {
		t.Fatal("no simulator served the leg")
	}
	return found, rec
}

// testWriter sends simulator logs to the test log (shown on failure or -v).
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
