package scheduling

import (
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// Why a request went P/D or decode-only: the pd_decisions_total{reason}
// labels metrics declares, so the set stays closed.
const (
	ReasonAlways      = metrics.ReasonAlways      // pd.mode: always
	ReasonLongPrompt  = metrics.ReasonLongPrompt  // auto, prompt at or above pd.min_prompt_tokens
	ReasonNever       = metrics.ReasonNever       // pd.mode: never
	ReasonShortPrompt = metrics.ReasonShortPrompt // auto, prompt below pd.min_prompt_tokens
	ReasonMultipleN   = metrics.ReasonNGT1        // several choices: engines cannot hand off n > 1
	ReasonBatch       = metrics.ReasonBatch       // several prompts in one completions request
	ReasonNoPrefill   = metrics.ReasonNoPrefill   // no healthy prefill endpoint
)

// Decision says whether a request is disaggregated, and why.
type Decision struct {
	PD     bool
	Reason string
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
func (d *Decider) Decide(req *Request, prefill *Pool) Decision {
	switch {
	case req != nil && req.Alone != "":
		return Decision{Reason: req.Alone}
	case d.cfg.Mode == config.PDNever:
		return Decision{Reason: ReasonNever}
	case req != nil && req.N > 1 && !d.paired:
		return Decision{Reason: ReasonMultipleN}
	case req != nil && req.Prompts > 1 && !d.paired:
		return Decision{Reason: ReasonBatch}
	case d.cfg.Mode == config.PDAuto && d.cfg.MinPromptTokens > 0 && req.PromptTokens(d.cfg.CharsPerToken) < d.cfg.MinPromptTokens:
		return Decision{Reason: ReasonShortPrompt}
	case !prefill.Ready():
		return Decision{Reason: ReasonNoPrefill}
	case d.cfg.Mode == config.PDAlways:
		return Decision{PD: true, Reason: ReasonAlways}
	}
	return Decision{PD: true, Reason: ReasonLongPrompt}
}
