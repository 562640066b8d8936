package testbed

import (
	"context"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// TB is what the Must helpers need of a test; testing.TB has it. Each helper
// is its namesake without Must, failing the test on an error.
type TB interface {
	Cleaner
	Helper()
	Fatalf(format string, args ...any)
	Context() context.Context
}

func MustRepoRoot(t TB) string {
	t.Helper()
	root, err := RepoRoot()
	if err != nil {
		t.Fatalf("%v", err)
	}
	return root
}

func MustRepoPath(t TB, rel string) string {
	t.Helper()
	path, err := RepoPath(rel)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return path
}

func MustFreePort(t TB) int {
	t.Helper()
	port, err := FreePort()
	if err != nil {
		t.Fatalf("%v", err)
	}
	return port
}

func MustStartSim(t TB, cfg SimConfig) *pdsim.Server {
	t.Helper()
	s, err := StartSim(t, cfg)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return s
}

func MustStartExtproc(t TB, cfg ExtprocConfig) *Extproc {
	t.Helper()
	x, err := StartExtproc(t.Context(), t, cfg)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return x
}

func MustStartEnvoy(t TB, file, extprocAddr string, tweak func(*envoyemu.Config)) *envoyemu.Proxy {
	t.Helper()
	p, err := StartEnvoy(t, file, extprocAddr, tweak)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return p
}
