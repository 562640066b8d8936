package pipeline

import (
	"net/http"
	"time"
)

// What the external tests (package pipeline_test, which assemble pipelines
// as pkg/server does) read of the package's insides.

const (
	MaxPrefillResponseBytes = maxPrefillResponseBytes
	MaxJoinedLeg            = maxJoinedLeg
)

// CloseIdle closes p's idle connections to the prefill engines.
func CloseIdle(p *Pipeline) { p.client.CloseIdleConnections() }

// SetProbeVerdictWait sets how long a prefill probe waits for its verdict,
// until the returned func restores it.
func SetProbeVerdictWait(d time.Duration) (restore func()) {
	old := probeVerdictWait
	probeVerdictWait = d
	return func() { probeVerdictWait = old }
}

// WrapTransport wraps the transport of p's engine client (prefill legs,
// token ids) in wrap.
func WrapTransport(p *Pipeline, wrap func(http.RoundTripper) http.RoundTripper) {
	p.client.Transport = wrap(p.client.Transport)
}
