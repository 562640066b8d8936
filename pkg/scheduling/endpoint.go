package scheduling

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// Endpoint is one engine server, addressed as ip:port. It carries what pickers
// read: requests in flight through us, health, and the engine's own load.
// An Endpoint survives config reloads for as long as its address stays listed,
// so its counts are never reset under running requests.
type Endpoint struct {
	Addr     string
	ap       netip.AddrPort // Addr parsed (not valid when it is not ip:port)
	addrHash uint64         // xxhash of Addr, for rendezvous weights (0 on a bare Endpoint: computed then)
	inflight atomic.Int64
	load     atomic.Pointer[scraped]
	settings *atomic.Pointer[settings] // the pool's; nil for a bare Endpoint
	// found is what a discovery source said of the endpoint (its own SGLang
	// bootstrap port, its engine's ID); nil: it is static or from DNS.
	found  atomic.Pointer[Discovered]
	info   atomic.Pointer[serverInfo]   // what a kv-sglang prefill engine reports of itself; nil: not asked
	models atomic.Pointer[servedModels] // what the engine lists at GET /v1/models; nil: not asked

	troubled  atomic.Bool   // fast path: false means healthy without taking mu
	ejections atomic.Uint64 // times taken out of rotation: passive ejections and failed active checks
	// moved is when (Unix nanoseconds) the endpoint last changed how
	// conversations rank: it joined the pool after its first build, left it,
	// or was taken out of rotation. 0: never.
	moved  atomic.Int64
	mu     sync.Mutex
	health healthState
	trust  cacheTrust
}

// settings are the pool-wide knobs an endpoint consults, swapped on reload.
type settings struct {
	now         func() time.Time
	failures    int           // consecutive failures that eject
	ejection    time.Duration // first ejection
	maxEjection time.Duration
	staleAfter  time.Duration // scraped load older than this is ignored; 0: never scraped
	// unhealthy and healthy are the active checks' thresholds: unanswered
	// checks in a row that mark an endpoint down, passes that mark it up.
	unhealthy, healthy int
}

var defaultSettings = settings{now: time.Now, failures: 3, ejection: time.Second, maxEjection: 30 * time.Second,
	unhealthy: config.DefaultUnhealthyThreshold, healthy: config.DefaultHealthyThreshold}

func newEndpoint(addr string, s *atomic.Pointer[settings]) *Endpoint {
	ap, _ := netip.ParseAddrPort(addr)
	return &Endpoint{Addr: addr, ap: unmapped(ap), addrHash: xxhash.Sum64String(addr), settings: s}
}

func (e *Endpoint) cfg() *settings {
	if e.settings != nil {
		if s := e.settings.Load(); s != nil {
			return s
		}
	}
	return &defaultSettings
}

// Ejections counts the times the endpoint was taken out of rotation since it
// was added: by consecutive failures, or by an active check that failed while
// it was up.
func (e *Endpoint) Ejections() uint64 { return e.ejections.Load() }

// InFlight returns the number of requests currently holding the endpoint.
func (e *Endpoint) InFlight() int64 { return e.inflight.Load() }

// Claim counts one more request on the endpoint, held until its Slot is
// released. The first request to an endpoint whose ejection has run out is
// its probe: until the probe reports or is released, the endpoint takes no
// other request. The Slot's Leave ends the request's load on the endpoint;
// Judged, called once the outcome is reported (or will not be), frees the
// probe slot: a prefill leg's outcome is known only after it has left the
// endpoint, when the decode engine pulls its KV or fails to.
func (e *Endpoint) Claim() *Slot { return e.claim(false) }

// claim is Claim; with picked, for an endpoint a pick found healthy
// (Pool.Claim), it is nil, and holds nothing, when the endpoint has turned
// half-open since and another request holds its one probe.
func (e *Endpoint) claim(picked bool) *Slot {
	var probe, taken bool
	if e.troubled.Load() {
		probe, taken = e.claimProbe()
	}
	if picked && taken {
		return nil
	}
	e.inflight.Add(1)
	return &Slot{taken: e.Take(), probe: probe}
}

