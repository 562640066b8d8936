package scheduling

import (
	"cmp"
	"sync/atomic"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// Picker chooses one of the candidate endpoints of a request. Candidates are
// never empty and are all healthy and allowed; a Picker only ranks.
type Picker interface {
	Pick(req *Request, eps []*Endpoint) *Endpoint
}

// newPicker builds the policy of a pool of role r. intn draws random numbers
// in [0, n); cache is the pool's view of its engines' caches (nil without KV
// events).
func newPicker(s PoolSpec, r role, intn func(int) int, cache func() *kvevents.Index) Picker {
	leastLoad := &twoChoices{intn: intn}
	switch s.Policy {
	case config.PolicyRoundRobin:
		return &roundRobin{}
	case config.PolicyPrefixAffinity:
		return &prefixAffinity{
			keys:               rendezvousKeys{blockChars: s.Prefix.BlockChars, keyBlocks: s.Prefix.KeyBlocks},
			index:              newPrefixIndex(s.Prefix.BlockChars, s.Prefix.MaxBlocks),
			shares:             newPoolShares(),
			named:              &coverage{},
			clients:            &clientCoverages{},
			factor:             s.Prefix.LoadFactor,
			slack:              s.Prefix.LoadSlack,
			queueSlack:         s.Prefix.QueueSlack,
			estimateQueueSlack: cmp.Or(s.Prefix.EstimateQueueSlack, s.Prefix.QueueSlack),
			turnQueueSlack:     s.turnQueueSlack,
			spread:             s.Prefix.Spread,
			fallback:           leastLoad,
			cache:              cache,
			prefill:            r == rolePrefill,
		}
	}
	return leastLoad
}

// twoChoices compares two random candidates and keeps the less busy
// (Endpoint.busynessOf; "power of two choices"): nearly as good as the best
// of all, and concurrent pickers that see the same counts do not all pile
// onto one endpoint. The candidates' mean load is read only for one of the
// two without fresh figures.
type twoChoices struct {
	intn func(int) int
}

func (p *twoChoices) Pick(_ *Request, eps []*Endpoint) *Endpoint {
	if len(eps) == 1 {
		return eps[0]
	}
	i := p.intn(len(eps))
	j := p.intn(len(eps) - 1)
	if j >= i {
		j++
	}
	// Neither the clock nor the mean in a sync.OnceValue: allocating one
	// doubled the cost of a pick, and the mean is rarely read.
	now := eps[i].cfg().now
	mean := func() poolLoad { return meanLoad(eps, now, nil) }
	first, _ := eps[i].busynessOf(eps[i].scrapedAt(now), mean)
	if second, _ := eps[j].busynessOf(eps[j].scrapedAt(now), mean); second < first {
		return eps[j]
	}
	return eps[i]
}

// roundRobin takes the candidates in turn: the baseline every policy must beat.
type roundRobin struct{ next atomic.Uint64 }

func (p *roundRobin) Pick(_ *Request, eps []*Endpoint) *Endpoint {
	return eps[(p.next.Add(1)-1)%uint64(len(eps))]
}
