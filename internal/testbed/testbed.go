// Package testbed starts pd-extproc deployments on loopback: engine
// simulators (pdsim), the extproc binary, the Envoy emulator on one of the
// repo's bootstrap files, and any other child process. The e2e tests, the
// soak, `make run` and the benchmark driver all build their stacks from it.
//
// Everything started is handed to a Cleaner, which stops it when the
// deployment is torn down: a *testing.T in tests, a *Cleanups in programs.
// Functions return errors; the Must helpers (must.go) fail a test instead.
package testbed

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"sync"
	"syscall"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// Cleaner takes a function to run when the deployment is torn down.
// *testing.T, *testing.B and *Cleanups are Cleaners.
type Cleaner interface{ Cleanup(func()) }

// Cleanups is the cleanup list of a plain program: Close runs every function
// added, the last added first. It is safe for concurrent use.
type Cleanups struct {
	mu  sync.Mutex
	fns []func()
}

// Cleanup adds f to the list.
func (c *Cleanups) Cleanup(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.fns = append(c.fns, f)
}

// Close runs the functions added so far, the last added first, and empties
// the list.
func (c *Cleanups) Close() {
	c.mu.Lock()
	fns := c.fns
	c.fns = nil
	c.mu.Unlock()
	for _, f := range slices.Backward(fns) {
		f()
	}
}

// module is the path go.mod declares at the repository root.
const module = "github.com/pd-extproc/pd-extproc"

// repoRoot finds the module root once: the first directory at or above the
// working directory whose go.mod declares module (go test runs a package in
// its own directory, go run where it is called).
var repoRoot = sync.OnceValues(func() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && declares(b, module) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod of %s at or above the working directory", module)
		}
		dir = parent
	}
})

func declares(gomod []byte, path string) bool {
	for line := range bytes.Lines(gomod) {
		if string(bytes.TrimSpace(line)) == "module "+path {
			return true
		}
	}
	return false
}

// RepoRoot is the repository root, where config/ lives.
func RepoRoot() (string, error) { return repoRoot() }

// RepoPath joins a slash-separated repository-relative path onto the root;
// an absolute path is returned as it is.
func RepoPath(rel string) (string, error) {
	if filepath.IsAbs(rel) {
		return rel, nil
	}
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, filepath.FromSlash(rel)), nil
}

// Connectors are extproc's KV connectors, and Protocols the simulators'
// protocol that goes with each.
var (
	Connectors = []string{"kv-nixl", "kv-sglang", "kv-shared-storage", "kv-mooncake"}
	Protocols  = map[string]string{
		"kv-nixl":           pdsim.ProtocolNIXL,
		"kv-sglang":         pdsim.ProtocolSGLang,
		"kv-shared-storage": pdsim.ProtocolSharedStorage,
		"kv-mooncake":       pdsim.ProtocolMooncake,
	}
)

// Modes are the request body modes the repo ships an Envoy bootstrap for,
// and EnvoyConfigs those files (repository-relative): the files users run,
// with no_response, envoy.yaml without the response path.
var (
	Modes        = []string{"full_duplex", "buffered"}
	EnvoyConfigs = map[string]string{
		"full_duplex": "config/envoy/envoy.yaml",
		"buffered":    "config/envoy/envoy-buffered.yaml",
		"no_response": "config/envoy/envoy-no-response.yaml",
	}
)

// FreePort returns a TCP port that is free on loopback now.
func FreePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// FreeAddr returns a loopback address whose port is free now. A child process
// that is given it may lose the port to another socket before it listens:
// start it under WithFreshPorts.
func FreeAddr() (string, error) {
	port, err := FreePort()
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("127.0.0.1:%d", port), nil
}

// ToolDirs are where `make tools` installs test tools: TOOLS_BIN when set,
// and its default, ~/.cache/pd-extproc/bin. Tests look there as well as on
// PATH, so that a plain `go test ./...` finds what the Makefile installed.
func ToolDirs() []string {
	var dirs []string
	if dir := os.Getenv("TOOLS_BIN"); dir != "" {
		dirs = append(dirs, dir)
	}
	if home, err := os.UserHomeDir(); err == nil {
		dirs = append(dirs, filepath.Join(home, ".cache", "pd-extproc", "bin"))
	}
	return dirs
}

// FindTool is the path of the executable name on PATH or in ToolDirs, or ""
// when it is in neither.
func FindTool(name string) string {
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range ToolDirs() {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p
		}
	}
	return ""
}

// FreeAddrNow is FreeAddr for the benchmark programs, which have no test to
// fail: it panics on the error, which only a machine out of ports gives.
func FreeAddrNow() string {
	addr, err := FreeAddr()
	if err != nil {
		panic(err)
	}
	return addr
}

// Main runs one of the repository's programs (a benchmark driver, the scale
// run): run gets a context that ends at SIGTERM or an interrupt, and its
// error exits 1, printed after name.
func Main(name string, run func(context.Context) error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		stop()
		os.Exit(1)
	}
}
