package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// Targets, as named on the command line.
const (
	TargetPD     = "pd"      // extproc, kv-nixl, the -prefill simulator (pdsim by default)
	TargetPDFake = "pd-fake" // extproc, kv-nixl, the canned-answer fake prefill: extproc's own P/D cost
	// TargetPDUsage is pd-fake with response.rewrite_usage on: in a response
	// cell it rewrites the answer's usage, where pd-fake passes it through.
	TargetPDUsage = "pd-usage"
	TargetDecode  = "decode" // extproc without prefill endpoints: decode-only
	TargetEcho    = "echo"   // the floor
)

// Prefill simulators.
const (
	SimPdsim = "pdsim" // bin/pdsim --role prefill --protocol vllm-nixl, every latency zero
	SimFake  = "fake"  // children.go: a canned vLLM answer, the body read and dropped
)

// targetSpec is what a target runs: its binary and, for the P/D flow, which
// prefill simulator and whether extproc rewrites the answers' usage.
type targetSpec struct {
	binary                          string // in -bin
	pd, fakePrefill, rewritingUsage bool   // fakePrefill false: the -prefill simulator
}

var targetSpecs = map[string]targetSpec{
	TargetPD:      {binary: "extproc", pd: true},
	TargetPDFake:  {binary: "extproc", pd: true, fakePrefill: true},
	TargetPDUsage: {binary: "extproc", pd: true, fakePrefill: true, rewritingUsage: true},
	TargetDecode:  {binary: "extproc"},
	TargetEcho:    {binary: "echo"},
}

// targetOf is the spec of the target named on the command line.
func targetOf(name string) (targetSpec, error) {
	if t, ok := targetSpecs[name]; ok {
		return t, nil
	}
	return targetSpec{}, fmt.Errorf("unknown target %q (want one of %s)", name, strings.Join(slices.Sorted(maps.Keys(targetSpecs)), ", "))
}

// isPD reports whether target runs the P/D flow.
func isPD(target string) bool { return targetSpecs[target].pd }

// prefillSim is the simulator target uses.
func (l *Launcher) prefillSim(target string) string {
	if targetSpecs[target].fakePrefill {
		return SimFake
	}
	return l.Prefill
}

// Target is a server under test and whatever it needs, started fresh per cell
// so each cell's memory, CPU and goroutine counts are its own.
type Target struct {
	Name    string
	Server  *Process // the ext_proc server measured
	Prefill *Process // the prefill simulator (pd only)
	group
}

// group is child processes started together, and their logs.
type group struct {
	stop testbed.Cleanups
	logs []*os.File
}

// Stop ends every process of the group; keepLogs false deletes their logs
// (extproc writes a line per request: gigabytes over a run).
func (g *group) Stop(keepLogs bool) {
	g.stop.Close()
	for _, f := range g.logs {
		f.Close()
		if !keepLogs {
			os.Remove(f.Name())
		}
	}
	g.logs = nil
}

// Process is a child process with its listen addresses.
type Process struct {
	*testbed.Process
	GRPCAddr  string // ext_proc servers
	AdminAddr string // /metrics (go_goroutines) and, when served, /debug/pprof
	HTTPAddr  string // prefill simulators
}

// Launcher starts the child processes of a run.
type Launcher struct {
	BinDir   string // bin/extproc, bin/echo, bin/pdsim
	LogDir   string // one log file per child, for post-mortems
	Prefill  string // simulator of target pd: SimPdsim or SimFake
	Pprof    bool   // extproc serves /debug/pprof (its --pprof flag)
	KeepLogs bool   // keep the logs of targets that worked
	seq      int
}

// Start brings up target name, ready to serve.
func (l *Launcher) Start(ctx context.Context, name string) (*Target, error) {
	spec, err := targetOf(name)
	if err != nil {
		return nil, err
	}
	t := &Target{Name: name}
	switch {
	case spec.binary == "echo":
		t.Server, err = l.startEcho(ctx, &t.group)
	case !spec.pd:
		t.Server, err = l.startExtproc(ctx, &t.group, extprocConfig(nil, false))
	default:
		if t.Prefill, err = l.StartPrefill(ctx, &t.group, l.prefillSim(name)); err != nil {
			break
		}
		t.Server, err = l.startExtproc(ctx, &t.group, extprocConfig([]string{t.Prefill.HTTPAddr}, spec.rewritingUsage))
	}
	if err != nil {
		t.Stop(true)
		return nil, err
	}
	return t, nil
}

