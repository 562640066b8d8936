package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// With engines that list their context (max_model_len) at GET /v1/models, a
// request whose output limit fills it is refused before any prefill leg; one
// whose prompt and limit just fit runs P/D; one between the two costs a
// prefill leg before the decode engine refuses it, as vLLM would, since
// pd-extproc does not count the prompt's tokens.
func TestOutputLimitsAgainstTheEnginesContext(t *testing.T) {
	const length = 64
	r := startRig(t, rigOptions{prefills: 1, decodes: 1, maxModelLen: length})
	for _, api := range []string{"chat", "completions", "messages"} {
		t.Run(api, func(t *testing.T) {
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
				{"one token over", length - prompt + 1, 400, 1, "You passed", "BadRequestError"},
				{"the limit fills it", length, 400, 0, "leaves no room for the prompt", "BadRequestError"},
			}
			for i, tt := range tests {
				marker := fmt.Sprintf("context case%d %s", i, api)
				path, body := request(api, false, marker)
				body = strings.Replace(body, `"max_tokens":4`, fmt.Sprintf(`"max_tokens":%d`, tt.limit), 1)
				resp, got := r.must(t, path, body, nil)
				kind := tt.kind
				if api == "messages" && tt.prefills == 0 {
					kind = "invalid_request_error" // pd-extproc's Anthropic error
				}
				switch {
				case resp.StatusCode != tt.status:
					t.Errorf("%s: status %d, want %d: %s", tt.name, resp.StatusCode, tt.status, excerpt(got))
				case tt.status == 200 && resp.Header.Get("x-pdsim-kv") != "hit":
					t.Errorf("%s: KV %q, want a P/D hit", tt.name, resp.Header.Get("x-pdsim-kv"))
				case tt.status != 200 && (!strings.Contains(got, tt.says) || !strings.Contains(got, `"type":"`+kind+`"`)):
					t.Errorf("%s: %s, want %q of type %s", tt.name, got, tt.says, kind)
				}
				if legs := len(recordsWith(r.prefill, marker)); legs != tt.prefills {
					t.Errorf("%s: %d prefill legs, want %d", tt.name, legs, tt.prefills)
				}
			}
		})
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
