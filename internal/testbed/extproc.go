package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
)

// BuildExtproc builds cmd/extproc from the working tree into dir and returns
// the binary's path.
func BuildExtproc(dir string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "extproc")
	build := exec.Command("go", "build", "-o", bin, "./cmd/extproc")
	build.Dir, build.Stdout, build.Stderr = root, os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return "", fmt.Errorf("building extproc: %w", err)
	}
	return bin, nil
}

// Wait is when StartExtproc returns.
type Wait int

const (
	// WaitReady waits until GET /readyz answers 200: the pools requests need
	// have an endpoint to route to.
	WaitReady Wait = iota
	// WaitStarted waits only until the admin server answers GET /healthz,
	// for a deployment that starts with no healthy decode endpoint.
	WaitStarted
)

// ExtprocConfig is one extproc process.
type ExtprocConfig struct {
	Bin string // the binary (BuildExtproc, or make's bin/extproc)
	// Config is the YAML of its --config file, written into Dir; empty runs
	// the embedded default config.
	Config string
	Dir    string // default: a new temporary directory, removed on cleanup
	// GRPCAddr and AdminAddr are its listen addresses; default free loopback
	// ports picked now (and picked again if the child loses one of them).
	GRPCAddr, AdminAddr string
	Args                []string  // more flags: -v 1, --pprof, --log-flush-interval 0 ...
	Log                 io.Writer // its output; see ProcessConfig.Log
	Wait                Wait
	// MTLS, when set, serves ext_proc over TLS with its server certificate
	// and requires its client certificate (MTLS.Envoy gives it to the
	// emulator); nil serves plaintext gRPC.
	MTLS *MTLS
}

// Extproc is a running extproc process.
type Extproc struct {
	*Process
	GRPCAddr, AdminAddr string
	ConfigPath          string // the --config file, watched by extproc; "" with the default config
}

// StartExtproc runs extproc, waits as cfg.Wait says and hands its Stop to c.
func StartExtproc(ctx context.Context, c Cleaner, cfg ExtprocConfig) (*Extproc, error) {
	if cfg.Bin == "" {
		return nil, errors.New("testbed: ExtprocConfig.Bin is not set")
	}
	x := &Extproc{}
	if cfg.Config != "" {
		path, err := writeConfig(c, cfg.Dir, cfg.Config)
		if err != nil {
			return nil, err
		}
		x.ConfigPath = path
	}
	start := func() (*Extproc, error) {
		var err error
		if x.GRPCAddr, err = addrOr(cfg.GRPCAddr); err != nil {
			return nil, err
		}
		if x.AdminAddr, err = addrOr(cfg.AdminAddr); err != nil {
			return nil, err
		}
		args := []string{"--grpc-addr", x.GRPCAddr, "--admin-addr", x.AdminAddr}
		if x.ConfigPath != "" {
			args = append(args, "--config", x.ConfigPath)
		}
		if cfg.MTLS != nil {
			args = append(args, cfg.MTLS.ExtprocArgs()...)
		}
		ready := "/readyz"
		if cfg.Wait == WaitStarted {
			ready = "/healthz"
		}
		x.Process, err = StartProcess(ctx, c, ProcessConfig{
			Name: "extproc", Bin: cfg.Bin, Args: append(args, cfg.Args...), Log: cfg.Log,
			Ready: HTTPOK("http://" + x.AdminAddr + ready),
		})
		if err != nil {
			return nil, err
		}
		return x, nil
	}
	if cfg.GRPCAddr != "" && cfg.AdminAddr != "" {
		return start()
	}
	return WithFreshPorts(start)
}

func addrOr(addr string) (string, error) {
	if addr != "" {
		return addr, nil
	}
	return FreeAddr()
}

// writeConfig writes yaml to a new file in dir (a new temporary directory,
// removed on cleanup, when dir is empty).
func writeConfig(c Cleaner, dir, yaml string) (string, error) {
	if dir == "" {
		tmp, err := os.MkdirTemp("", "pd-extproc-")
		if err != nil {
			return "", err
		}
		c.Cleanup(func() { os.RemoveAll(tmp) })
		dir = tmp
	}
	f, err := os.CreateTemp(dir, "extproc-*.yaml")
	if err != nil {
		return "", err
	}
	_, err = f.WriteString(yaml)
	return f.Name(), errors.Join(err, f.Close())
}

// Metric reads one sample from extproc's /metrics; see Metric.
func (x *Extproc) Metric(ctx context.Context, series string) (float64, error) {
	return Metric(ctx, x.AdminAddr, series)
}

// MustMetric is Metric, -1 when the series is absent; any other error fails t.
func (x *Extproc) MustMetric(t TB, series string) float64 {
	t.Helper()
	v, err := x.Metric(t.Context(), series)
	switch {
	case errors.Is(err, ErrNoSample):
		return -1
	case err != nil:
		t.Fatalf("/metrics: %v", err)
	}
	return v
}