// Slot is one request's hold on an endpoint (Claim). Its methods are safe to
// call more than once, and from any goroutine.
type Slot struct {
	taken        Taken // the endpoint, as the request took it
	probe        bool
	left, judged atomic.Bool
	wait         atomic.Pointer[time.Timer] // JudgedWithin's
}

// Endpoint is the endpoint held.
func (s *Slot) Endpoint() *Endpoint { return s.taken.Endpoint }

// Taken is the endpoint as the request took it, for its health reports.
func (s *Slot) Taken() Taken { return s.taken }

// Leave ends the request's load on the endpoint.
func (s *Slot) Leave() {
	if s.left.CompareAndSwap(false, true) {
		s.taken.inflight.Add(-1)
	}
}

// Judged frees the probe slot, if the request was the endpoint's probe.
func (s *Slot) Judged() {
	if s.probe && s.judged.CompareAndSwap(false, true) {
		if t := s.wait.Load(); t != nil {
			t.Stop()
		}
		s.taken.endProbe()
	}
}

// Release is Leave, then Judged: the request has left and its outcome is
// reported, or will not be.
func (s *Slot) Release() {
	s.Leave()
	s.Judged()
}

// Report reports the request's outcome to the endpoint's health, then frees
// its probe slot.
func (s *Slot) Report(ok bool) {
	if ok {
		s.taken.Served()
	} else {
		s.taken.Failed()
	}
	s.Judged()
}

// JudgedWithin frees the probe slot after d if no verdict has come by then:
// the endpoint then takes requests again, its health still waiting for the
// report.
func (s *Slot) JudgedWithin(d time.Duration) {
	if s.probe {
		s.wait.Store(time.AfterFunc(d, s.Judged))
	}
}

// Load is an engine's own account of its load, scraped from /metrics.
type Load struct {
	Waiting float64   // requests queued in the engine, not yet running (SGLang P/D: its role's transfer queues too)
	Running float64   // requests in the engine's running batch
	KVUsage float64   // KV cache in use, 0..1
	At      time.Time // when it was scraped
	// CacheTokens is the engine's KV cache, in tokens, and Written what it
	// has written into it since it started: the prompt tokens its prefix
	// cache did not hold, and those it generated (vLLM's or SGLang's
	// series, engineCaches). 0 when not reported.
	CacheTokens, Written float64
	// Computed is the prompt tokens the engine computed (its prefix cache
	// did not hold them) and Prefilling the seconds those requests spent in
	// prefill, from their first step to their first token, both counted as
	// each request finishes since the engine started (vLLM's
	// request_prefill_kv_computed_tokens and request_prefill_time_seconds
	// histograms' sums). 0 when not reported.
	Computed, Prefilling float64
}

// cacheWindow is the oldest stamp whose blocks the engine still holds, by
// its last scrape within stale_after: it keeps the CacheTokens it wrote
// last, at most, and nothing from before a restart. A failed scrape's
// figures count: Written only grows, so they tell what the engine had
// written at least. ok is false when the scrape does not tell (the engine
// does not report its cache, or has not answered yet, or the pool is not
// scraped); stale, when the pool is scraped and the engine answered, but not
// within stale_after, or never did, within stale_after of its first failed
// scrape.
func (e *Endpoint) cacheWindow() (since stamp, ok, stale bool) {
	s := e.cfg()
	l := e.scrapedAt(s.now)
	if l == nil {
		return stamp{}, false, s.staleAfter > 0 && e.load.Load() != nil
	}
	return stamp{l.Written - l.CacheTokens, l.restarts}, l.CacheTokens > 0, false
}

