package scheduling

import (
	"context"
	"io"
	"net/http"
	"time"
)

// healthState is an endpoint's health, guarded by Endpoint.mu.
//
// Passive: consecutive failures reported by the pipeline eject the endpoint
// for a backoff (1s, 2s, 4s … capped). When the backoff runs out the endpoint
// is half-open: it takes one probe request; success restores it, failure ejects
// it again for twice as long. Reports of requests that were already running
// when an ejection began are ignored, whenever they come (Taken).
//
// Active (optional), as Envoy's HTTP checker: checks that time out or
// cannot connect mark the endpoint down after unhealthy_threshold of them in
// a row, an answer that is not 2xx (an engine that says it is not well, as
// vLLM's /health does with 503 once its engine is dead) and an endpoint's
// first check at once, unless it was vouched for (it served before checks
// were on: one slow answer does not take it out); healthy_threshold checks
// in a row that pass mark it up again. The two signals are independent: an
// endpoint must pass both.
type healthState struct {
	failures   int       // consecutive
	ejections  int       // consecutive, sizes the next backoff
	until      time.Time // zero: not ejected
	probing    bool      // a probe request is in flight
	activeDown bool
	checkRun   int // checks in a row with the last one's verdict; 0: none since checks were on
	lastPassed bool
	// vouched: in the pool while checks were off, so taken healthy and
	// counted ready on passive health alone; it stays counted until its
	// first check (AwaitsCheck), and is established for it (recordCheck).
	vouched bool
	// offs counts the times checks were found off (unchecked): a check
	// begun before the last is of checks since turned off, its verdict void.
	offs uint64
}

// ReportFailure records a connection error, timeout or 5xx from the endpoint.
func (e *Endpoint) ReportFailure() { e.reportFailure(anyEpoch) }

// ReportSuccess records a request the endpoint served (an engine 4xx counts:
// the endpoint is alive, the request was at fault).
func (e *Endpoint) ReportSuccess() { e.reportSuccess(anyEpoch) }

// Taken is an endpoint as a request took it. Its reports of that request
// count only while no ejection has begun since: a request that was already
// running when the endpoint was ejected says nothing of it after, however
// late its verdict comes (a decode stream that ends minutes later), and
// only the probe of a half-open endpoint decides it.
type Taken struct {
	*Endpoint
	epoch uint64 // the endpoint's ejections when it was taken
}

// Take is e as a request takes it now.
func (e *Endpoint) Take() Taken { return Taken{e, e.ejections.Load()} }

// Failed reports the request's failure; Served, that the endpoint served it.
func (t Taken) Failed() { t.reportFailure(t.epoch) }
func (t Taken) Served() { t.reportSuccess(t.epoch) }

// anyEpoch: a report of no particular request, which always counts.
const anyEpoch = ^uint64(0)

// stale says whether a report of a request taken at epoch comes from before
// the endpoint's latest ejection; e.mu is held.
func (e *Endpoint) stale(epoch uint64) bool {
	return epoch != anyEpoch && epoch != e.ejections.Load()
}

func (e *Endpoint) reportFailure(epoch uint64) {
	s := e.cfg()
	now := s.now()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stale(epoch) {
		return
	}
	h := &e.health
	h.failures++
	e.troubled.Store(true)
	if h.failures < s.failures || (!h.until.IsZero() && now.Before(h.until)) {
		return
	}
	// The base doubled at each ejection in a row, up to the most: compared
	// before the shift, which past a base of hours would overflow.
	backoff := s.maxEjection
	if n := min(h.ejections, 20); s.ejection > 0 && s.ejection <= s.maxEjection>>n {
		backoff = s.ejection << n
	}
	h.until = now.Add(backoff)
	h.ejections++
	h.probing = false
	e.ejections.Add(1)
	e.moved.Store(now.UnixNano())
}

// reportSuccess: while an ejection runs, a success is news from before it
// and is ignored; after it, it ends the ejection.
func (e *Endpoint) reportSuccess(epoch uint64) {
	if !e.troubled.Load() {
		return
	}
	now := e.cfg().now()
	e.mu.Lock()
	defer e.mu.Unlock()
	h := &e.health
	if now.Before(h.until) || e.stale(epoch) {
		return
	}
	h.failures, h.ejections, h.until, h.probing = 0, 0, time.Time{}, false // the active checks' record stands
	e.troubled.Store(h.activeDown)
}

