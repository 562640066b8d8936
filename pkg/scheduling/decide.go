package scheduling

import (
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// Split says whether a request is disaggregated, and why (the reasons are
// metrics', so that the pd_decisions_total{reason} set stays closed).
type Split struct {
	PD     bool
	Reason metrics.Reason
}

// Decider chooses P/D or decode-only per request. It is separate from the
// pickers: it never looks at which endpoint a request would get.
type Decider struct {
	cfg    config.PD
	paired bool // Spec.Paired
}

// newDecider returns the decider of spec (pd defaults filled in).
func newDecider(spec Spec) *Decider {
	spec.PD.SetDefaults()
	return &Decider{cfg: spec.PD, paired: spec.Paired}
}

// Decide returns the decision for req given the prefill pool. Requests the
// engines cannot disaggregate go decode-only whatever the mode. For paired
// engines the only decode-only reasons left are the request's own Alone and
// no_prefill (config refuses never and min_prompt_tokens for them), which the
// caller must then refuse.
func (d *Decider) Decide(req *Request, prefill *Pool) Split {
	switch {
	case req != nil && req.Alone != 0:
		return Split{Reason: req.Alone}
	case d.cfg.Mode == config.PDNever:
		return Split{Reason: metrics.ReasonNever}
	case req != nil && req.N > 1 && !d.paired:
		return Split{Reason: metrics.ReasonNGT1}
	case req != nil && req.Prompts > 1 && !d.paired:
		return Split{Reason: metrics.ReasonBatch}
	case d.cfg.Mode == config.PDAuto && d.cfg.MinPromptTokens > 0 && req.PromptTokens(d.cfg.CharsPerToken) < d.cfg.MinPromptTokens:
		return Split{Reason: metrics.ReasonShortPrompt}
	case !prefill.Ready():
		return Split{Reason: metrics.ReasonNoPrefill}
	case d.cfg.Mode == config.PDAlways:
		return Split{PD: true, Reason: metrics.ReasonAlways}
	}
	return Split{PD: true, Reason: metrics.ReasonLongPrompt}
}
