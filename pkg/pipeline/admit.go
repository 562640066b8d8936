package pipeline

import (
	"math/rand/v2"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// maxPairedSamples bounds the bootstrap lists of one kv-sglang request
// (pd.sglang_parallel_sampling: rooms): a room per sample, each leg's body
// grows with them.
const maxPairedSamples = 128

// admit says what the API table makes of a request before scheduling: why it
// must go to a decode endpoint alone (a metrics reason), 0 when it may be
// disaggregated, or the client's error when the connector's engines cannot
// serve it as asked. Under a paired connector (kv-sglang), which cannot send
// anything to a decode engine alone, every such request but a pass-through
// one is refused.
func (p *Pipeline) admit(a *api.API, obj *body.Object) (alone metrics.Reason, err error) {
	family := p.connector.Family()
	switch {
	case a.IsPassthrough():
		return metrics.ReasonPassthrough, nil
	case !a.Serves.Has(family):
		return 0, notServed(a, p.opts.Connector, family)
	case !a.Pairs.Has(family) && p.connector.Paired():
		return 0, cannotPair(a, p.opts.Connector, a.Unpaired)
	case !a.Pairs.Has(family):
		return metrics.ReasonUnpairedAPI, nil
	}
	switch a.Alone(obj) {
	case api.PromptLogprobs:
		if p.connector.Paired() {
			return 0, cannotPair(a, p.opts.Connector, "the request asks for prompt logprobs, which only the prefill engine "+
				"computes, and this connector cannot send it to a decode engine alone")
		}
		return metrics.ReasonPromptLogprobs, nil
	case api.StoredResponse:
		return metrics.ReasonStoredResponse, nil // never paired: no paired family disaggregates the Responses API
	}
	return 0, nil
}

// rooms are the bootstrap rooms of a kv-sglang request with several samples,
// one per sample, when pd.sglang_parallel_sampling is rooms; nil for any other
// request (one room, to which the engine adds the prompt's index in a batch).
// Without the option such a request is refused: SGLang is reported to hang
// or fail on samples sharing a room.
func (p *Pipeline) rooms(sreq *scheduling.Request) ([]uint64, error) {
	if !p.connector.Paired() || sreq.N <= 1 {
		return nil, nil
	}
	if !p.parallelRooms.Load() {
		return nil, parallelSamplesRefused(sreq.N)
	}
	n := sreq.N * max(sreq.Prompts, 1)
	if n > maxPairedSamples {
		return nil, tooManySamples(n, maxPairedSamples)
	}
	rooms := make([]uint64, 0, n)
	seen := make(map[uint64]bool, n)
	for len(rooms) < n {
		if r := rand.Uint64() >> 1; !seen[r] { // 0..2^63-1, distinct
			seen[r] = true
			rooms = append(rooms, r)
		}
	}
	return rooms, nil
}
