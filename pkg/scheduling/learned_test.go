package scheduling

import "github.com/pd-extproc/pd-extproc/pkg/config"

// learnedAffinity is what prefix-affinity was before it ranked endpoints by
// rendezvous hashing, kept as the simulation's baseline: the endpoint this
// replica remembers serving the longest part of the prompt, within the same
// load bound; without a usable match, least load among the endpoints within
// the bound; either way the choice is remembered. Its memory is the whole
// policy, so replicas that did not see a conversation place it anew.
type learnedAffinity struct {
	index         *prefixIndex
	factor, slack float64
	fallback      Picker
}

// memoryPolicy is learnedAffinity with the defaults it shipped with
// (load_factor 1.5, load_slack 4).
var memoryPolicy = simPolicy{name: "prefix-memory", picker: func(s config.PoolScheduling, intn func(int) int) Picker {
	s.Prefix.SetDefaults()
	return &learnedAffinity{index: newPrefixIndex(s.Prefix.BlockChars, s.Prefix.MaxBlocks), factor: 1.5, slack: 4,
		fallback: &twoChoices{intn: intn}}
}}

func (p *learnedAffinity) Pick(req *Request, eps []*Endpoint) *Endpoint {
	hs := p.index.hashes(0, req.Prompt())
	if len(hs) == 0 {
		return p.fallback.Pick(req, eps)
	}
	matched := p.index.matched(hs)
	busy := make([]float64, len(eps))
	var total float64
	for i, e := range eps {
		busy[i] = float64(e.InFlight())
		if s := e.scrapedAt(e.cfg().now); s != nil {
			busy[i] += s.Waiting + s.KVUsage
		}
		total += busy[i]
	}
	bound := p.factor*total/float64(len(eps)) + p.slack
	var best *Endpoint
	bestBlocks, bestBusy := 0, 0.0
	within := make([]*Endpoint, 0, len(eps)) // never empty: the least busy is below the mean
	for i, e := range eps {
		if busy[i] > bound {
			continue
		}
		within = append(within, e)
		n := matched[e.Addr]
		if n > 0 && (n > bestBlocks || (n == bestBlocks && busy[i] < bestBusy)) {
			best, bestBlocks, bestBusy = e, n, busy[i]
		}
	}
	if best == nil {
		best = p.fallback.Pick(req, within)
	}
	p.index.record(req.Prompt(), hs, best.Addr, stamp{})
	return best
}
