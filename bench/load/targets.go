package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// Targets, as named on the command line.
const (
	TargetPD     = "pd"      // extproc, kv-nixl, the -prefill simulator (pdsim by default)
	TargetPDFake = "pd-fake" // extproc, kv-nixl, the canned-answer fake prefill: extproc's own P/D cost
	TargetDecode = "decode"  // extproc without prefill endpoints: decode-only
	TargetEcho   = "echo"    // the floor
)

// Prefill simulators.
const (
	SimPdsim = "pdsim" // bin/pdsim --role prefill --protocol vllm-nixl, every latency zero
	SimFake  = "fake"  // children.go: a canned vLLM answer, the body read and dropped
)

// isPD reports whether target runs the P/D flow.
func isPD(target string) bool { return target == TargetPD || target == TargetPDFake }

// prefillSim is the simulator target uses.
func (l *Launcher) prefillSim(target string) string {
	if target == TargetPDFake {
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
}

// Stop ends every process of the target; keepLogs false deletes their logs
// (extproc writes a line per request: gigabytes over a run).
func (t *Target) Stop(keepLogs bool) {
	for _, p := range []*Process{t.Server, t.Prefill} {
		if p == nil {
			continue
		}
		p.Stop()
		if !keepLogs {
			os.Remove(p.log.Name())
		}
	}
}

// Process is a child process with its listen addresses.
type Process struct {
	Name      string
	cmd       *exec.Cmd
	exited    chan struct{}
	log       *os.File
	GRPCAddr  string // ext_proc servers
	AdminAddr string // /metrics (go_goroutines) and, when served, /debug/pprof
	HTTPAddr  string // prefill simulators
}

// Pid is the child's process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Stop asks the child to stop (SIGTERM), then kills it after a grace period.
func (p *Process) Stop() {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(5 * time.Second):
		p.cmd.Process.Kill()
		<-p.exited
	}
	p.log.Close()
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
	t := &Target{Name: name}
	var err error
	switch name {
	case TargetEcho:
		t.Server, err = l.startGRPC(ctx, "echo", filepath.Join(l.BinDir, "echo"))
	case TargetDecode:
		t.Server, err = l.startExtproc(ctx, nil)
	case TargetPD, TargetPDFake:
		if t.Prefill, err = l.StartPrefill(ctx, l.prefillSim(name)); err != nil {
			return nil, err
		}
		t.Server, err = l.startExtproc(ctx, []string{t.Prefill.HTTPAddr})
	default:
		err = fmt.Errorf("unknown target %q (want %s, %s, %s or %s)", name, TargetPD, TargetPDFake, TargetDecode, TargetEcho)
	}
	if err != nil {
		t.Stop(true)
		return nil, err
	}
	return t, nil
}

// extprocConfig is the config of targets pd and decode: kv-nixl, one decode
// endpoint that is never dialled (Envoy, not extproc, sends the decode leg),
// and the prefill endpoints given (none: every request is decode-only).
func extprocConfig(prefill []string) string {
	quoted := make([]string, len(prefill))
	for i, a := range prefill {
		quoted[i] = fmt.Sprintf("%q", a)
	}
	return fmt.Sprintf(`connector: kv-nixl
pools:
  prefill: {endpoints: [%s]}
  decode: {endpoints: ["127.0.0.1:8201"]}
`, strings.Join(quoted, ", "))
}

func (l *Launcher) startExtproc(ctx context.Context, prefill []string) (*Process, error) {
	l.seq++
	cfg := filepath.Join(l.LogDir, fmt.Sprintf("extproc-%d.yaml", l.seq))
	if err := os.WriteFile(cfg, []byte(extprocConfig(prefill)), 0o644); err != nil {
		return nil, err
	}
	args := []string{"--config", cfg}
	if l.Pprof {
		args = append(args, "--pprof")
	}
	return l.startGRPC(ctx, "extproc", filepath.Join(l.BinDir, "extproc"), args...)
}

// startGRPC starts an ext_proc server and waits until its health service answers.
func (l *Launcher) startGRPC(ctx context.Context, name, bin string, args ...string) (*Process, error) {
	return withFreshPorts(func() (*Process, error) {
		grpcAddr, adminAddr := freeAddr(), freeAddr()
		p, err := l.spawn(name, bin, append(args, "--grpc-addr", grpcAddr, "--admin-addr", adminAddr)...)
		if err != nil {
			return nil, err
		}
		p.GRPCAddr, p.AdminAddr = grpcAddr, adminAddr
		return p, waitReady(ctx, p, func(ctx context.Context) error { return grpcHealthy(ctx, grpcAddr) })
	})
}

// withFreshPorts retries start while the child lost the race for a port
// freeAddr picked: the driver's own connections draw from the same range.
func withFreshPorts(start func() (*Process, error)) (*Process, error) {
	for attempt := 1; ; attempt++ {
		p, err := start()
		if err == nil {
			return p, nil
		}
		if p == nil {
			return nil, err
		}
		p.Stop()
		if attempt == 5 || !p.logContains("address already in use") {
			return nil, err
		}
		os.Remove(p.log.Name())
	}
}

func (p *Process) logContains(s string) bool {
	b, err := os.ReadFile(p.log.Name())
	return err == nil && strings.Contains(string(b), s)
}

// StartPrefill starts a zero-latency prefill simulator: pdsim with every
// latency at zero and one output token, or this driver's fake (children.go).
func (l *Launcher) StartPrefill(ctx context.Context, sim string) (*Process, error) {
	return withFreshPorts(func() (*Process, error) {
		addr := freeAddr()
		var p *Process
		var err error
		switch sim {
		case SimPdsim:
			p, err = l.spawn("pdsim", filepath.Join(l.BinDir, "pdsim"), "--role", "prefill", "--protocol", "vllm-nixl",
				"--model", Model, "--addr", addr, "--kv-addr", "127.0.0.1:0",
				"--ttft", "0", "--tpot", "0", "--kv-transfer", "0", "--output-tokens", "1")
		case SimFake:
			var self string
			if self, err = os.Executable(); err == nil {
				p, err = l.spawn("fake-prefill", self, "-child", childPrefill, "-addr", addr)
			}
		default:
			err = fmt.Errorf("prefill simulator %q: want %s or %s", sim, SimPdsim, SimFake)
		}
		if err != nil {
			return nil, err
		}
		p.HTTPAddr = addr
		return p, waitReady(ctx, p, func(ctx context.Context) error { return httpHealthy(ctx, "http://"+addr+"/health") })
	})
}

func (l *Launcher) spawn(name, bin string, args ...string) (*Process, error) {
	l.seq++
	log, err := os.Create(filepath.Join(l.LogDir, fmt.Sprintf("%03d-%s.log", l.seq, name)))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &Process{Name: name, cmd: cmd, exited: make(chan struct{}), log: log}
	go func() { cmd.Wait(); close(p.exited) }()
	return p, nil
}

// waitReady polls check until it succeeds, the child exits or 20 s pass.
func waitReady(ctx context.Context, p *Process, check func(context.Context) error) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := check(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-p.exited:
			return fmt.Errorf("%s exited before it was ready; see %s", p.Name, p.log.Name())
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after 20s: %v; see %s", p.Name, err, p.log.Name())
		}
	}
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

func httpHealthy(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return errors.New(resp.Status)
	}
	return nil
}

// freeAddr returns a loopback address with a port free at the time of the call.
// Children need an address on their command line; the window in which another
// process could take the port is tiny on a benchmark machine.
func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().String()
}
