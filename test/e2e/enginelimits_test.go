package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// With engines that list their context (max_model_len) at GET /v1/models, a
// request whose output limit fills it is refused before any prefill leg (a
// Responses request goes to the decode engine alone, which refuses it); one
// whose prompt and limit just fit runs P/D. One between the two, whose
// prompt and limit together pass the context, costs a prefill leg before the
// decode engine refuses it, as vLLM would, unless pd-extproc asked an engine
// for the prompt's tokens (kv_events): the render endpoint refuses it (and
// one whose limit fills the context) as the request's own endpoint will, and
// /tokenize counts it; it then goes to the decode engine alone, which
// answers its 400. Messages has neither, nor has Responses a /tokenize form.
func TestOutputLimitsAgainstTheEnginesContext(t *testing.T) {
	const length = 64
	events := []string{"stale_after: 1m"}
	affinity := "policy: prefix-affinity"
	for _, v := range []struct {
		name     string
		rig      rigOptions
		over     map[string]int // prefill legs of a request one token over, by API
		rendered bool           // the render endpoint answers for chat, completions and responses
	}{
		{"estimates", rigOptions{}, map[string]int{"chat": 1, "completions": 1, "messages": 1, "responses": 1}, false},
		{"render", rigOptions{kvEvents: events, prefillPool: affinity, decodePool: affinity},
			map[string]int{"chat": 0, "completions": 0, "messages": 1, "responses": 0}, true},
		{"tokenize", rigOptions{kvEvents: events, prefillPool: affinity, decodePool: affinity, noRender: true},
			map[string]int{"chat": 0, "completions": 0, "messages": 1, "responses": 1}, false},
	} {
		t.Run(v.name, func(t *testing.T) {
			o := v.rig
			o.prefills, o.decodes, o.maxModelLen = 1, 1, length
			r := startRig(t, o)
			if o.kvEvents != nil {
				subscribed(t, append(r.prefill, r.decode...), 1)
			}
			for _, api := range []string{"chat", "completions", "messages", "responses"} {
				t.Run(api, func(t *testing.T) {
					checkContextLimits(t, r, api, length, v.over[api], v.rendered && api != "messages")
				})
			}
		})
	}
}

// checkContextLimits sends api's requests whose prompt and limit fill a
// context of length, pass it by one token (costing overPrefills prefill
// legs), and whose limit alone fills it (which the render endpoint refuses
// where rendered, for the decode engine alone to answer).
func checkContextLimits(t *testing.T, r *rig, api string, length, overPrefills int, rendered bool) {
	// Markers of one word count: every case's prompt has as many tokens.
	prompt := promptTokens(t, r, api, "context warm "+api)
	tests := []struct {
		name       string
		limit      int
		status     int
		prefills   int    // prefill legs the request cost
		says, kind string // in the error, and its type
	}{
		{"prompt and limit fill it", length - prompt, 200, 1, "", ""},
		{"one token over", length - prompt + 1, 400, overPrefills, "You passed", "BadRequestError"},
		{"the limit fills it", length, 400, 0, "leaves no room for the prompt", "BadRequestError"},
	}
	for i, tt := range tests {
		marker := fmt.Sprintf("context case%d %s", i, api)
		path, body := request(api, false, marker)
		body = strings.Replace(body, `tokens":4}`, fmt.Sprintf(`tokens":%d}`, tt.limit), 1)
		resp, got := r.must(t, path, body, nil)
		says, kind := tt.says, tt.kind
		switch {
		case api == "messages" && tt.limit == length:
			kind = "invalid_request_error" // pd-extproc's Anthropic error
		case (api == "responses" || rendered) && tt.status == 400:
			says = "You passed" // the decode engine's, alone or after the prefill leg
		}
		switch {
		case resp.StatusCode != tt.status:
			t.Errorf("%s: status %d, want %d: %s", tt.name, resp.StatusCode, tt.status, excerpt(got))
		case tt.status == 200 && resp.Header.Get("x-pdsim-kv") != "hit":
			t.Errorf("%s: KV %q, want a P/D hit", tt.name, resp.Header.Get("x-pdsim-kv"))
		case tt.status != 200 && (!strings.Contains(got, says) || !strings.Contains(got, `"type":"`+kind+`"`)):
			t.Errorf("%s: %s, want %q of type %s", tt.name, got, says, kind)
		}
		if legs := sum(legsOn(r.prefill, marker)); legs != tt.prefills {
			t.Errorf("%s: %d prefill legs, want %d", tt.name, legs, tt.prefills)
		}
		if decode := len(recordsWith(r.decode, marker)); api == "responses" && decode != 1 {
			t.Errorf("%s: %d decode legs, want 1", tt.name, decode)
		}
	}
}

// promptTokens is how many tokens the engines count in the prompt of
// request(api, false, marker), read from the usage of its answer.
func promptTokens(t *testing.T, r *rig, api, marker string) int {
	t.Helper()
	path, body := request(api, false, marker)
	resp, got := r.must(t, path, body, nil)
	var a struct {
		Usage struct {
			Prompt int `json:"prompt_tokens"`
			Input  int `json:"input_tokens"` // Anthropic's
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(got), &a); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	return max(a.Usage.Prompt, a.Usage.Input)
}

// Against prefill engines whose one token may be a stop token, after which
// an older NixlConnector hands out no kv_transfer_params, chat and Responses
// legs still get their params (they carry min_tokens, ignore_eos), while a
// Messages leg, which can carry neither, is a failed prefill that falls back
// to decode-only (prefill.on_failure's default): the client still gets its
// answer, and the failure is counted and logged as a stop token's.
func TestAPrefillWhoseOneTokenMayStop(t *testing.T) {
	r := startRig(t, rigOptions{prefills: 1, decodes: 1, stopOneToken: true})
	failed := 0
	for _, api := range []string{"chat", "responses", "messages"} {
		for _, stream := range []bool{false, true} {
			marker := fmt.Sprintf("stop token %s %v", api, stream)
			path, body := request(api, stream, marker)
			resp, got := r.must(t, path, body, nil)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%s: status %d: %s", marker, resp.StatusCode, excerpt(got))
			}
			checkAnswer(t, api, stream, got)
			p, d := recordsWith(r.prefill, marker), recordsWith(r.decode, marker)
			wantPrefill, wantDecode := "issued", "hit"
			if api == "messages" {
				wantPrefill, wantDecode = "none", "none"
				failed++
			}
			if len(p) != 1 || p[0].KV != wantPrefill {
				t.Errorf("%s: prefill legs' KV %v, want one, %s", marker, outcomes(p), wantPrefill)
			}
			if len(d) != 1 || d[0].KV != wantDecode || resp.Header.Get("x-pdsim-kv") != wantDecode {
				t.Errorf("%s: decode legs' KV %v (header %q), want one, %s", marker, outcomes(d), resp.Header.Get("x-pdsim-kv"), wantDecode)
			}
		}
	}
	for _, series := range []string{`pd_extproc_prefill_failures_total{reason="no_kv_params"}`, `pd_extproc_pd_decisions_total{reason="prefill_failed"}`} {
		if n := r.metric(t, series); n != float64(failed) {
			t.Errorf("%s = %v, want %d", series, n, failed)
		}
	}
	r.extproc.waitLog(t, "its one token was a stop token (stop_reason end_turn)")
}

// outcomes is the KV outcome of each record.
func outcomes(recs []pdsim.Record) []string {
	out := make([]string, len(recs))
	for i, rec := range recs {
		out[i] = rec.KV
	}
	return out
}
