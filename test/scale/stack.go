package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// Targets: the ext_proc servers a run measures.
const (
	targetPD     = "pd"     // extproc, kv-nixl, P/D with two prefill engines
	targetDecode = "decode" // extproc, every request decode-only
	targetEcho   = "echo"   // bench/echo, the floor
)

// replicas is how many ext_proc servers stand behind the emulators.
const replicas = 2

// server is one child process with the addresses the driver uses.
type server struct {
	*testbed.Process
	addr  string // its serving address: HTTP for engines, gRPC for ext_proc servers, HTTP for emulators
	admin string // /metrics and /debug/pprof of an ext_proc server; /stats of an emulator
}

// stack is one run's processes, stopped together.
type stack struct {
	stop      testbed.Cleanups
	replicas  []server // the ext_proc servers measured
	emulators []server
}

func (s *stack) close() { s.stop.Close() }

// startStack starts the engines, the two ext_proc replicas of target and the
// emulators in front of them.
func startStack(ctx context.Context, o options, target, response string) (*stack, error) {
	s := &stack{}
	fail := func(err error) (*stack, error) {
		s.close()
		return nil, err
	}
	var decodes, prefills []string
	for i := range replicas {
		d, err := s.startEngine(ctx, o, "decode", i)
		if err != nil {
			return fail(err)
		}
		decodes = append(decodes, d.addr)
		if target == targetPD {
			p, err := s.startEngine(ctx, o, "prefill", i)
			if err != nil {
				return fail(err)
			}
			prefills = append(prefills, p.addr)
		}
	}
	for i := range replicas {
		var r server
		var err error
		if target == targetEcho {
			// The echo server routes everything to one destination: each replica
			// its own decode engine, so the engines share the streams as with extproc.
			r, err = s.startEcho(ctx, o, i, decodes[i])
		} else {
			r, err = s.startExtproc(ctx, o, i, prefills, decodes)
		}
		if err != nil {
			return fail(err)
		}
		s.replicas = append(s.replicas, r)
	}
	var grpcAddrs []string
	for _, r := range s.replicas {
		grpcAddrs = append(grpcAddrs, r.addr)
	}
	for i := range o.emulators {
		e, err := s.startEmulator(ctx, o, i, response, grpcAddrs)
		if err != nil {
			return fail(err)
		}
		s.emulators = append(s.emulators, e)
	}
	return s, nil
}

// startEngine runs bin/pdsim in role: a decode streams -tokens tokens, one
// every -tpot; a prefill answers its one token at once.
func (s *stack) startEngine(ctx context.Context, o options, role string, i int) (server, error) {
	args := []string{"--role", role, "--protocol", "vllm-nixl", "--model", model, "--kv-addr", "127.0.0.1:0",
		"--ttft", "20ms", "--kv-transfer", "20ms"}
	if role == "decode" {
		args = append(args, "--tpot", o.tpot.String(), "--output-tokens", strconv.Itoa(o.tokens))
	} else {
		args = append(args, "--tpot", "0s", "--output-tokens", "1")
	}
	return s.start(ctx, o, fmt.Sprintf("pdsim-%s-%d", role, i), func(sv *server) testbed.ProcessConfig {
		sv.addr = testbed.FreeAddrNow()
		return testbed.ProcessConfig{Bin: filepath.Join(o.bin, "pdsim"), Args: append(args, "--addr", sv.addr),
			Ready: testbed.HTTPOK("http://" + sv.addr + "/health")}
	})
}

func (s *stack) startExtproc(ctx context.Context, o options, i int, prefills, decodes []string) (server, error) {
	log, err := s.logFile(o, fmt.Sprintf("extproc-%d", i))
	if err != nil {
		return server{}, err
	}
	pd := "pd: {mode: always}"
	if len(prefills) == 0 {
		pd = "pd: {mode: never}"
	}
	x, err := testbed.StartExtproc(ctx, &s.stop, testbed.ExtprocConfig{
		Bin: filepath.Join(o.bin, "extproc"), Dir: o.logDir, Log: log, Args: []string{"--pprof"},
		Config: fmt.Sprintf("connector: kv-nixl\npools:\n  prefill: {endpoints: [%s], policy: prefix-affinity}\n  decode: {endpoints: [%s]}\n%s\nlimits: {max_concurrent_streams: %d}\n",
			testbed.QuoteAll(prefills), testbed.QuoteAll(decodes), pd, o.streams+o.streams/4),
	})
	if err != nil {
		return server{}, fmt.Errorf("%w; see %s", err, log.Name())
	}
	return server{Process: x.Process, addr: x.GRPCAddr, admin: x.AdminAddr}, nil
}

