package scheduling

import (
	"cmp"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// Split says whether a request is disaggregated, and why (the reasons are
// metrics', so that the pd_decisions_total{reason} set stays closed).
type Split struct {
	PD     bool
	Reason metrics.Reason
	// Held is, for cached_prefix, how many of the prompt's tokens the
	// decode endpoint is estimated to hold: what its answer is checked
	// against (Endpoint.ReportCached).
	Held int
}

// Decider chooses P/D or decode-only per request, once its decode endpoint
// is picked: by the request, by what that endpoint is estimated to hold of
// the prompt, and by the pools' load.
type Decider struct {
	cfg         config.PD
	paired      bool // Spec.Paired
	minUncached int  // the cache rule's bound (pd.min_uncached_tokens), 0: off
}

// newDecider returns the decider of spec (pd defaults filled in).
func newDecider(spec Spec) *Decider {
	spec.PD.SetDefaults()
	d := &Decider{cfg: spec.PD, paired: spec.Paired}
	if !spec.Paired {
		d.minUncached = spec.PD.UncachedTokens(spec.Decode.Policy)
	}
	return d
}

// decodeSpec is the decode pool's spec as the cache rule needs it, its
// defaults filled in. With the rule on, a conversation's later turns rank
// over the whole pool rather than its prefix's home set (prefixAffinity.home)
// and stay with their history within the bound of a followed history
// (PoolSpec.turnQueueSlack): the rule assumes a later turn holds its history
// on the endpoint the turn ranks first, and replicas that size the home set
// apart (each estimates the prefix's share from the requests it sees) would
// rank a different first, and decide apart. With queue_slack left out, the
// decode pool's default (config.DefaultDecodeQueueSlack) is then the later
// turns', and the other requests take the usual one.
func (d *Decider) decodeSpec(s PoolSpec) PoolSpec {
	s.SetDefaults()
	if d.cfg.Mode != config.PDAuto || d.minUncached == 0 {
		return s
	}
	s.turnQueueSlack = cmp.Or(s.Prefix.EstimateQueueSlack, s.Prefix.QueueSlack)
	if s.Prefix.EstimateQueueSlack != 0 { // queue_slack left out (config.SetDecodeDefaults)
		s.Prefix.EstimateQueueSlack = config.DefaultQueueSlack
	}
	return s
}

// Decide returns the decision for req, whose decode endpoint is decode (of
// the pool decodes), given the prefill pool. Requests the engines cannot
// disaggregate go decode-only whatever the mode. For paired engines the only decode-only
// reasons left are the request's own Alone and no_prefill (config refuses
// never, min_prompt_tokens, the cache rule and the load arm for them), which
// the caller must then refuse.
func (d *Decider) Decide(req *Request, prefill, decodes *Pool, decode *Endpoint) Split {
	switch {
	case req != nil && req.Alone != 0:
		return Split{Reason: req.Alone}
	case d.cfg.Mode == config.PDNever:
		return Split{Reason: metrics.ReasonNever}
	case req != nil && req.N > 1 && !d.paired:
		return Split{Reason: metrics.ReasonNGT1}
	case req != nil && req.Prompts > 1 && !d.paired:
		return Split{Reason: metrics.ReasonBatch}
	case d.cfg.Mode == config.PDAuto && d.cfg.MinPromptTokens > 0 && req.PromptTokens(d.cfg.CharsPerToken) < d.cfg.MinPromptTokens &&
		!req.uncountedMedia(0):
		return Split{Reason: metrics.ReasonShortPrompt}
	case !prefill.Ready():
		return Split{Reason: metrics.ReasonNoPrefill}
	case d.cfg.Mode == config.PDAlways:
		return Split{PD: true, Reason: metrics.ReasonAlways}
	}
	s := Split{PD: true, Reason: metrics.ReasonLongPrompt}
	if held, ok := d.cached(req, decode); ok {
		s = Split{Reason: metrics.ReasonCachedPrefix, Held: held}
	}
	if l := d.cfg.Load; l.On() {
		switch {
		case queue(decodes, decode) >= l.DecodeQueue:
			if !s.PD {
				s = Split{PD: true, Reason: metrics.ReasonDecodeBusy}
			}
		case s.PD && meanQueue(prefill) >= l.PrefillQueue:
			s = Split{Reason: metrics.ReasonPrefillBusy}
		}
	}
	return s
}

// cached is the cache rule (llm-d's and Dynamo's): decode is estimated to
// hold part of the prompt, and the part it lacks is below
// pd.min_uncached_tokens and pd.max_uncached_ratio of the prompt, so that
// computing it there costs less than a prefill leg's round trip and queue;
// and decode's answers have not belied its estimates lately (trust.go).
// A media part decode is not estimated to hold is never below them: decode
// would encode it and compute its tokens, which no estimate counts.
// It returns the tokens decode is estimated to hold.
func (d *Decider) cached(req *Request, decode *Endpoint) (held int, ok bool) {
	if d.minUncached <= 0 || req.Held(decode) == 0 || !decode.CacheTrusted() || req.uncountedMedia(req.Held(decode)) {
		return 0, false
	}
	uncached, tokens := req.UncachedTokens(decode, d.cfg.CharsPerToken)
	return tokens - uncached, uncached < d.minUncached && float64(uncached) < d.cfg.MaxUncachedRatio*float64(tokens)
}

// queue is e's queue (waiting requests) by its fresh figures; without them
// (its scrapes failing, its figures stale, or none yet) it is the mean of
// its pool's (meanQueue), as the pickers count such an engine: an engine
// whose /metrics stopped answering, often because it is overloaded, reads
// neither idle nor as its last answer.
func queue(p *Pool, e *Endpoint) float64 {
	if e != nil {
		if l, ok := e.Fresh(); ok {
			return l.Waiting
		}
	}
	return meanQueue(p)
}

// meanQueue is the mean queue of p's healthy endpoints that have fresh
// figures, 0 when none has: one without counts neither as 0 nor at all.
func meanQueue(p *Pool) float64 {
	return meanLoad(p.Endpoints(), p.deps.Now, (*Endpoint).Healthy).queued
}
