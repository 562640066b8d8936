package scheduling

import (
	"cmp"
	"math/bits"
	"slices"

	"github.com/cespare/xxhash/v2"

	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// rendezvousKeys are the two keys that rank a request's endpoints by
// rendezvous (highest-random-weight) hashing: a hash of the key and the
// endpoint's address. Requests that share a key rank the endpoints alike,
// and every replica ranks them alike: the hash is fixed (xxhash), not seeded
// per process. Removing an endpoint moves only the keys it ranked first.
type rendezvousKeys struct{ blockChars, keyBlocks int }

// keys returns, each at most keyBlocks blocks:
//   - prefix, what the request shares with others: its preamble (tools,
//     system prompt, instructions: an agent's or a template's) when that
//     fills a block, else its head (through the first user message), else
//     its full blocks (a completions prompt, token ids);
//   - conversation, what every turn of its conversation repeats: its head,
//     or its prefix when it has none.
//
// A later turn whose preamble leaves less than a block of the key to the
// first user message keys its conversation by its head with the preamble
// kept whole and keyBlocks blocks after it (wholeHead), so that an agent's
// tools and system prompt, tens of kilobytes, leave room for what tells its
// conversations apart: each then keeps to an endpoint of the prefix's home
// set of its own. A first request (a one-shot one, as far as anyone knows)
// keeps the head cut to the key, so that questions under one long system
// prompt meet on the first of its home set, which then caches the prompt for
// all of them. Both are "" when the request has neither a head nor a full
// block.
func (k rendezvousKeys) keys(req *Request) (prefix, conversation string) {
	prompt, limit := req.Prompt(), k.keyBlocks*k.blockChars
	head := req.Head()
	if head == "" {
		prefix = prompt[:min(len(prompt)/k.blockChars*k.blockChars, limit)]
		return prefix, prefix
	}
	conversation = head[:min(len(head), limit)]
	pre := req.Preamble()
	if len(pre) < k.blockChars {
		return conversation, conversation
	}
	if req.Previous() != "" && k.wholeHead(req) {
		conversation = head[:min(len(head), len(pre)+limit)]
	}
	return pre[:min(len(pre), limit)], conversation
}

// wholeHead says whether the key cut to keyBlocks blocks leaves less than a
// block of the request's first user message to a preamble that is its
// prefix key, so that a later turn keys by more of its head than the
// conversation's first request did.
func (k rendezvousKeys) wholeHead(req *Request) bool {
	limit, pre := k.keyBlocks*k.blockChars, len(req.Preamble())
	return pre >= k.blockChars && pre > limit-k.blockChars && len(req.Head()) > limit
}

// conversationHash is the hash of a request's conversation key, with the
// client's own name for the conversation on a later turn (OpenAI's
// prompt_cache_key: Codex's conversation id, where the first user item is
// the same for every session in a directory).
func conversationHash(req *Request, conversation string, namespace uint64) uint64 {
	h := xxhash.Sum64String(conversation) ^ namespace
	if name := req.conversationName(); name != "" && req.Previous() != "" {
		h ^= mix64(xxhash.Sum64String(name))
	}
	return h
}

// keyedAlike says whether a later turn's previous request was ranked by the
// same conversation key (keys, conversationHash): always when that was a
// later turn too; when it was the conversation's first, only if neither the
// head kept whole nor a name set the two apart.
func (k rendezvousKeys) keyedAlike(req *Request) bool {
	return len(req.Previous()) > len(req.Head()) || req.conversationName() == "" && !k.wholeHead(req)
}

// weighed is an endpoint's rendezvous weight for a key's hash, in the bits
// above the posBits that hold pos, its position among the candidates: one
// integer to sort by (pos parts only weights equal in every bit kept).
func weighed(key uint64, e *Endpoint, pos, posBits int) uint64 {
	h := e.addrHash
	if h == 0 { // a bare Endpoint
		h = xxhash.Sum64String(e.Addr)
	}
	return mix64(key^h)>>posBits<<posBits | uint64(pos)
}

// mix64 is splitmix64's finalizer, so that an endpoint's weight for one key
// says nothing of its weight for another.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// followQueue × queueSlack is the queue over the mean at which a request
// stops following the endpoint that holds its history (the local hint).
const followQueue = 3

// homeSize is how many endpoints a prefix with this share of the pool's
// requests keeps its cache on: share × n × spread, at least 1, rounded up
// to a power of two so that replicas, whose estimates of the share differ
// a little, mostly agree, and at most n.
func homeSize(share float64, n int, spread float64) int {
	k := int(share*float64(n)*spread + 0.999)
	if k <= 1 {
		return 1
	}
	return min(n, 1<<bits.Len(uint(k-1)))
}

// ranked is a candidate endpoint as prefixAffinity orders them.
type ranked struct {
	e            *Endpoint
	busy, queued float64 // busyness
}

// rank orders the candidates for a request: by the weights of its prefix
// (whose hash is prefix), with the first home of them (the prefix's home set)
// reordered by the conversation's (whose hash is conversation). Requests that
// share a prefix share its first home endpoints, so that a system prompt is
// cached on as few engines as its traffic needs; within them each
// conversation has an order of its own, which its turns keep.
//
// It sorts integers (weighed), heaviest first, not the ranked structs: at a
// thousand candidates the pick takes 0.4 of the time (BenchmarkSelectAtScale).
func rank(prefix, conversation uint64, home int, eps []*Endpoint) []ranked {
	posBits := max(1, bits.Len(uint(len(eps)-1)))
	var small [64]uint64 // most pools': no allocation
	keys := small[:0]
	if len(eps) > len(small) {
		keys = make([]uint64, 0, len(eps))
	}
	for i, e := range eps {
		keys = append(keys, weighed(prefix, e, i, posBits))
	}
	slices.Sort(keys)
	slices.Reverse(keys)
	pos := func(k uint64) int { return int(k & (1<<posBits - 1)) }
	if home > 1 {
		for j, k := range keys[:home] {
			keys[j] = weighed(conversation, eps[pos(k)], pos(k), posBits)
		}
		slices.Sort(keys[:home])
		slices.Reverse(keys[:home])
	}
	ordered := make([]*Endpoint, len(keys))
	for j, k := range keys {
		ordered[j] = eps[pos(k)]
	}
	return busyness(ordered)
}

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
//     system prompt) is remembered, the less busy of equals. Behind N
//     replicas taking turns, the next turn would come to a
//     replica that knows only the ranking, so there every turn takes it.
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
	spread             float64
	fallback           Picker // for requests with no key, or unrelated prompts
	// cache is the pool's view of its engines' caches from their KV events,
	// nil when it follows none (events.go).
	cache func() *kvevents.Index
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
// prompt, of equals the first in the ranking (a later turn) or the less busy
// (a first request, within loadBounds.starting); else, or when none within
// its bound holds a block, the first in the ranking within the bounds, and
// the local hint.
func (p *prefixAffinity) byRanking(req *Request, eps []*Endpoint, held map[string]int) *Endpoint {
	prefix, conversation := p.keys.keys(req)
	if held != nil && (prefix == "" || req.Head() == "") {
		// No ranking that requests share (a completions prompt): the least
		// busy of those holding the most.
		rs := busyness(eps)
		slices.SortStableFunc(rs, func(a, b ranked) int { return cmp.Compare(a.busy, b.busy) })
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
			p.estimate(req, e, served, false)
			p.index.record(prompt, hs, e.Addr)
			return e
		}
	}
	h := xxhash.Sum64String(prefix) ^ ns
	conv, share := conversationHash(req, conversation, ns), p.shares.of(req).note(h)
	rs := rank(h, conv, homeSize(share, len(eps), p.spread), eps)
	queueSlack := p.queueSlack
	if held == nil {
		queueSlack = p.estimateQueueSlack
	}
	b := p.bounds(rs, queueSlack)
	if held != nil {
		order, hb := rs, b
		if previous == "" {
			// A conversation's first request (or a one-shot one): the less
			// busy of equals, as later turns find it wherever it went, and
			// none busier than the mean.
			order, hb = slices.Clone(rs), b.starting()
			slices.SortStableFunc(order, func(a, b ranked) int { return cmp.Compare(a.busy, b.busy) })
		}
		if e := p.holding(order, held, hb); e != nil {
			return e // the local hint is not told: the view knows better while it can be trusted
		}
	}
	within := func(r ranked) bool { return b.within(r.busy, r.queued) }
	follow := func(r ranked) bool { return b.follows(r.busy, r.queued) }
	chosen := rs[0] // unless one is within the bounds, and the least busy nearly always is
	for _, r := range rs {
		if within(r) {
			chosen = r
			break
		}
	}

	if hs == nil {
		hs = p.index.hashes(ns, prompt)
		served = p.index.matched(hs)
	}
	// A later turn tells whether this replica routed the request before it.
	prevBlocks := len(previous) / p.keys.blockChars
	cov := p.named
	if !req.Session {
		cov = p.clients.of(req.Client)
	}
	whole := cov.note(prevBlocks > 0, p.index.ended(previous, hs))
	if whole && req.Head() != "" && previous == "" {
		// A conversation's first request: where the most of it (its system
		// prompt) is remembered, the less busy of equals.
		best := served[chosen.e.Addr]
		for _, r := range rs {
			if n := served[r.e.Addr]; follow(r) && n > 0 && (n > best || n == best && r.busy < chosen.busy) {
				chosen, best = r, n
			}
		}
	} else {
		// Where more than the conversation key is remembered, or, while
		// conversations are whole, the previous request.
		best, keyLen := 0, len(conversation)/p.keys.blockChars
		for _, r := range rs {
			n := served[r.e.Addr]
			follows := n > keyLen || whole && prevBlocks > 0 && n >= prevBlocks
			if follows && n > best && follow(r) {
				chosen, best = r, n
			}
		}
	}
	first := chosen.e == rs[0].e && p.keys.keyedAlike(req) && p.rankedAlike(req, chosen.e, h, conv, share, eps, served)
	p.estimate(req, chosen.e, served, first)
	p.index.record(prompt, hs, chosen.e.Addr)
	return chosen.e
}

