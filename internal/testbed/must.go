package testbed

import (
	"context"

	"google.golang.org/grpc/credentials"

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

// failOn takes a function's two results and returns the value, failing t if
// there is an error: failOn(StartSim(t, cfg))(t).
func failOn[T any](v T, err error) func(t TB) T {
	return func(t TB) T {
		t.Helper()
		if err != nil {
			t.Fatalf("%v", err)
		}
		return v
	}
}

func MustRepoRoot(t TB) string {
	t.Helper()
	return failOn(RepoRoot())(t)
}

func MustRepoPath(t TB, rel string) string {
	t.Helper()
	return failOn(RepoPath(rel))(t)
}

func MustFreePort(t TB) int {
	t.Helper()
	return failOn(FreePort())(t)
}

func MustFreeAddr(t TB) string {
	t.Helper()
	return failOn(FreeAddr())(t)
}

func MustStartSim(t TB, cfg SimConfig) *pdsim.Server {
	t.Helper()
	return failOn(StartSim(t, cfg))(t)
}

func MustStartExtproc(t TB, cfg ExtprocConfig) *Extproc {
	t.Helper()
	return failOn(StartExtproc(t.Context(), t, cfg))(t)
}

func MustStartEnvoy(t TB, file, extprocAddr string, tweak func(*envoyemu.Config)) *envoyemu.Proxy {
	t.Helper()
	return failOn(StartEnvoy(t, file, extprocAddr, tweak))(t)
}

func MustStartEnvoyOn(t TB, file string, extprocAddrs []string, tweak func(*envoyemu.Config)) *envoyemu.Proxy {
	t.Helper()
	return failOn(StartEnvoyOn(t, file, extprocAddrs, tweak))(t)
}

func MustNewMTLS(t TB, cfg MTLSConfig) *MTLS {
	t.Helper()
	return failOn(NewMTLS(t, cfg))(t)
}

func MustCredentials(t TB, m *MTLS) credentials.TransportCredentials {
	t.Helper()
	return failOn(m.Credentials())(t)
}
