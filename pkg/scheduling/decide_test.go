package scheduling

import (
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

func TestDecide(t *testing.T) {
	long := `{"model":"m","prompt":"` + strings.Repeat("x", 400) + `"}` // 100 tokens at 4 characters each
	tests := []struct {
		name        string
		pd          config.PD
		paired      bool // SGLang engines
		body        string
		alone       metrics.Reason // the API's reason to go decode-only
		prefillDown bool
		want        Split
	}{
		{name: "defaults: everything is P/D", body: `{"model":"m","prompt":"hi"}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "at the threshold", pd: config.PD{MinPromptTokens: 100}, body: long, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "below the threshold", pd: config.PD{MinPromptTokens: 101}, body: long, want: Split{Reason: metrics.ReasonShortPrompt}},
		{name: "another characters-per-token ratio", pd: config.PD{MinPromptTokens: 101, CharsPerToken: 2}, body: long, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "token ids count exactly", pd: config.PD{MinPromptTokens: 3}, body: `{"model":"m","prompt":[1,2,3]}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "too few token ids", pd: config.PD{MinPromptTokens: 4}, body: `{"model":"m","prompt_token_ids":[1,2,3]}`, want: Split{Reason: metrics.ReasonShortPrompt}},
		{name: "always ignores the threshold", pd: config.PD{Mode: config.PDAlways, MinPromptTokens: 1000}, body: long, want: Split{PD: true, Reason: metrics.ReasonAlways}},
		{name: "never", pd: config.PD{Mode: config.PDNever}, body: long, want: Split{Reason: metrics.ReasonNever}},
		{name: "n > 1 is decode-only even when always", pd: config.PD{Mode: config.PDAlways}, body: `{"model":"m","n":2,"prompt":"hi"}`, want: Split{Reason: metrics.ReasonNGT1}},
		{name: "n = 1 is fine", body: `{"model":"m","n":1,"prompt":"hi"}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "a batch is decode-only", body: `{"model":"m","prompt":["a","b"]}`, want: Split{Reason: metrics.ReasonBatch}},
		{name: "no healthy prefill", body: long, prefillDown: true, want: Split{Reason: metrics.ReasonNoPrefill}},
		{name: "no healthy prefill when always", pd: config.PD{Mode: config.PDAlways}, body: long, prefillDown: true, want: Split{Reason: metrics.ReasonNoPrefill}},
		{name: "paired engines hand off n > 1 themselves", paired: true, body: `{"model":"m","n":2,"prompt":"hi"}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "paired engines hand off a batch", paired: true, body: `{"model":"m","prompt":["a","b"]}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "paired engines without a prefill", paired: true, body: long, prefillDown: true, want: Split{Reason: metrics.ReasonNoPrefill}},
		{name: "the API's reason comes first", pd: config.PD{Mode: config.PDAlways}, alone: metrics.ReasonPassthrough, body: long, prefillDown: true, want: Split{Reason: metrics.ReasonPassthrough}},
		{name: "a short prompt says so even with prefill down", pd: config.PD{MinPromptTokens: 1000}, body: long, prefillDown: true, want: Split{Reason: metrics.ReasonShortPrompt}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			obj, err := body.Parse([]byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			prefill := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"10.0.0.1:8000"}}}, Deps{}).Prefill
			if tt.prefillDown {
				for range 3 {
					prefill.Endpoints()[0].ReportFailure()
				}
			}
			req := NewRequest(completions(obj))
			req.Alone = tt.alone
			if got := newDecider(Spec{PD: tt.pd, Paired: tt.paired}).Decide(req, prefill); got != tt.want {
				t.Fatalf("Decide() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestDecideWithoutPrefillPool(t *testing.T) {
	if got := newDecider(Spec{}).Decide(nil, nil); got.PD || got.Reason != metrics.ReasonNoPrefill {
		t.Fatalf("Decide(nil, nil) = %+v, want decode-only for lack of prefill", got)
	}
	empty := NewPools(Spec{}, Deps{}).Prefill
	if got := newDecider(Spec{}).Decide(promptRequest("hi"), empty); got.Reason != metrics.ReasonNoPrefill {
		t.Fatalf("Decide() with an empty prefill pool = %+v", got)
	}
}