// departing says whether an endpoint that leaves its pool still matters,
// should it come back: requests are in flight on it, its ejection runs, or
// its checks judged it and it left lately (moved). A new Endpoint would be
// taken healthy until its first check, and readiness would await that
// check: a DNS name answering varied subsets would make every endpoint
// await in turn. Envoy keeps a host its checks pass when discovery drops it,
// and its health when it returns (updateDynamicHostList,
// source/common/upstream/upstream_impl.cc @ 000be490); here the verdict
// stands for rerankWindow, no longer, so that departed endpoints stay few.
func (e *Endpoint) departing(now time.Time) bool {
	if e.inflight.Load() > 0 {
		return true
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return now.Before(e.health.until) || e.health.checkRun > 0 && recentlyMoved(e, now)
}

// Healthy reports whether the endpoint may take a request now.
func (e *Endpoint) Healthy() bool { return e.inRotation(true) }

// InRotation reports whether the endpoint is in its pool's rotation: no
// ejection runs and the active checks do not find it down. A half-open
// endpoint is, its probe under way or not: as Envoy's outlier detection
// unejects a host once its ejection time ends, its ejection is over, and it
// takes requests one at a time until the probe tells (Healthy is false
// meanwhile).
func (e *Endpoint) InRotation() bool { return e.inRotation(false) }

// inRotation is InRotation, and with probeFree false while a half-open
// endpoint's probe is under way.
func (e *Endpoint) inRotation(probeFree bool) bool {
	if !e.troubled.Load() {
		return true
	}
	now := e.cfg().now()
	e.mu.Lock()
	defer e.mu.Unlock()
	h := &e.health
	switch {
	case h.activeDown:
		return false
	case h.until.IsZero():
		return true
	case now.Before(h.until):
		return false
	}
	return !probeFree || !h.probing
}

// CheckedDown reports whether the active checks find the endpoint down.
func (e *Endpoint) CheckedDown() bool {
	if !e.troubled.Load() {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.health.activeDown
}

// claimProbe makes the caller the probe of a half-open endpoint (probe);
// taken says the endpoint is half-open and another request is its probe.
func (e *Endpoint) claimProbe() (probe, taken bool) {
	now := e.cfg().now()
	e.mu.Lock()
	defer e.mu.Unlock()
	h := &e.health
	switch {
	case h.until.IsZero() || now.Before(h.until):
		return false, false
	case h.probing:
		return false, true
	}
	h.probing = true
	return true, false
}

// endProbe frees the probe slot of a request that ended without a report, so
// that a lost report cannot keep the endpoint out for good.
func (e *Endpoint) endProbe() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.health.probing = false
}

// verdict is what one active check found.
type verdict int

const (
	passed     verdict = iota // 2xx
	unanswered                // a timeout, a connection refused or broken
	refused                   // an answer that is not 2xx
)

// checksOff is the count of times checks were found off, as a check begins.
func (e *Endpoint) checksOff() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.health.offs
}

// recordCheck records a check's verdict, against the pool's thresholds: of
// a check begun when checks had been found off offs times (checksOff;
// anyEpoch: whenever), one begun before checks were turned off is dropped,
// however late it comes.
func (e *Endpoint) recordCheck(v verdict, offs uint64) {
	s := e.cfg()
	e.mu.Lock()
	defer e.mu.Unlock()
	h := &e.health
	if offs != anyEpoch && offs != h.offs {
		return
	}
	first := h.checkRun == 0
	if !first && (v == passed) == h.lastPassed {
		h.checkRun++
	} else {
		h.checkRun, h.lastPassed = 1, v == passed
	}
	switch {
	case v == passed:
		h.activeDown = h.activeDown && h.checkRun < s.healthy
	case !h.activeDown && (v == refused || first && !h.vouched || h.checkRun >= s.unhealthy):
		h.activeDown = true
		e.ejections.Add(1)
		e.moved.Store(s.now().UnixNano())
	}
	e.troubled.Store(h.activeDown || h.failures > 0)
}

// AwaitsCheck says the pool's active checks are on and none has given e a
// verdict yet: e is taken healthy meanwhile (at start, as it joins), which
// readiness does not count on. An endpoint vouched for while checks were off
// does not await: it was counted ready then, and checks turned on by a
// reload must not take every replica out until their first round ends.
func (p *Pool) AwaitsCheck(e *Endpoint) bool {
	if p.state.Load().spec.Health.CheckInterval <= 0 {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.health.checkRun == 0 && !e.health.vouched
}

// unchecked clears the active checks' verdicts: checks are off.
func (e *Endpoint) unchecked() {
	e.mu.Lock()
	defer e.mu.Unlock()
	h := &e.health
	h.activeDown, h.checkRun, h.lastPassed, h.vouched = false, 0, false, true
	h.offs++
	e.troubled.Store(h.failures > 0)
}

// checkAll runs one active health check on every endpoint, concurrently
// (probeEach).
// current says whether the pool is still as it was when the round began: a
// verdict that comes after checks were turned off (or the pool changed, and
// a new round began) is dropped, or it would stand with no check to clear it;
// so is one that checks are turned off under as it is recorded.
func checkAll(ctx context.Context, pr probe, eps []*Endpoint, path string, timeout time.Duration, current func(*Endpoint) bool) {
	probeEach(eps, func(e *Endpoint) {
		offs := e.checksOff()
		if v, ok := check(ctx, pr.client, pr.url(e.Addr, path), timeout); ok && current(e) {
			e.recordCheck(v, offs)
		}
	})
}

// check GETs url; ok is false when there is no verdict because we are
// shutting down.
func check(parent context.Context, client *http.Client, url string, timeout time.Duration) (v verdict, ok bool) {
	ctx, cancel := context.WithTimeout(parent, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return refused, true
	}
	resp, err := client.Do(req)
	if err != nil {
		return unanswered, parent.Err() == nil
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // so the connection is reused
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return refused, true
	}
	return passed, true
}