func (s *stack) startEcho(ctx context.Context, o options, i int, destination string) (server, error) {
	return s.start(ctx, o, fmt.Sprintf("echo-%d", i), func(sv *server) testbed.ProcessConfig {
		sv.addr, sv.admin = testbed.FreeAddrNow(), testbed.FreeAddrNow()
		return testbed.ProcessConfig{Bin: filepath.Join(o.bin, "echo"),
			Args:  []string{"--grpc-addr", sv.addr, "--admin-addr", sv.admin, "--destination", destination},
			Ready: testbed.HTTPOK("http://" + sv.admin + "/healthz")}
	})
}

// startEmulator runs this program as an Envoy emulator child on a shipped
// bootstrap: envoy.yaml with the response path on, envoy-no-response.yaml
// with it off (Envoy closes the ext_proc stream once the request is routed).
func (s *stack) startEmulator(ctx context.Context, o options, i int, response string, extproc []string) (server, error) {
	self, err := os.Executable()
	if err != nil {
		return server{}, err
	}
	bootstrap := testbed.EnvoyConfigs["full_duplex"]
	if response == "off" {
		bootstrap = testbed.EnvoyConfigs["no_response"]
	}
	config, err := testbed.RepoPath(bootstrap)
	if err != nil {
		return server{}, err
	}
	return s.start(ctx, o, fmt.Sprintf("emulator-%d", i), func(sv *server) testbed.ProcessConfig {
		sv.addr, sv.admin = testbed.FreeAddrNow(), testbed.FreeAddrNow()
		return testbed.ProcessConfig{Bin: self, Args: []string{childEmulator, "-config", config, "-listen", sv.addr,
			"-stats", sv.admin, "-extproc", strings.Join(extproc, ",")},
			Ready: testbed.HTTPOK("http://" + sv.admin + "/stats")}
	})
}

// start runs a child with free ports, logging to a file of its own; again
// with fresh ports while it loses the race for one.
func (s *stack) start(ctx context.Context, o options, name string, config func(*server) testbed.ProcessConfig) (server, error) {
	log, err := s.logFile(o, name)
	if err != nil {
		return server{}, err
	}
	return testbed.WithFreshPorts(func() (server, error) {
		var sv server
		cfg := config(&sv)
		cfg.Name, cfg.Log = name, log
		p, err := testbed.StartProcess(ctx, &s.stop, cfg)
		if err != nil {
			return server{}, fmt.Errorf("%w; see %s", err, log.Name())
		}
		sv.Process = p
		return sv, nil
	})
}

func (s *stack) logFile(o options, name string) (*os.File, error) {
	f, err := os.Create(filepath.Join(o.logDir, name+".log"))
	if err != nil {
		return nil, err
	}
	s.stop.Cleanup(func() { f.Close() })
	return f, nil
}

// overflows sums the emulators' circuit-breaker overflows: none is expected
// on the shipped thresholds.
func (s *stack) overflows(ctx context.Context) (uint64, error) {
	var total uint64
	for _, e := range s.emulators {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+e.admin+"/stats", nil)
		if err != nil {
			return 0, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		var stats map[string]envoyemu.ClusterStats
		err = json.NewDecoder(resp.Body).Decode(&stats)
		resp.Body.Close()
		if err != nil {
			return 0, err
		}
		for _, st := range stats {
			total += st.RqPendingOverflow + st.RqActiveOverflow
		}
	}
	return total, nil
}

// splitList reads a comma-separated flag.
func splitList(s string) []string {
	return strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' })
}

// settle lets a freshly started process finish its start-up allocations.
const settle = 2 * time.Second
