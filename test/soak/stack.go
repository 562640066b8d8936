package main

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// stack is one connector's deployment: a real extproc process, two prefill
// and two decode simulators, and an Envoy emulator per body mode in front.
type stack struct {
	connector string
	extproc   *testbed.Extproc
	proxies   map[string]*envoyemu.Proxy // by mode
	engines   *engines
	kills     *windows     // a decode engine down (faults.go)
	saturated *windows     // a pool's engines reporting full queues (faults.go)
	routes    *routeCounts // stats.go
	usage     *usage       // stats.go
}

// engines are a stack's simulators; a killed decode is replaced in place.
type engines struct {
	c   testbed.Cleaner
	sim testbed.SimConfig // what every simulator of the stack shares
	n   int               // the stack's number: its simulators' IPs are 127.0.<10+n>.x

	mu              sync.Mutex
	prefill, decode []*pdsim.Server
}

// Shedding: one request in eight names soakObjective, of a negative
// priority; saturate (faults.go) makes a pool's engines report soakLine
// requests waiting, extproc's admission.saturated_queue, and extproc holds
// such requests for up to soakHold before it refuses them. The line is far
// above what the soak's own requests queue (kv-mooncake's prefill engines
// count the legs whose decode was killed, waiting for their pull, and reach
// 4), and the KV caches hold over a thousand 1 MiB prompts (a NIXL prefill keeps
// the blocks no decode pulled for its 30 s lease, and pdsim's default cache
// is full with one), so that only saturate's windows saturate a pool.
const (
	soakObjective = "soak-batch"
	soakLine      = 50
	soakHold      = 2 * time.Second
	soakKVBlocks  = 16 << 20
)

// soakTimings: a short handshake bound, so a kv-sglang decode whose prefill
// leg failed gives up after it (see knownIssues).
var soakTimings = testbed.Timings{
	TTFT: 2 * time.Millisecond, TPOT: time.Millisecond, KVTransfer: time.Millisecond,
	OutputTokens: 8, HandshakeTimeout: 2 * time.Second,
}

// soakMaxModelLen is the simulated model's context: room for the 1 MiB
// prompts (some 175,000 of the simulator's tokens), which pdsim's default,
// a small model's 32,768, refuses as vLLM would.
const soakMaxModelLen = 1 << 20

func startStack(ctx context.Context, c testbed.Cleaner, tmp, bin, connector string, n int) (*stack, error) {
	port, err := testbed.FreePort()
	if err != nil {
		return nil, err
	}
	e := &engines{c: c, n: n, sim: testbed.SimConfig{
		Protocol: testbed.Protocols[connector], SharedDir: filepath.Join(tmp, connector),
		BootstrapPort: port, Timings: soakTimings, KVBlocks: soakKVBlocks,
		MaxModelLen: soakMaxModelLen,
	}}
	for i := range 2 {
		p, err := e.start(pdsim.RolePrefill, i, "")
		if err != nil {
			return nil, err
		}
		d, err := e.start(pdsim.RoleDecode, i, "")
		if err != nil {
			return nil, err
		}
		e.prefill, e.decode = append(e.prefill, p), append(e.decode, d)
	}
	s := &stack{connector: connector, engines: e, proxies: map[string]*envoyemu.Proxy{},
		kills: &windows{}, saturated: &windows{}, routes: &routeCounts{n: map[string]int{}}, usage: &usage{}}
	mtls, err := testbed.NewMTLS(c, testbed.MTLSConfig{})
	if err != nil {
		return nil, err
	}
	s.extproc, err = testbed.StartExtproc(ctx, c, testbed.ExtprocConfig{
		Bin: bin, Dir: tmp, Log: testbed.LineFunc(s.routes.add), MTLS: mtls,
		Config: fmt.Sprintf(`connector: %s
pools:
  prefill: {endpoints: [%s], bootstrap_port: %d, metrics: {interval: 250ms}}
  decode: {endpoints: [%s], health: {check_interval: 1s}, metrics: {interval: 250ms}}
admission: {objectives: {%s: -1}, saturated_queue: %d, hold: %v}
`, connector, testbed.QuoteAll(testbed.Addrs(e.prefill)), port, testbed.QuoteAll(testbed.Addrs(e.decode)), soakObjective, soakLine, soakHold),
		// --pprof: the goroutine profile tells idle connection pools from
		// work left behind; the soak reads request lines as they come.
		Args: []string{"--pprof", "--log-flush-interval", "0"},
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", connector, err)
	}
	for _, mode := range testbed.Modes {
		if s.proxies[mode], err = testbed.StartEnvoy(c, testbed.EnvoyConfigs[mode], s.extproc.GRPCAddr, mtls.Envoy); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// start runs the stack's i-th simulator of role (addr: on the address a
// killed one had).
func (e *engines) start(role string, i int, addr string) (*pdsim.Server, error) {
	base := 50
	if role == pdsim.RoleDecode {
		base = 60
	}
	cfg := e.sim
	cfg.Role, cfg.IP, cfg.Addr = role, fmt.Sprintf("127.0.%d.%d", 10+e.n, base+i), addr
	return testbed.StartSim(e.c, cfg)
}
