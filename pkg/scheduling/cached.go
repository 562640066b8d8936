package scheduling

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// lookup reads, from the pool's view of its engines' caches (KV events),
// how many leading tokens of req's prompt each candidate whose view can be
// trusted now (known, by position in eps) holds. idx is nil when the pool
// follows no events, req's tokens are not known or no candidate's view can
// be trusted; the policy then goes as without events.
//
// A candidate whose requests have failed since it last served one (health:
// troubled) is taken as not known: it may be down, its view still showing
// what it held, and a holder that looks idle would draw the requests that
// probe it, each a failure. It is placed as without events until it serves
// again.
func (p *prefixAffinity) lookup(req *Request, eps []*Endpoint) (idx *kvevents.Index, held map[string]int, known []bool) {
	if p.cache == nil || len(req.Tokens()) == 0 {
		return nil, nil, nil
	}
	if idx = p.cache(); idx == nil {
		return nil, nil, nil
	}
	addrs := make([]string, len(eps))
	for i, e := range eps {
		addrs[i] = e.Addr
	}
	held, known = idx.Lookup(addrs, req.Tokens(), req.cache())
	trusted := false
	for i, e := range eps {
		if e.troubled.Load() {
			known[i] = false
			delete(held, e.Addr)
		}
		trusted = trusted || known[i]
	}
	if !trusted {
		return nil, nil, nil
	}
	return idx, held, known
}

// holding is the candidate, of rs in their order, that holds the longest
// start of the prompt within the load bounds b: those for following a
// history when it alone holds that much (a conversation's earlier turns:
// going elsewhere recomputes them), else the ranking's; the first of equals
// (a system prompt cached on several). nil when no candidate within its
// bound holds a block of it.
func (p *prefixAffinity) holding(rs []ranked, held map[string]int, b loadBounds) *Endpoint {
	first, second := leaders(held)
	var best *Endpoint
	bestHeld := 0
	for _, r := range rs {
		n := held[r.e.Addr]
		if n <= bestHeld || !b.within(r) && !(n == first && n > second && b.follows(r)) {
			continue
		}
		best, bestHeld = r.e, n
	}
	return best
}

// leaders are the two largest holdings of different endpoints, 0 for none.
func leaders(held map[string]int) (first, second int) {
	for _, n := range held {
		if n > first {
			first, second = n, first
		} else if n > second {
			second = n
		}
	}
	return first, second
}

// lessBusyFirst sorts rs by busyness, the ranking's order kept among equals.
func lessBusyFirst(rs []ranked) []ranked {
	slices.SortStableFunc(rs, func(a, b ranked) int { return cmp.Compare(a.busy, b.busy) })
	return rs
}

// soonestFirst sorts rs by busyness, the request's own place counted, over
// their engines' prefill pace (scraped.pace) relative to mean (meanPace): the
// sooner it would be served, the first; the ranking's order kept among
// equals. An engine of unknown pace counts as the mean. Of holders equally
// idle, the faster engine; of engines equally fast, the less busy. For a
// request that nothing follows onto its engine (a completions prompt),
// among engines that hold its start alike (by their events, or its
// prefix's home set): a conversation placed so would draw its later turns
// to the fast engines, whose caches, where they are small, then keep fewer
// histories (the policy tables, docs/scheduling.md).
func soonestFirst(rs []ranked, mean float64) []ranked {
	soon := func(r ranked) float64 {
		if pace, ok := r.scrape.pace(); ok && pace > 0 && mean > 0 {
			return (r.busy + 1) * mean / pace
		}
		return r.busy + 1
	}
	slices.SortStableFunc(rs, func(a, b ranked) int { return cmp.Compare(soon(a), soon(b)) })
	return rs
}

// meanPace is the mean prefill pace of the engines of rs that tell one, 0
// when none does.
func meanPace(rs []ranked) float64 {
	var paced, known float64
	for _, r := range rs {
		if pace, ok := r.scrape.pace(); ok && pace > 0 {
			paced, known = paced+pace, known+1
		}
	}
	if known == 0 {
		return 0
	}
	return paced / known
}

// loadBounds are prefix-affinity's load bounds over a set of candidates,
// with the candidates' mean busyness and queue they are set from; start and
// kept: for a request that starts a conversation (starting).
type loadBounds struct {
	busy, queue, follow, meanBusy, meanQueue float64
	start, kept                              bool
}

