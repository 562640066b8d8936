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
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.api.Alone(parsed(t, tt.body)); got != tt.want {
				t.Errorf("%s.Alone(%s) = %v, want %v", tt.api.Name, tt.body, got, tt.want)
			}
		})
	}
}
