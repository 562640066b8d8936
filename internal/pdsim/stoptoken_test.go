package pdsim

import (
	"strings"
	"testing"
)

// With Config.StopOneToken a prefill's one-token answer ends on a stop
// token unless the request forbids one (min_tokens, ignore_eos; vLLM's
// Messages request has neither), and a NIXL prefill then gives no
// kv_transfer_params, as NixlConnector's single-file releases.
func TestAOneTokenAnswerThatStops(t *testing.T) {
	const kv = `,"kv_transfer_params":` + nixlAsk
	tests := []struct {
		name, path, body string
		stops            bool
		says             string // in the answer: its finish
	}{
		{"chat", "/v1/chat/completions", chat("a b", `,"max_tokens":1`+kv), true, `"finish_reason":"stop"`},
		{"chat with min_tokens", "/v1/chat/completions", chat("a b", `,"max_tokens":1,"min_tokens":1`+kv), false, `"finish_reason":"length"`},
		{"chat with ignore_eos", "/v1/chat/completions", chat("a b", `,"max_tokens":1,"ignore_eos":true`+kv), false, `"finish_reason":"length"`},
		{"completions with min_tokens", "/v1/completions", `{"prompt":"a b","max_tokens":1,"min_tokens":1` + kv + `}`, false, `"finish_reason":"length"`},
		{"responses", "/v1/responses", `{"input":"a b","max_output_tokens":1` + kv + `}`, true, `"status":"completed"`},
		{"responses with ignore_eos", "/v1/responses", `{"input":"a b","max_output_tokens":1,"ignore_eos":true` + kv + `}`, false, `"status":"incomplete"`},
		{"messages, whatever it sets", "/v1/messages", chat("a b", `,"max_tokens":1,"min_tokens":1,"ignore_eos":true`+kv), true, `"stop_reason":"end_turn"`},
		{"generate with min_tokens", "/inference/v1/generate", `{"token_ids":[1,2],"sampling_params":{"max_tokens":1,"min_tokens":1,"extra_args":{"kv_transfer_params":` + nixlAsk + `}}}`, false, `"finish_reason":"length"`},
		{"a longer answer", "/v1/chat/completions", chat("a b", `,"max_tokens":2`+kv), false, `"finish_reason":"length"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := start(t, Config{Role: RolePrefill, StopOneToken: true})
			r := post(t, p, tt.path, tt.body, "")
			params := !strings.Contains(string(r.body), `"kv_transfer_params":null`) && strings.Contains(string(r.body), `"kv_transfer_params":{`)
			if r.status != 200 || !strings.Contains(string(r.body), tt.says) || params == tt.stops {
				t.Errorf("%d %s: want %s and params %v", r.status, r.body, tt.says, !tt.stops)
			}
		})
	}
	t.Run("off, or at a decode", func(t *testing.T) {
		for _, cfg := range []Config{{Role: RolePrefill}, {Role: RoleDecode, StopOneToken: true}} {
			s := start(t, cfg)
			if r := post(t, s, "/v1/chat/completions", chat("a b", `,"max_tokens":1`), ""); !strings.Contains(string(r.body), `"finish_reason":"length"`) {
				t.Errorf("%s: %s, want the answer cut by its length", cfg.Role, r.body)
			}
		}
	})
}
