package scheduling

import (
	"cmp"
	"sync/atomic"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// Scorer rates the candidate endpoints of a request: one score per endpoint,
// in the order given, higher is better.
type Scorer interface {
	Score(req *Request, eps []*Endpoint) []float64
}

// Picker chooses one of the candidate endpoints of a request. Candidates are
// never empty and are all healthy and allowed; a Picker only ranks.
type Picker interface {
	Pick(req *Request, eps []*Endpoint) *Endpoint
}

// newPicker builds a pool's policy. intn draws random numbers in [0, n);
// cache is the pool's view of its engines' caches (nil without KV events).
func newPicker(s PoolSpec, intn func(int) int, cache func() *kvevents.Index) Picker {
	leastLoad := &twoChoices{scorer: loadScorer{}, intn: intn}
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
		}
	}
	return leastLoad
}

// loadScorer prefers the least busy endpoint (see Endpoint.Busyness).
type loadScorer struct{}

func (loadScorer) Score(_ *Request, eps []*Endpoint) []float64 {
	s := make([]float64, len(eps))
	for i, e := range eps {
		s[i] = -e.Busyness()
	}
	return s
}

// twoChoices compares two random candidates and keeps the better scored
// ("power of two choices"): nearly as good as the best of all, and concurrent
// pickers that see the same counts do not all pile onto one endpoint.
type twoChoices struct {
	scorer Scorer
	intn   func(int) int
}

func (p *twoChoices) Pick(req *Request, eps []*Endpoint) *Endpoint {
	if len(eps) == 1 {
		return eps[0]
	}
	i := p.intn(len(eps))
	j := p.intn(len(eps) - 1)
	if j >= i {
		j++
	}
	pair := []*Endpoint{eps[i], eps[j]}
	s := p.scorer.Score(req, pair)
	if s[1] > s[0] {
		return pair[1]
	}
	return pair[0]
}

// roundRobin takes the candidates in turn: the baseline every policy must beat.
type roundRobin struct{ next atomic.Uint64 }

func (p *roundRobin) Pick(_ *Request, eps []*Endpoint) *Endpoint {
	return eps[(p.next.Add(1)-1)%uint64(len(eps))]
}
