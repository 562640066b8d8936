package pipeline

import (
	"sync"

	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// partner weighs a failure at the decode engine against its prefill
// partner: a prefill engine that handed out KV no other host can reach
// (checkRemoteHost), or a concurrent leg that failed first (kv-sglang: a
// decode engine whose prefill never bootstraps fails too), spares the
// decode endpoint. A concurrent leg that fails after the decode engine did
// spares it only when the leg got no answer (the prefill engine unreachable,
// or past prefill.timeout): a leg that answers 5xx after its decode engine
// failed is that failure's consequence, as when the decode engine fails at
// once and its prefill engine then waits for it in vain. So while a leg
// runs, the decode's failure waits for it.
//
// A kv-mooncake prefill engine answers once it computed the prompt, before
// the decode engine pulls it: as under kv-nixl, whether it served is the
// decode's outcome, which judges the leg whichever of the two ends first.
type partner struct {
	mu      sync.Mutex
	failed  bool              // the prefill partner failed, or will fail the pull
	running bool              // a concurrent leg is under way
	waiting *scheduling.Taken // a decode endpoint whose failure waits for the leg
	served  *scheduling.Slot  // a served leg that waits for the decode's outcome
	outcome int8              // the decode's outcome, once settled: 1 ok, -1 failed
	drop    func()            // cuts the concurrent leg short
	paired  bool              // the leg's connector pairs legs (kv-sglang)
	cut     bool              // decodeOver cut the leg
}

// legServed judges a served leg by its decode's outcome, now or once it
// is settled.
func (p *partner) legServed(s *scheduling.Slot) {
	p.mu.Lock()
	outcome := p.outcome
	if outcome == 0 {
		p.served = s
	}
	p.mu.Unlock()
	if outcome != 0 {
		s.Report(outcome > 0)
	}
}

// decodeSettled notes the decode's outcome, and judges a served leg by it.
func (p *partner) decodeSettled(ok bool) {
	p.mu.Lock()
	s := p.served
	p.served, p.outcome = nil, -1
	if ok {
		p.outcome = 1
	}
	p.mu.Unlock()
	if s != nil {
		s.Report(ok)
	}
}

// fails marks the prefill partner as the failure's cause.
func (p *partner) fails() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failed = true
}

// legStarted notes a concurrent leg under way, which drop cuts short;
// paired: its connector pairs legs.
func (p *partner) legStarted(drop func(), paired bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.running, p.drop, p.paired = true, drop, paired
}

// cutShort cuts the concurrent leg short, if one was started.
func (p *partner) cutShort() {
	p.mu.Lock()
	drop := p.drop
	p.mu.Unlock()
	if drop != nil {
		drop()
	}
}

// decodeOver cuts short the concurrent leg of a decode request that ended
// unserved (refused: with a 4xx), which no decode engine will pair with. A
// Mooncake prefill engine would compute the prompt and keep its blocks for
// a pull that never comes, up to VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT; cut,
// it aborts the request and frees them. A kv-sglang leg is cut only when its
// decode refused the request: after a decode failure, the leg's own outcome
// says whose it was (legEnded), and SGLang's prefill holds no KV for a
// decode that never bootstraps.
func (p *partner) decodeOver(refused bool) {
	p.mu.Lock()
	drop := p.drop
	if p.cut = p.running && (refused || !p.paired); !p.cut {
		drop = nil
	}
	p.mu.Unlock()
	if drop != nil {
		drop()
	}
}

// wasCut reports whether decodeOver cut the leg.
func (p *partner) wasCut() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cut
}

// legEnded notes the concurrent leg's end: failed, and whether unanswered
// (the prefill engine's own fault). It blames a decode failure that waited
// for it unless the leg spares it.
func (p *partner) legEnded(failed, unanswered bool) {
	p.mu.Lock()
	e := p.waiting
	p.running, p.waiting = false, nil
	switch {
	case !failed: // the leg served: the decode's failure is its own
	case e == nil: // failed first: a decode failure after it is the consequence
		p.failed = true
	case unanswered:
		p.failed, e = true, nil
	}
	p.mu.Unlock()
	if e != nil {
		e.Failed()
	}
}

// decodeFailed blames the decode endpoint e for a failure, now, later (a
// concurrent leg under way) or not at all (the partner's fault).
func (p *partner) decodeFailed(e *scheduling.Taken) {
	p.mu.Lock()
	switch {
	case p.failed:
		e = nil
	case p.running:
		p.waiting, e = e, nil
	}
	p.mu.Unlock()
	if e != nil {
		e.Failed()
	}
}
