package pdsim

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// Faults makes the engine misbehave on purpose, to test how a router copes.
type Faults struct {
	FailStatus      int           // answer this status (vLLM's error JSON) to faulty requests
	FailEvery       int           // every FailEvery-th inference request is faulty; <=1: all of them
	Delay           time.Duration // wait this long before handling any inference request
	DropConnections bool          // close the TCP connection of faulty requests without answering
	// DropKVEventsEvery leaves every DropKVEventsEvery-th batch of KV events
	// unsent (0: none): its sequence number still passes, so subscribers
	// see a gap, and the replay socket still has it.
	DropKVEventsEvery int
	// LoseKV has a NIXL prefill engine free the blocks it hands out at once,
	// as one whose lease ran out before the decode engine pulled, or whose
	// side channel the decode engines cannot reach: its answer is a 200
	// with kv_transfer_params, and the pull fails.
	LoseKV bool
	// RenderStatus, when set, is what the render endpoints answer (vLLM's
	// error JSON), as a vLLM whose renderer fails does.
	RenderStatus int
}

func (c Config) faults() Faults {
	return Faults{FailStatus: c.FailStatus, FailEvery: c.FailEvery, Delay: c.Delay, DropConnections: c.DropConnections,
		DropKVEventsEvery: c.DropKVEventsEvery}
}

// SetFaults changes fault injection for requests that arrive from now on;
// FailEvery and DropKVEventsEvery count from the change.
func (s *Server) SetFaults(f Faults) {
	s.faults.mu.Lock()
	s.faults.current, s.faults.counted = f, 0
	s.faults.mu.Unlock()
	if s.kvpub != nil {
		s.kvpub.setDropEvery(f.DropKVEventsEvery)
	}
}

// faultState is the fault injection in force and the requests it has seen.
type faultState struct {
	mu      sync.Mutex
	current Faults
	counted int // inference requests seen, for FailEvery
}

// injectFaults applies the configured delay, then fails or drops the request if
// it is a faulty one. It reports whether the request has been dealt with.
func (s *Server) injectFaults(ctx context.Context, w http.ResponseWriter) bool {
	s.faults.mu.Lock()
	f := s.faults.current
	s.faults.counted++
	faulty := (f.FailStatus != 0 || f.DropConnections) && s.faults.counted%max(f.FailEvery, 1) == 0
	s.faults.mu.Unlock()

	if err := wait(ctx, f.Delay); err != nil {
		return true
	}
	switch {
	case !faulty:
		return false
	case f.DropConnections:
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
			return true
		}
		s.writeError(w, &apiError{http.StatusBadGateway, "pdsim: connection could not be dropped"}) // HTTP/2 cannot hijack
	default:
		s.writeError(w, &apiError{f.FailStatus, "pdsim: injected failure"})
	}
	return true
}

// renderFails is the status the render endpoints answer instead, 0 for none.
func (s *Server) renderFails() int {
	s.faults.mu.Lock()
	defer s.faults.mu.Unlock()
	return s.faults.current.RenderStatus
}

// losesKV reports whether the prefill engine frees the blocks it hands out.
func (s *Server) losesKV() bool {
	s.faults.mu.Lock()
	defer s.faults.mu.Unlock()
	return s.faults.current.LoseKV
}