// bounds are the bounds over rs: busyness at most factor × the mean + slack,
// and a queue at most the mean + queueSlack, or, to follow a history, the
// mean + followQueue × queueSlack.
func (p *prefixAffinity) bounds(rs []ranked, queueSlack float64) loadBounds {
	var busy, queued float64
	for _, r := range rs {
		busy += r.busy
		queued += r.queued
	}
	n := float64(len(rs))
	busy, queued = busy/n, queued/n
	return loadBounds{busy: p.factor*busy + p.slack, queue: queued + queueSlack, follow: queued + followQueue*queueSlack,
		meanBusy: busy, meanQueue: queued}
}

// starting are the bounds for a request that starts a conversation (or a
// one-shot one) to go where its system prompt is cached: no busier than the
// mean, and no longer a queue. Recomputing a system prompt elsewhere costs
// once; piling new conversations onto its few holders evicts their older
// conversations' histories and lengthens their queues. With kept, an engine
// that keeps what it writes for keptLong or more loses no history to them:
// the usual bounds hold there.
func (b loadBounds) starting(kept bool) loadBounds {
	b.start, b.kept = true, kept
	return b
}

// keptLong: an engine that takes at least this long to write its whole
// cache over keeps a conversation's history between turns, as a person
// reads and types or an agent runs its tools. In the policy simulation
// (docs/scheduling.md), from the tenth to the ninetieth percentile of the
// scrapes, small caches were written over in 5 to 60 seconds, large ones in
// 106 to 513.
const keptLong = 90 * time.Second

// keptTurn: a P/D prefill engine that takes at least this long to write its
// cache over still holds a conversation's last prompt when the next turn
// comes, its reply generated on a decode engine in seconds, then read and
// answered. Prefill engines write every prompt they compute, and so write
// their caches over sooner than aggregated engines that hold as much do
// (keptLong would find none keeping): in the P/D simulation
// (docs/scheduling.md; always-P/D, seed 42, the tenth to the ninetieth
// percentile of the scrapes) large caches were written over in 62 to 82 s,
// 41 to 47 at 1.5× load, small ones in 6 to 17 s.
const keptTurn = 30 * time.Second

// keepTurns reports whether the engines of eps keep what they write for
// keptTurn, by their scrapes: every one whose scrapes tell, and one at
// least (an engine that just joined does not tell yet).
func keepTurns(eps []*Endpoint) bool {
	if len(eps) == 0 {
		return false
	}
	now, told := sync.OnceValue(eps[0].cfg().now), false
	for _, e := range eps {
		s, ok := e.scrapedAt(now).rewrite()
		if ok && s < keptTurn.Seconds() {
			return false
		}
		told = told || ok
	}
	return told
}

// keepsFor reports whether, by its scrape, r's engine keeps what it writes
// for d or more (scraped.rewrite).
func keepsFor(r ranked, d time.Duration) bool {
	s, ok := r.scrape.rewrite()
	return ok && s >= d.Seconds()
}

// within: r's busyness and queue within the bounds, the mean's for a request
// that starts a conversation unless kept and r's engine keeps what it
// writes.
func (b loadBounds) within(r ranked) bool {
	if b.start && !(b.kept && keepsFor(r, keptLong)) {
		return r.busy <= b.meanBusy && r.queued <= b.meanQueue
	}
	return r.busy <= b.busy && r.queued <= b.queue
}

// follows: following a request's history spares recomputing it elsewhere,
// which is worth a longer queue. A request that starts a conversation has
// none to follow.
func (b loadBounds) follows(r ranked) bool {
	if b.start {
		return b.within(r)
	}
	return r.busy <= b.busy && r.queued <= b.follow
}

// busyness is the candidates with their busyness, in their order.
func busyness(eps []*Endpoint) []ranked {
	rs := make([]ranked, len(eps))
	if len(eps) == 0 {
		return rs
	}
	// The pool's clock, read once if at all: it costs more than judging a
	// load; the candidates' mean load, only for one without fresh figures.
	now := sync.OnceValue(eps[0].cfg().now)
	mean := sync.OnceValue(func() poolLoad { return meanLoad(eps, now, nil) })
	for i, e := range eps {
		rs[i].e, rs[i].scrape = e, e.scrapedAt(now)
		rs[i].busy, rs[i].queued = e.busynessOf(rs[i].scrape, mean)
	}
	return rs
}
