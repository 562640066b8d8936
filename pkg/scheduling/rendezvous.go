package scheduling

import (
	"cmp"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// rendezvousScorer weights each endpoint for a request by rendezvous
// (highest-random-weight) hashing: a hash of the request's key and the
// endpoint's address. Requests that share a key rank the endpoints alike, and
// every replica ranks them alike: the hash is fixed (xxhash), not seeded per
// process. Removing an endpoint moves only the keys it ranked first.
type rendezvousScorer struct{ blockChars, keyBlocks int }

// key is what ranks a request, at most keyBlocks blocks of its prompt: the
// conversation's head when it has one (through the first user message, which
// every later turn repeats, so a conversation ranks alike however long it
// grows), else the prompt's full blocks. "" when there is neither.
func (s rendezvousScorer) key(req *Request) string {
	prompt := req.Prompt()
	end := len(prompt) / s.blockChars * s.blockChars
	if head := req.Head(); head != "" {
		end = len(head)
	}
	return prompt[:min(end, s.keyBlocks*s.blockChars)]
}

// Score returns nil when the request has no key.
func (s rendezvousScorer) Score(req *Request, eps []*Endpoint) []float64 {
	key := s.key(req)
	if key == "" {
		return nil
	}
	h := xxhash.Sum64String(key)
	out := make([]float64, len(eps))
	for i, e := range eps {
		// 53 bits, exact in a float64: no two weights tie by rounding.
		out[i] = float64(mix64(h^xxhash.Sum64String(e.Addr)) >> 11)
	}
	return out
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

// prefixAffinity ranks the candidates by rendezvousScorer and takes the first
// whose busyness is within the bound, factor × the mean busyness + slack
// (consistent hashing with bounded loads; the slack because an engine batches
// a few extra requests nearly for free). A hot key spills over to the next
// endpoints in its own order.
//
// Its choice depends on the request, the candidates and their busyness,
// which is the engines' scraped queue and KV use (alike on every replica)
// plus this replica's own requests in flight. So replicas agree, without
// talking, whenever the first-ranked endpoint is within the bound, and part
// only by the local share of the in-flight counts.
//
// The index is a local hint on top:
//   - A request follows the endpoint, within the bound, that this replica
//     remembers serving more of the prompt than the key covers (an earlier
//     turn, spilled there), rather than going back to a cold cache (the
//     higher-ranked of equals). A replica that never saw the conversation
//     takes the ranking.
//   - While this replica sees its conversations whole (coverage: it routed
//     the previous request of nearly every later turn it was asked for, as
//     when it is the only replica, or each conversation reaches only it),
//     it is trusted further. A later turn follows the endpoint that served
//     its previous request, and a conversation's first request goes where
//     the most of its prompt (its system prompt) is remembered, the less busy
//     of equals; both within the bound. Behind N replicas taking turns, the
//     next turn would come to a replica that knows only the ranking, so there
//     every turn takes it: agreement never depends on memory.
type prefixAffinity struct {
	scorer        rendezvousScorer
	index         *prefixIndex
	coverage      coverage
	factor, slack float64
	fallback      Picker // for prompts without a full block
}

func (p *prefixAffinity) Pick(req *Request, eps []*Endpoint) *Endpoint {
	weights := p.scorer.Score(req, eps)
	if weights == nil {
		return p.fallback.Pick(req, eps)
	}
	type ranked struct {
		e            *Endpoint
		weight, busy float64
	}
	rs := make([]ranked, len(eps))
	var total float64
	for i, e := range eps {
		rs[i] = ranked{e: e, weight: weights[i], busy: e.Busyness()}
		total += rs[i].busy
	}
	bound := p.factor*total/float64(len(eps)) + p.slack
	slices.SortFunc(rs, func(a, b ranked) int { return cmp.Compare(b.weight, a.weight) })
	chosen := rs[0] // unless one is within the bound, and the least busy always is
	for _, r := range rs {
		if r.busy <= bound {
			chosen = r
			break
		}
	}

	prompt, previous := req.Prompt(), req.Previous()
	hs := p.index.hashes(prompt)
	served := p.index.matched(hs)
	// A later turn tells whether this replica routed the request before it.
	prevBlocks := len(previous) / p.scorer.blockChars
	whole := p.coverage.note(prevBlocks > 0, p.index.ended(previous, hs))
	if whole && req.Head() != "" && previous == "" {
		// A conversation's first request: where the most of it (its system
		// prompt) is remembered, the less busy of equals.
		best := served[chosen.e.Addr]
		for _, r := range rs {
			if n := served[r.e.Addr]; r.busy <= bound && n > 0 && (n > best || n == best && r.busy < chosen.busy) {
				chosen, best = r, n
			}
		}
	} else {
		// Where more than the key is remembered, or, while conversations
		// are whole, the previous request.
		best, keyLen := 0, len(p.scorer.key(req))/p.scorer.blockChars
		for _, r := range rs {
			n := served[r.e.Addr]
			follows := n > keyLen || whole && prevBlocks > 0 && n >= prevBlocks
			if follows && n > best && r.busy <= bound {
				chosen, best = r, n
			}
		}
	}
	p.index.record(prompt, hs, chosen.e.Addr)
	return chosen.e
}
