// Package e2e runs the whole path on loopback: the Envoy emulator (driven by
// config/envoy/envoy.yaml), the real extproc binary, and engine simulators.
package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// extprocBin is built once for the package from the working tree.
var extprocBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "pd-e2e")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	extprocBin = filepath.Join(dir, "extproc")
	build := exec.Command("go", "build", "-o", extprocBin, "./cmd/extproc")
	build.Dir = repoRoot()
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building extproc:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// repoRoot is the module root, where config/ lives: go test runs a package in its own directory.
func repoRoot() string {
	root, err := filepath.Abs("../..")
	if err != nil {
		panic(err)
	}
	return root
}

// extproc is a running extproc process.
type extproc struct {
	GRPCAddr, AdminAddr string
	ConfigPath          string // the --config file, watched by extproc
	cmd                 *exec.Cmd
	mu                  sync.Mutex
	log                 strings.Builder
}

// Logs returns what the process has logged so far.
func (x *extproc) Logs() string {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.log.String()
}

// waitLog waits, bounded, until extproc has logged a line containing s.
func (x *extproc) waitLog(t *testing.T, s string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(x.Logs(), s) {
		if time.Now().After(deadline) {
			t.Fatalf("extproc never logged %q:\n%s", s, x.Logs())
		}
		time.Sleep(10 * time.Millisecond) // polling a log we do not control: bounded above
	}
}

// startExtproc runs the binary with configYAML on loopback ports it picks itself,
// and learns them from its "serving" log line.
func startExtproc(t *testing.T, configYAML string, args ...string) *extproc {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "extproc.yaml")
	if err := os.WriteFile(cfg, []byte(configYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	x := &extproc{ConfigPath: cfg, cmd: exec.Command(extprocBin, append([]string{"--config", cfg,
		"--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "-v", "1", "--log-flush-interval", "0"}, args...)...)}
	stderr, err := x.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := x.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			x.mu.Lock()
			x.log.WriteString(line + "\n")
			x.mu.Unlock()
			var entry struct{ Msg, GRPC, Admin string }
			if x.GRPCAddr == "" && json.Unmarshal([]byte(line), &entry) == nil && entry.Msg == "extproc serving" {
				x.GRPCAddr, x.AdminAddr = entry.GRPC, entry.Admin
				close(ready)
			}
		}
		io.Copy(io.Discard, stderr)
	}()
	t.Cleanup(func() {
		x.cmd.Process.Signal(syscall.SIGTERM)
		x.cmd.Wait()
		if t.Failed() {
			t.Logf("extproc logs:\n%s", x.Logs())
		}
	})
	select {
	case <-ready:
	case <-exited:
		t.Fatalf("extproc exited at start:\n%s", x.Logs())
	case <-time.After(30 * time.Second):
		t.Fatalf("extproc did not start:\n%s", x.Logs())
	}
	return x
}