// stamp is the engine's by its last scrape, stale or not: what it had
// written by then, at least, in the run it is in, a restart aside. The
// zero stamp when it has not answered yet.
func (e *Endpoint) stamp() stamp {
	if l := e.load.Load(); l != nil {
		return stamp{l.Written, l.restarts}
	}
	return stamp{}
}

// scrapedAt is the last scrape, nil when there is none or it is stale by the
// clock now.
func (e *Endpoint) scrapedAt(now func() time.Time) *scraped {
	l := e.load.Load()
	if l == nil {
		return nil
	}
	if s := e.cfg(); s.staleAfter <= 0 || now().Sub(l.At) > s.staleAfter {
		return nil
	}
	return l
}

// scraped is the last scraped load, with two past ones (marks), markEvery
// apart or more, to read the pace of the engine's counters from (rewrite).
type scraped struct {
	Load
	marks    [2]Load
	run      uint64                // scrapes failed since the last answer: its figures are not fresh (Fresh)
	failures [scrapeReasons]uint64 // failed scrapes since the endpoint was added, by reason
	restarts uint32                // the engine's restarts seen since its first scrape (restarted)
	none     bool                  // no scrape has answered: At is when the first failed, the rest zero
}

// Fresh is the last scrape's figures, false when there is none, it is
// stale, or a scrape failed since: a pool's
// saturation (Pool.Saturated, Hold), the P/D load arm and the engine load
// gauges read the figures of its engines' latest scrapes alone, so that an
// engine whose scrapes fail neither holds back a round nor shows the room or
// the queue its old figures had.
func (e *Endpoint) Fresh() (Load, bool) {
	if l := e.scrapedAt(e.cfg().now); l.answered() {
		return l.Load, true
	}
	return Load{}, false
}

// answered says whether s, a scrape that is not stale (scrapedAt), is the
// engine's last answer: no scrape failed since.
func (s *scraped) answered() bool { return s != nil && s.run == 0 }

// scrapeFailed notes a scrape failed for reason: the last figures stay, to
// go stale, but are not fresh; with none, the first failure's time, to go
// stale alike. first: no scrape failed since the last answer, if any.
func (e *Endpoint) scrapeFailed(reason scrapeFailure) (first bool) {
	last := e.load.Load()
	s := scraped{Load: Load{At: e.cfg().now()}, none: true}
	if last != nil {
		s = *last
	}
	s.run++
	s.failures[reason]++
	e.load.CompareAndSwap(last, &s) // a scrape that answered meanwhile stands
	return s.run == 1
}

// ScrapeFailures are the endpoint's failed scrapes by reason
// (ScrapeFailureReasons), reasons without any left out.
func (e *Endpoint) ScrapeFailures() map[string]uint64 {
	out := map[string]uint64{}
	if l := e.load.Load(); l != nil {
		for r, n := range l.failures {
			if n > 0 {
				out[ScrapeFailureReasons[r]] = n
			}
		}
	}
	return out
}

// observe notes a scrape that answered l; failed is how many had failed
// since the answer before.
func (e *Endpoint) observe(l Load) (failed uint64) {
	s := &scraped{Load: l, marks: [2]Load{l, l}}
	last := e.load.Load()
	if last != nil {
		s.failures, failed = last.failures, last.run
	}
	if last != nil && !last.none { // else the first
		s.restarts = last.restarts
		switch {
		case restarted(last.Load, l): // the marks start again
			s.restarts++
		case l.Written >= last.marks[1].Written && l.At.Sub(last.marks[1].At) >= markEvery:
			s.marks = [2]Load{last.marks[1], l}
		default: // they stay, vLLM's Written back for a while too
			s.marks = last.marks
		}
	}
	e.load.Store(s)
	return failed
}

