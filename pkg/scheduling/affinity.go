package scheduling

import (
	"slices"

	"github.com/cespare/xxhash/v2"

	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// prefixAffinity ranks the candidates (rank) and takes the first within the
// load bounds (consistent hashing with bounded loads): its busyness at most
// factor × the mean busyness + slack, and its engine's scraped queue at most
// the mean queue + queueSlack, since a queue is what delays a first token.
// A hot prefix spills over to the next endpoints in its own order.
//
// Its choice depends on the request, the candidates and their busyness,
// which is the engines' scraped queue and KV use (alike on every replica)
// plus this replica's own requests in flight, and on the prefix's share of
// the requests, which every replica behind a round robin sees alike. So
// replicas agree, without talking, but near a bound.
//
// Two exceptions keep it from costing load where nothing is shared:
//   - a request with no key goes by least load (fallback);
//   - so does a request without messages (a completions prompt, token ids)
//     whose prefix this replica never routed: such a prompt is most often
//     unrelated to any other, and hashing it would ignore load for nothing.
//
// The index is a local hint on top, which a request follows within the
// busyness bound and a queue of up to the mean + 3 × queueSlack: moving
// would recompute its history elsewhere.
//   - A request follows the endpoint that this replica
//     remembers serving more of the prompt than the conversation key covers
//     (an earlier turn, spilled there), rather than going back to a cold
//     cache (the higher-ranked of equals).
//   - While this replica sees its conversations whole (coverage: it routed
//     the previous request of nearly every later turn it was asked for, as
//     when it is the only replica), it is trusted further. A later turn
//     follows the endpoint that served its previous request, and a
//     conversation's first request goes where the most of its prompt (its
//     system prompt) is remembered and, but on the cache rule's pool, by
//     the engine's scraped counters not yet written over (holds), the less
//     busy of equals. Behind N replicas taking turns, the next turn would
//     come to a replica that knows only the ranking, so there every turn
//     takes it.
type prefixAffinity struct {
	keys  rendezvousKeys
	index *prefixIndex
	// named counts whether this replica sees whole the conversations of
	// requests that name their session (Request.Session), and clients those
	// of the others, per client address (Request.Client).
	named                     *coverage
	clients                   *clientCoverages
	shares                    *poolShares
	factor, slack, queueSlack float64
	// estimateQueueSlack is queueSlack for a request placed without a view
	// of the engines' caches it may trust (config.PrefixAffinity).
	estimateQueueSlack float64
	// turnQueueSlack, when not 0, ranks a conversation's later turns over
	// the whole pool (home) and, without a trusted view, is the queue slack
	// of those that follow their history (follows), whose bound is the
	// mean + 3 × it (byRanking; PoolSpec.turnQueueSlack).
	turnQueueSlack float64
	spread         float64
	fallback       Picker // for requests with no key, or unrelated prompts
	// cache is the pool's view of its engines' caches from their KV events,
	// nil when it follows none (events.go).
	cache func() *kvevents.Index
	// prefill: the pool is a P/D prefill pool. Elsewhere an engine that
	// keeps what it writes for keptLong loosens the bounds of a request
	// that starts a conversation with the view (loadBounds.starting) and of
	// a later turn at its home without one (follows). Not here: under the
	// cache rule this pool is sent only what the decode engines lacked, and
	// in the P/D simulation it cost one-shot questions on small caches, and
	// multi-turn chat under the load arm (docs/scheduling.md). Its later
	// turns follow their history by keptTurn instead.
	prefill bool
}

// remembering is p with old's memory (the local hint, the shares, the
// coverage counts) when old is a prefixAffinity whose memory p's settings
// would shape alike: a change of the load bounds alone (pd.mode derives the
// decode pool's queue_slack) keeps what the pool has learnt.
func (p *prefixAffinity) remembering(old Picker) Picker {
	o, ok := old.(*prefixAffinity)
	if !ok || o.keys != p.keys || o.index.capacity != p.index.capacity {
		return p
	}
	p.index, p.shares, p.named, p.clients = o.index, o.shares, o.named, o.clients
	return p
}

// Pick goes by what the engines hold when the pool follows their KV events
// and the request's tokens are known (cached.go), else by the ranking and
// the local hint.
func (p *prefixAffinity) Pick(req *Request, eps []*Endpoint) *Endpoint {
	idx, held, known := p.lookup(req, eps)
	chosen := p.byRanking(req, eps, held)
	if idx != nil && known[slices.Index(eps, chosen)] { // else byRanking's estimate stands
		req.held = estimate{addr: chosen.Addr, tokens: held[chosen.Addr], exact: true}
		idx.Expect(chosen.Addr, held[chosen.Addr], len(req.Tokens()))
	}
	return chosen
}

// byRanking picks by the ranking, within the load bounds: with the engines'
// view (held, nil without), the candidate holding the longest start of the
// prompt, of equals the first in the ranking (a later turn one of them holds
// more of) or the less busy (any other later turn, and a first request
// within loadBounds.starting); else, or when none within its bound holds a
// block, the first in the ranking within the bounds, and the local hint.
func (p *prefixAffinity) byRanking(req *Request, eps []*Endpoint, held map[string]int) *Endpoint {
	prefix, conversation := p.keys.keys(req)
	if held != nil && (prefix == "" || req.Head() == "") {
		// No ranking that requests share (a completions prompt): of those
		// holding the most, the one that would serve it soonest.
		rs := busyness(eps)
		soonestFirst(rs, meanPace(rs))
		if e := p.holding(rs, held, p.bounds(rs, p.queueSlack)); e != nil {
			return e
		}
	}
	prompt, previous, ns := req.Prompt(), req.Previous(), req.namespace()
	var hs []uint64 // the local hint's: hashed only when it is read
	var served map[string]int
	if prefix == "" || req.Head() == "" {
		hs = p.index.hashes(ns, prompt)
		served = p.index.matched(hs)
		if !routed(served, len(prefix)/p.keys.blockChars) || prefix == "" {
			e := p.fallback.Pick(req, eps)
			p.estimate(req, e, hs, served, false)
			p.record(prompt, hs, e)
			return e
		}
	}
	h := xxhash.Sum64String(prefix) ^ ns
	conv, share := conversationHash(req, conversation, ns), p.shares.of(req).note(h)
	rs := p.ranking(req, h, conv, share, eps)
	queueSlack := p.queueSlack
	followed := previous != "" && held == nil && p.follows(rs[0])
	switch {
	case followed && p.turnQueueSlack > 0:
		queueSlack = p.turnQueueSlack
	case held == nil:
		queueSlack = p.estimateQueueSlack
	}
	b := p.bounds(rs, queueSlack)
	if followed {
		b.queue = b.follow
	}
	if held != nil {
		if e := p.byView(rs, b, held, previous != ""); e != nil {
			return e // the local hint is not told: the view knows better while it can be trusted
		}
	}
	chosen := rs[0] // unless one is within the bounds, and the least busy nearly always is
	for _, r := range rs {
		if b.within(r) {
			chosen = r
			break
		}
	}

	if hs == nil {
		hs = p.index.hashes(ns, prompt)
		served = p.index.matched(hs)
	}
	chosen = p.hinted(req, rs, chosen, served, hs, len(conversation)/p.keys.blockChars, b.follows)
	first := chosen.e == rs[0].e && p.keys.keyedAlike(req) && p.rankedAlike(req, chosen.e, h, conv, share, eps, served)
	p.estimate(req, chosen.e, hs, served, first)
	p.record(prompt, hs, chosen.e)
	return chosen.e
}

// follows says whether a later turn placed without a view stays with its
// history at its home (where its conversation ranks first) within the bound
// of a followed history, as the other replicas would not follow it
// elsewhere: on the cache rule's pool always; on a P/D prefill pool while
// the home's engine keeps what it writes for keptTurn; elsewhere for
// keptLong, so that the history is surely there and a spill recomputes it.
func (p *prefixAffinity) follows(home ranked) bool {
	switch {
	case p.cacheRule():
		return true
	case p.prefill:
		return p.turnQueueSlack > 0 && keepsFor(home, keptTurn)
	}
	return keepsFor(home, keptLong)
}

// ranking ranks eps for req, whose prefix and conversation hash to h and
// conv: a completions prompt, which no later turn follows, with its home
// set (where its start is cached) the soonest to serve it first. Every
// replica ranks the same set.
func (p *prefixAffinity) ranking(req *Request, h, conv uint64, share float64, eps []*Endpoint) []ranked {
	home := p.home(req, share, eps)
	rs := rank(h, conv, home, eps)
	if req.Head() == "" {
		soonestFirst(rs[:home], meanPace(rs))
	}
	return rs
}

// byView is, by the engines' view (held), the candidate of rs, in the
// ranking's order, holding the longest start of the prompt within the
// bounds b; nil when none within its bound holds a block of it.
func (p *prefixAffinity) byView(rs []ranked, b loadBounds, held map[string]int, later bool) *Endpoint {
	order, hb := rs, b
	switch first, second := leaders(held); {
	case !later:
		// A conversation's first request (or a one-shot one): the less
		// busy of equals, as later turns find it wherever it went, and
		// none busier than the mean.
		order, hb = lessBusyFirst(slices.Clone(rs)), b.starting(!p.prefill)
	case first == second && first > 0:
		// A later turn whose history no engine holds beyond what another
		// holds too (evicted, past a system prompt cached on several):
		// placed anew, the less busy of equals. By the ranking, slow
		// engines drew as many such turns as fast ones, and kept them.
		order = lessBusyFirst(slices.Clone(rs))
	}
	return p.holding(order, held, hb)
}

// hinted is chosen, or the candidate of rs within the bounds for following
// a history (follow) where the local hint (served: how many of the
// request's blocks, hashed hs, this replica remembers sending each endpoint)
// places more of the request: while conversations are whole, for a
// conversation's first request the most of it (its system prompt), the less
// busy of equals, and, but on the cache rule's pool, still cached (holds);
// for another, more than the conversation key (keyBlocks), or, while
// conversations are whole, the previous request.
func (p *prefixAffinity) hinted(req *Request, rs []ranked, chosen ranked, served map[string]int, hs []uint64, keyBlocks int, follow func(ranked) bool) ranked {
	// A later turn tells whether this replica routed the request before it.
	previous := req.Previous()
	prevBlocks := len(previous) / p.keys.blockChars
	cov := p.named
	if !req.Session {
		cov = p.clients.of(req.Client)
	}
	whole := cov.note(prevBlocks > 0, p.index.ended(previous, hs))
	if whole && req.Head() != "" && previous == "" {
		held := func(e *Endpoint) int {
			if p.cacheRule() {
				return served[e.engine()] // aged, it cost this pool in the P/D simulation (docs/scheduling.md)
			}
			return p.holds(e, hs, served[e.engine()])
		}
		first, best := chosen.e, held(chosen.e)
		for _, r := range rs {
			if r.e == first {
				continue // as good as itself
			}
			if n := held(r.e); follow(r) && n > 0 && (n > best || n == best && r.busy < chosen.busy) {
				chosen, best = r, n
			}
		}
		return chosen
	}
	best := 0
	for _, r := range rs {
		n := served[r.e.engine()]
		follows := n > keyBlocks || whole && prevBlocks > 0 && n >= prevBlocks
		if follows && n > best && follow(r) {
			chosen, best = r, n
		}
	}
	return chosen
}

// home is how many of a request's first-ranked endpoints, of n, are its
// prefix's home set (homeSize), which its conversation key reorders. With
// turnQueueSlack, a later turn's are the whole pool, unless the prefix's home
// set is one endpoint by a margin (twice its share would still be one): the
// share, which sizes the home set, is each replica's own estimate, and where
// replicas size it apart they rank a conversation's turns on different
// endpoints. Over the whole pool the order is the conversation's alone. A
// conversation's second turn so moves once from where its first went
// (ranked as one-shot questions are, in the home set) when the whole pool's
// first is another endpoint. On a P/D prefill pool only while its engines
// keep what they write (keepTurns): where they write their caches over
// sooner, no history stays to be found, and the home set still holds the
// system prompt.
func (p *prefixAffinity) home(req *Request, share float64, eps []*Endpoint) int {
	n := len(eps)
	if p.turnQueueSlack > 0 && req.Previous() != "" && homeSize(2*share, n, p.spread) > 1 && (!p.prefill || keepTurns(eps)) {
		return n
	}
	return homeSize(share, n, p.spread)
}

// rankedAlike says whether a later turn's previous request was ranked as it
// is, and so sent to e, its first, unless a load bound spilled it: e has not
// moved conversations lately (it joined the pool, or came back into
// rotation), nor has an endpoint that would rank above it (out of rotation,
// or gone, since), nor does this replica remember sending the previous
// request elsewhere. A second turn ranked over the whole pool (home) follows
// a first request ranked in its prefix's home set: that ranking's first must
// be e too.
func (p *prefixAffinity) rankedAlike(req *Request, e *Endpoint, prefix, conversation uint64, share float64, eps []*Endpoint, served map[string]int) bool {
	if recentlyMoved(e, e.cfg().now()) {
		return false
	}
	if prev := len(req.Previous()) / p.keys.blockChars; prev > 0 && served[e.engine()] < prev && routed(served, prev) {
		return false
	}
	all := eps
	if len(req.absent) > 0 {
		all = slices.Concat(eps, req.absent) // as ranked before they left
	}
	now := p.home(req, share, all)
	before := now
	if len(req.Previous()) <= len(req.Head()) {
		before = homeSize(share, len(all), p.spread) // the previous request was the conversation's first
	}
	if len(all) == len(eps) && before == now {
		return true // ranked as this request, whose first e is
	}
	return rank(prefix, conversation, before, all)[0].e == e
}

// estimate notes on req what e is estimated to hold of its prompt, before
// the request is recorded as sent there: what this replica remembers
// sending e, or, when e is the endpoint the request ranks first (its
// conversation's, with no load in the way) and the previous request ranked
// alike, at least the conversation's previous request, which every replica
// sent there unless a load bound spilled it. The second holds whatever
// replica routed that request, so replicas mostly estimate alike. What this
// replica remembers sending counts, on the pool whose estimates the cache
// rule reads, only while e's engine, by its scraped counters, has since
// written less than its cache holds (prefixIndex.fresh): a cache smaller
// than the prompts it serves has evicted the rest. An
// endpoint that has failed requests since it last served one (troubled) is
// estimated to hold nothing: its engine may have restarted, its cache lost.
func (p *prefixAffinity) estimate(req *Request, e *Endpoint, hs []uint64, served map[string]int, first bool) {
	if req == nil {
		return
	}
	blocks := served[e.engine()]
	if p.cacheRule() {
		blocks = p.holds(e, hs, blocks)
	}
	held := blocks * p.keys.blockChars
	if first {
		held = max(held, len(req.Previous()))
	}
	if e.troubled.Load() {
		held = 0
	}
	req.held = estimate{addr: e.Addr, chars: held}
}

// holds is how many of the n leading blocks of the chain hs that this
// replica remembers sending e are still in e's engine's cache, as far as its
// scraped counters tell (prefixIndex.fresh): n when they tell nothing, none
// when they are stale (the engine may have written its cache over, or
// restarted, since; and an engine that cannot be scraped is often one that
// fails its requests too).
func (p *prefixAffinity) holds(e *Endpoint, hs []uint64, n int) int {
	if n == 0 {
		return 0
	}
	since, ok, stale := e.cacheWindow()
	switch {
	case stale:
		return 0
	case ok:
		return p.index.fresh(hs[:n], e.engine(), since)
	}
	return n
}

// record notes in the local hint that e now holds prompt, whose chain is hs,
// and its engine's stamp by then.
func (p *prefixAffinity) record(prompt string, hs []uint64, e *Endpoint) {
	p.index.record(prompt, hs, e.engine(), e.stamp())
}

// cacheRule says whether the P/D decider's cache rule reads this pool's
// picks and their estimates: Decider.decodeSpec gives that pool a
// turnQueueSlack, and prefillSpec the prefill pool.
func (p *prefixAffinity) cacheRule() bool { return p.turnQueueSlack > 0 && !p.prefill }

// routed says whether this replica sent a request with these blocks
// somewhere: whether some endpoint is remembered serving all of them.
func routed(served map[string]int, blocks int) bool {
	for _, n := range served {
		if n >= blocks {
			return true
		}
	}
	return false
}