// rankedAlike says whether a later turn's previous request was ranked as it
// is, and so sent to e, its first, unless a load bound spilled it: e has not
// moved conversations lately (it joined the pool, or came back into
// rotation), nor has an endpoint that would rank above it (out of rotation,
// or gone, since), nor does this replica remember sending the previous
// request elsewhere.
func (p *prefixAffinity) rankedAlike(req *Request, e *Endpoint, prefix, conversation uint64, share float64, eps []*Endpoint, served map[string]int) bool {
	if recentlyMoved(e, e.cfg().now()) {
		return false
	}
	if prev := len(req.Previous()) / p.keys.blockChars; prev > 0 {
		for addr, n := range served {
			if n >= prev && addr != e.Addr && served[e.Addr] < prev {
				return false
			}
		}
	}
	if len(req.absent) == 0 {
		return true
	}
	all := slices.Concat(eps, req.absent)
	return rank(prefix, conversation, homeSize(share, len(all), p.spread), all)[0].e == e
}

// estimate notes on req what e is estimated to hold of its prompt, before
// the request is recorded as sent there: what this replica remembers
// sending e, or, when e is the endpoint the request ranks first (its
// conversation's, with no load in the way) and the previous request ranked
// alike, at least the conversation's previous request, which every replica
// sent there unless a load bound spilled it. The second holds whatever
// replica routed that request, so replicas mostly estimate alike. An
// endpoint that has failed requests since it last served one (troubled) is
// estimated to hold nothing: its engine may have restarted, its cache lost.
func (p *prefixAffinity) estimate(req *Request, e *Endpoint, served map[string]int, first bool) {
	if req == nil {
		return
	}
	held := served[e.Addr] * p.keys.blockChars
	if first {
		held = max(held, len(req.Previous()))
	}
	if e.troubled.Load() {
		held = 0
	}
	req.held = estimate{addr: e.Addr, chars: held}
}

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
