package scheduling

import "time"

// cacheTrust is what a decode engine's own answers said of the estimates
// that sent it requests decode-only (cached_prefix): the engine reports the
// prompt tokens its prefix cache held (usage.prompt_tokens_details), which
// for a decode-only answer is its cache alone. An estimate fails when the
// engine held less than half of what it assumed, as after an eviction or a
// restart; trustMisses failures in a row stop the cache rule for that
// endpoint for distrustFor, after which it is trusted again. P/D answers
// cannot tell: vLLM counts the KV it pulled as cached. Guarded by
// Endpoint.mu.
type cacheTrust struct {
	misses int       // estimates in a row that failed
	until  time.Time // zero: trusted
	// stated: an answer of the endpoint has stated its cached tokens, so
	// one without them says none were cached (many vLLM releases write
	// them only when some were), not that the engine never writes them.
	stated bool
}

const (
	trustMisses = 3
	distrustFor = time.Minute
)

// ReportCached records a decode-only answer of the endpoint: the prompt
// tokens the decision assumed it held, and those it says it held, stated or
// read from the answer's lack of them (held 0). Until one of its answers
// has stated them, their lack tells nothing: an engine run without vLLM's
// --enable-prompt-tokens-details never states them, and would otherwise
// lose the cache rule every minute. It reports whether this answer ended
// the endpoint's trust.
func (e *Endpoint) ReportCached(assumed, held int, stated bool) (distrusted bool) {
	if assumed <= 0 {
		return false
	}
	now := e.cfg().now()
	e.mu.Lock()
	defer e.mu.Unlock()
	t := &e.trust
	if t.stated = t.stated || stated; !t.stated {
		return false
	}
	if 2*held >= assumed {
		t.misses = 0
		return false
	}
	if t.misses++; t.misses >= trustMisses {
		t.misses, t.until = 0, now.Add(distrustFor)
		return true
	}
	return false
}

// CacheTrusted reports whether the cache rule may go by the endpoint's
// estimates: false for distrustFor after its answers belied them.
func (e *Endpoint) CacheTrusted() bool {
	now := e.cfg().now()
	e.mu.Lock()
	defer e.mu.Unlock()
	return !now.Before(e.trust.until)
}