// restarted says whether the engine restarted between the scrapes last and
// l: a counter that only grows went back. vLLM counts its prefix cache's
// hits as it schedules a request and the prompt's tokens at its first token
// (vllm/v1/core/kv_cache_manager.py, vllm/v1/metrics/stats.py), so its
// Written may go back for a while; its prefill sums (Computed, Prefilling),
// added as requests finish, do not. SGLang, which reports none, adds all of
// Written's counters as a request finishes (python/sglang/srt/metrics/collector.py).
func restarted(last, l Load) bool {
	if last.Computed > 0 || last.Prefilling > 0 {
		return l.Computed < last.Computed || l.Prefilling < last.Prefilling
	}
	return l.Written < last.Written
}

// pace is how many prompt tokens a second the engine computed while it
// prefilled, since s's older mark (Load.Computed ÷ Load.Prefilling); false
// when s is nil, its scrapes do not tell (as rewrite) or it finished no
// prefill since.
func (s *scraped) pace() (tokensPerSecond float64, ok bool) {
	if s == nil || s.At.Sub(s.marks[0].At) < markEvery {
		return 0, false
	}
	secs := s.Prefilling - s.marks[0].Prefilling
	if secs <= 0 || s.Computed < s.marks[0].Computed {
		return 0, false
	}
	return (s.Computed - s.marks[0].Computed) / secs, true
}

// markEvery spaces the scrapes rewrite measures from, so that it reads the
// last 15 to 30 seconds: a scrape apart would be the pace of a few requests.
const markEvery = 15 * time.Second

// rewrite is how many seconds the engine takes to write its whole cache over
// (Load.CacheTokens) at the pace it wrote (Load.Written) since s's older mark;
// false when s is nil (no fresh scrape) or its scrapes do not tell (they span
// less than markEvery since the first, or since a restart, or vLLM's Written
// is back below the older mark). An engine that wrote nothing keeps what it
// holds (+Inf).
func (s *scraped) rewrite() (seconds float64, ok bool) {
	if s == nil || s.CacheTokens <= 0 || s.At.Sub(s.marks[0].At) < markEvery || s.Written < s.marks[0].Written {
		return 0, false
	}
	return s.CacheTokens / (s.Written - s.marks[0].Written) * s.At.Sub(s.marks[0].At).Seconds(), true // x/0 is +Inf
}

// busynessOf is what load-aware pickers compare, lower is better, with s the
// endpoint's last scrape (scrapedAt) and mean the candidates' (meanLoad): our
// requests in flight, plus the engine's queue and KV use by s if it
// answered, else by the mean of those that did; and the engine's queue so
// counted. The queue counts on top of in-flight on purpose: waiting
// requests are the sign of a saturated engine, and they include other
// routers' traffic. An engine whose scrapes fail (its /metrics often stops
// answering as it is overloaded), or have not come yet, neither reads idle,
// drawing the requests, nor is left out: it keeps a fair share.
func (e *Endpoint) busynessOf(s *scraped, mean func() poolLoad) (busy, queued float64) {
	busy = float64(e.InFlight())
	if s.answered() {
		return busy + s.Waiting + s.KVUsage, s.Waiting
	}
	if e.cfg().staleAfter <= 0 { // the pool is not scraped: no figures to stand in for
		return busy, 0
	}
	m := mean()
	return busy + m.busy, m.queued
}

// poolLoad is the mean of engines' figures (the candidates', a pool's) that busynessOf
// counts (queue and KV use; queue), over those whose last scrape answered
// and is fresh; 0 when none did.
type poolLoad struct{ busy, queued float64 }

// meanLoad is the poolLoad of eps by the clock now; with keep, of those of
// eps it keeps.
func meanLoad(eps []*Endpoint, now func() time.Time, keep func(*Endpoint) bool) (m poolLoad) {
	var n float64
	for _, e := range eps {
		if s := e.scrapedAt(now); s.answered() && (keep == nil || keep(e)) {
			m.busy, m.queued, n = m.busy+s.Waiting+s.KVUsage, m.queued+s.Waiting, n+1
		}
	}
	if n == 0 {
		return poolLoad{}
	}
	return poolLoad{busy: m.busy / n, queued: m.queued / n}
}