// extprocConfig is the config of targets pd and decode: kv-nixl, one decode
// endpoint that is never dialled (Envoy, not extproc, sends the decode leg),
// the prefill endpoints given (none: every request is decode-only), and
// response.rewrite_usage.
func extprocConfig(prefill []string, rewriteUsage bool) string {
	return fmt.Sprintf(`connector: kv-nixl
pools:
  prefill: {endpoints: [%s]}
  decode: {endpoints: ["127.0.0.1:8201"]}
response: {rewrite_usage: %v}
`, testbed.QuoteAll(prefill), rewriteUsage)
}

// startExtproc starts extproc with config, ready once /readyz answers 200.
func (l *Launcher) startExtproc(ctx context.Context, g *group, config string) (*Process, error) {
	log, err := l.logFile(g, "extproc")
	if err != nil {
		return nil, err
	}
	var args []string
	if l.Pprof {
		args = append(args, "--pprof")
	}
	x, err := testbed.StartExtproc(ctx, &g.stop, testbed.ExtprocConfig{
		Bin: filepath.Join(l.BinDir, "extproc"), Config: config, Dir: l.LogDir, Args: args, Log: log,
	})
	if err != nil {
		return nil, fmt.Errorf("%w; see %s", err, log.Name())
	}
	return &Process{Process: x.Process, GRPCAddr: x.GRPCAddr, AdminAddr: x.AdminAddr}, nil
}

// startEcho starts the echo server, ready once its gRPC health service answers.
func (l *Launcher) startEcho(ctx context.Context, g *group) (*Process, error) {
	return l.start(ctx, g, "echo", func(p *Process) testbed.ProcessConfig {
		p.GRPCAddr, p.AdminAddr = testbed.FreeAddrNow(), testbed.FreeAddrNow()
		return testbed.ProcessConfig{
			Bin: filepath.Join(l.BinDir, "echo"), Args: []string{"--grpc-addr", p.GRPCAddr, "--admin-addr", p.AdminAddr},
			Ready: func(ctx context.Context) error { return grpcHealthy(ctx, p.GRPCAddr) },
		}
	})
}

// StartPrefill starts a zero-latency prefill simulator: pdsim with every
// latency at zero and one output token, or this driver's fake (children.go).
func (l *Launcher) StartPrefill(ctx context.Context, g *group, sim string) (*Process, error) {
	var bin string
	var args []string
	switch sim {
	case SimPdsim:
		bin, args = filepath.Join(l.BinDir, "pdsim"), []string{"--role", "prefill", "--protocol", "vllm-nixl",
			"--model", Model, "--kv-addr", "127.0.0.1:0",
			"--ttft", "0", "--tpot", "0", "--kv-transfer", "0", "--output-tokens", "1"}
	case SimFake:
		self, err := os.Executable()
		if err != nil {
			return nil, err
		}
		bin, args = self, []string{"-child", childPrefill}
	default:
		return nil, fmt.Errorf("prefill simulator %q: want %s or %s", sim, SimPdsim, SimFake)
	}
	return l.start(ctx, g, sim+"-prefill", func(p *Process) testbed.ProcessConfig {
		p.HTTPAddr = testbed.FreeAddrNow()
		return testbed.ProcessConfig{
			Bin: bin, Args: append(slices.Clip(args), "--addr", p.HTTPAddr),
			Ready: testbed.HTTPOK("http://" + p.HTTPAddr + "/health"),
		}
	})
}

// start runs the child that config describes, with free ports it picks into
// p, logging to a file of its own; again with fresh ports while the child
// loses the race for one.
func (l *Launcher) start(ctx context.Context, g *group, name string, config func(p *Process) testbed.ProcessConfig) (*Process, error) {
	log, err := l.logFile(g, name)
	if err != nil {
		return nil, err
	}
	return testbed.WithFreshPorts(func() (*Process, error) {
		p := &Process{}
		cfg := config(p)
		cfg.Name, cfg.Log = name, log
		var err error
		if p.Process, err = testbed.StartProcess(ctx, &g.stop, cfg); err != nil {
			return nil, fmt.Errorf("%w; see %s", err, log.Name())
		}
		return p, nil
	})
}

// logFile creates the log of a child of g.
func (l *Launcher) logFile(g *group, name string) (*os.File, error) {
	l.seq++
	f, err := os.Create(filepath.Join(l.LogDir, fmt.Sprintf("%03d-%s.log", l.seq, name)))
	if err != nil {
		return nil, err
	}
	g.logs = append(g.logs, f)
	return f, nil
}

func grpcHealthy(ctx context.Context, addr string) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return err
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return errors.New(resp.GetStatus().String())
	}
	return nil
}
