package testbed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestCleanupsRunLastFirstOnce(t *testing.T) {
	var c Cleanups
	var got []int
	for i := range 3 {
		c.Cleanup(func() { got = append(got, i) })
	}
	c.Close()
	c.Close()
	if !slices.Equal(got, []int{2, 1, 0}) {
		t.Errorf("ran %v, want [2 1 0]", got)
	}
}

func TestRepoRootHoldsConfig(t *testing.T) {
	for _, file := range EnvoyConfigs {
		if _, err := os.Stat(MustRepoPath(t, file)); err != nil {
			t.Error(err)
		}
	}
	if root := MustRepoRoot(t); MustRepoPath(t, root) != root {
		t.Errorf("RepoPath changed the absolute path %s", root)
	}
}

func TestStartProcessWaitsUntilReady(t *testing.T) {
	dir := t.TempDir()
	flag := filepath.Join(dir, "ready")
	var got []string // written by the copy, read once the child has exited
	p, err := StartProcess(t.Context(), t, ProcessConfig{
		Name: "child", Bin: "sh", Args: []string{"-c", `printf 'one\ntw'; printf 'o\n'; touch "$0"; exec sleep 60`, flag},
		Log: LineFunc(func(line string) { got = append(got, line) }),
		Ready: func(context.Context) error {
			_, err := os.Stat(flag)
			return err
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	p.Stop()
	select {
	case <-p.Exited():
	default:
		t.Fatal("Stop returned before the child exited")
	}
	if !slices.Equal(got, []string{"one", "two"}) {
		t.Errorf("the log got %q, want one whole line per Write", got)
	}
}

func TestStartProcessReportsAnEarlyExit(t *testing.T) {
	for _, tt := range []struct {
		name, say string
		inUse     bool
	}{
		{"a taken port", "listen tcp 127.0.0.1:1: bind: address already in use", true},
		{"anything else", "config: no such file", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			log, err := os.Create(filepath.Join(t.TempDir(), "child.log"))
			if err != nil {
				t.Fatal(err)
			}
			defer log.Close()
			log.WriteString("an earlier child's line\n")
			attempts := 0
			_, err = WithFreshPorts(func() (*Process, error) {
				attempts++
				return StartProcess(t.Context(), t, ProcessConfig{
					Name: "child", Bin: "sh", Args: []string{"-c", `echo "$0" >&2; exit 1`, tt.say}, Log: log,
					Ready: func(context.Context) error { return errors.New("not yet") },
				})
			})
			if err == nil || !strings.Contains(err.Error(), tt.say) || strings.Contains(err.Error(), "earlier") {
				t.Errorf("error %v, want one showing what this child printed", err)
			}
			if errors.Is(err, ErrAddrInUse) != tt.inUse {
				t.Errorf("errors.Is(%v, ErrAddrInUse) = %v, want %v", err, !tt.inUse, tt.inUse)
			}
			if want := map[bool]int{true: 5, false: 1}[tt.inUse]; attempts != want {
				t.Errorf("%d attempts, want %d", attempts, want)
			}
		})
	}
}

// TestWithFreshPortsDrawsAgainForATakenListener: an in-process listener that
// lost its port (another socket took it between FreePort and Listen) is
// started again on a fresh one.
func TestWithFreshPortsDrawsAgainForATakenListener(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	attempts := 0
	ln, err := WithFreshPorts(func() (net.Listener, error) {
		attempts++
		addr := taken.Addr().String()
		if attempts > 1 {
			addr = "127.0.0.1:0"
		}
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("a server: %w", err)
		}
		return l, nil
	})
	if err != nil {
		t.Fatalf("WithFreshPorts: %v, want a listener on a fresh port", err)
	}
	ln.Close()
	if attempts != 2 {
		t.Errorf("%d attempts, want 2", attempts)
	}
}
