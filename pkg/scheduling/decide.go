package scheduling

import "github.com/pd-extproc/pd-extproc/pkg/config"

// Why a request went P/D or decode-only. The set is closed, so that it can
// label a metric (pd_decisions_total{reason}).
const (
	ReasonAlways      = "always"       // pd.mode: always
	ReasonLongPrompt  = "long_prompt"  // auto, prompt at or above pd.min_prompt_tokens
	ReasonNever       = "never"        // pd.mode: never
	ReasonShortPrompt = "short_prompt" // auto, prompt below pd.min_prompt_tokens
	ReasonMultipleN   = "n_gt_1"       // several choices: engines cannot hand off n > 1
	ReasonBatch       = "batch"        // several prompts in one completions request
	ReasonNoPrefill   = "no_prefill"   // no healthy prefill endpoint
)

// Reasons lists every reason Decide can give.
var Reasons = []string{ReasonAlways, ReasonLongPrompt, ReasonNever, ReasonShortPrompt, ReasonMultipleN, ReasonBatch, ReasonNoPrefill}

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

// NewDecider returns a decider for cfg (defaults filled in).
func NewDecider(cfg config.PD) *Decider {
	cfg.SetDefaults()
	return &Decider{cfg: cfg}
}

func newDecider(spec Spec) *Decider {
	d := NewDecider(spec.PD)
	d.paired = spec.Paired
	return d
}

// Decide returns the decision for req given the prefill pool. Requests the
// engines cannot disaggregate go decode-only whatever the mode. For paired
// engines the only decode-only reason left is no_prefill (config refuses
// never and min_prompt_tokens for them); the caller must then refuse.
func (d *Decider) Decide(req *Request, prefill *Pool) Decision {
	switch {
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
