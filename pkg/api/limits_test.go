package api

import "testing"

// TestAloneReadsFieldsAsTheEngine checks the reason a request goes to a
// decode engine alone, with fields spelt as vLLM's pydantic models read
// them in lax mode.
func TestAloneReadsFieldsAsTheEngine(t *testing.T) {
	const chat = `{"model":"m","messages":[{"role":"user","content":"hi"}]`
	tests := []struct {
		name string
		api  *API
		body string
		want Reason
	}{
		{name: "chat truncate_prompt_tokens -1", api: Chat, body: chat + `,"truncate_prompt_tokens":-1}`, want: Truncation},
		{name: "chat truncate_prompt_tokens \"-1\", which pydantic reads as -1", api: Chat,
			body: chat + `,"truncate_prompt_tokens":"-1"}`, want: Truncation},
		{name: "chat truncate_prompt_tokens -1.0, which pydantic reads as -1", api: Chat,
			body: chat + `,"truncate_prompt_tokens":-1.0}`, want: Truncation},
		{name: "completions truncate_prompt_tokens \" -1 \"", api: Completions,
			body: `{"model":"m","prompt":"hi","truncate_prompt_tokens":" -1 "}`, want: Truncation},
		{name: "chat truncate_prompt_tokens 8.0 keeps its pair", api: Chat, body: chat + `,"truncate_prompt_tokens":8.0}`, want: NoReason},
		{name: "chat truncate_prompt_tokens null keeps its pair", api: Chat, body: chat + `,"truncate_prompt_tokens":null}`, want: NoReason},
		// The prefill leg's caps delete stream_options: one the decode
		// engine's StreamOptions model refuses must not cost a prefill.
		{name: "chat stream_options not an object", api: Chat, body: chat + `,"stream":true,"stream_options":5}`, want: InvalidLimits},
		{name: "chat stream_options [] without stream", api: Chat, body: chat + `,"stream_options":[]}`, want: InvalidLimits},
		{name: "chat stream_options false", api: Chat, body: chat + `,"stream_options":false}`, want: InvalidLimits},
		{name: "chat stream_options include_usage not a bool", api: Chat,
			body: chat + `,"stream":true,"stream_options":{"include_usage":"maybe"}}`, want: InvalidLimits},
		{name: "completions stream_options continuous_usage_stats not a bool", api: Completions,
			body: `{"model":"m","prompt":"hi","stream":true,"stream_options":{"continuous_usage_stats":[]}}`, want: InvalidLimits},
		{name: "generate stream_options a string", api: Generate,
			body: `{"token_ids":[1],"sampling_params":{},"stream":true,"stream_options":"{}"}`, want: InvalidLimits},
		{name: "chat stream_options valid, as pydantic reads it", api: Chat,
			body: chat + `,"stream":true,"stream_options":{"include_usage":"yes","continuous_usage_stats":null,"other":1}}`, want: NoReason},
		{name: "chat stream_options null", api: Chat, body: chat + `,"stream_options":null}`, want: NoReason},
		// The Responses caps set store and background false.
		{name: "responses store not a bool", api: Responses, body: `{"input":"hi","store":"maybe"}`, want: InvalidLimits},
		{name: "responses background not a bool", api: Responses, body: `{"input":"hi","background":[]}`, want: InvalidLimits},
		{name: "responses background \"maybe\"", api: Responses, body: `{"input":"hi","background":"maybe"}`, want: InvalidLimits},
		{name: "responses store and background as pydantic reads bools", api: Responses,
			body: `{"input":"hi","store":"off","background":0}`, want: NoReason},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.api.Alone(parsed(t, tt.body)); got != tt.want {
				t.Errorf("%s.Alone(%s) = %v, want %v", tt.api.Name, tt.body, got, tt.want)
			}
		})
	}
}

// TestContextLimit reads the output limit vLLM checks, with the prompt,
// against the model's context length before it runs a request, and the key
// that gave it.
func TestContextLimit(t *testing.T) {
	const chat = `{"model":"m","messages":[{"role":"user","content":"hi"}]`
	tests := []struct {
		name, body string
		api        *API
		wantKey    string
		wantN      int64
		wantOK     bool
	}{
		{name: "chat max_tokens", api: Chat, body: chat + `,"max_tokens":4096}`, wantKey: "max_tokens", wantN: 4096, wantOK: true},
		{name: "chat prefers max_completion_tokens", api: Chat, body: chat + `,"max_tokens":8,"max_completion_tokens":4096}`,
			wantKey: "max_completion_tokens", wantN: 4096, wantOK: true},
		{name: "chat max_completion_tokens null: max_tokens", api: Chat, body: chat + `,"max_completion_tokens":null,"max_tokens":9}`,
			wantKey: "max_tokens", wantN: 9, wantOK: true},
		{name: "chat none given: 0", api: Chat, body: chat + `}`, wantOK: true},
		{name: "chat max_tokens not an integer", api: Chat, body: chat + `,"max_tokens":"many"}`, wantKey: "max_tokens"},
		{name: "completions max_tokens \"300\", as pydantic reads it", api: Completions, body: `{"prompt":"hi","max_tokens":"300"}`,
			wantKey: "max_tokens", wantN: 300, wantOK: true},
		{name: "completions none given: 16", api: Completions, body: `{"prompt":"hi"}`, wantKey: "max_tokens", wantN: 16, wantOK: true},
		{name: "completions null: 16", api: Completions, body: `{"prompt":"hi","max_tokens":null}`, wantKey: "max_tokens", wantN: 16, wantOK: true},
		{name: "messages max_tokens", api: Messages, body: `{"model":"m","max_tokens":70000,"messages":[]}`, wantKey: "max_tokens", wantN: 70000, wantOK: true},
		{name: "responses max_output_tokens", api: Responses, body: `{"input":"hi","max_output_tokens":70000}`,
			wantKey: "max_output_tokens", wantN: 70000, wantOK: true},
		{name: "responses none given: 0", api: Responses, body: `{"input":"hi","max_output_tokens":null}`, wantOK: true},
		{name: "generate: the engine stops at the context", api: Generate, body: `{"token_ids":[1],"sampling_params":{"max_tokens":70000}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			key, n, ok := tt.api.ContextLimit(parsed(t, tt.body))
			if key != tt.wantKey || n != tt.wantN || ok != tt.wantOK {
				t.Errorf("ContextLimit = %q, %d, %v; want %q, %d, %v", key, n, ok, tt.wantKey, tt.wantN, tt.wantOK)
			}
		})
	}
}
