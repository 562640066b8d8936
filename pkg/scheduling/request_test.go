package scheduling

import (
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

func TestNewRequest(t *testing.T) {
	tests := []struct {
		name        string
		body        string
		wantPrompt  string
		wantTokens  int // at 4 characters per token
		wantN       int
		wantPrompts int
	}{
		{name: "chat: role and content in order",
			body:       `{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}`,
			wantPrompt: "system\nBe brief.\nuser\nHi\n", wantTokens: 7, wantN: 1, wantPrompts: 1},
		{name: "chat: text parts joined, other parts as JSON",
			body:       `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"What is"},{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":" this?"}]}]}`,
			wantPrompt: "user\nWhat is{\"type\":\"image_url\",\"image_url\":{\"url\":\"u\"}} this?\n", wantTokens: 16, wantN: 1, wantPrompts: 1},
		{name: "chat: tools first, tool calls kept, escapes decoded",
			body:       `{"model":"m","tools":[{"type":"function"}],"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"user","content":"a\"b"}]}`,
			wantPrompt: "[{\"type\":\"function\"}]\nassistant\n[{\"id\":\"1\"}]\nuser\na\"b\n", wantTokens: 14, wantN: 1, wantPrompts: 1},
		{name: "chat: n", body: `{"model":"m","n":3,"messages":[{"role":"user","content":"Hi"}]}`,
			wantPrompt: "user\nHi\n", wantTokens: 2, wantN: 3, wantPrompts: 1},
		{name: "completions: string", body: `{"model":"m","prompt":"Once upon a time"}`,
			wantPrompt: "Once upon a time", wantTokens: 4, wantN: 1, wantPrompts: 1},
		{name: "completions: token ids count exactly", body: `{"model":"m","prompt":[1, 22, 333]}`,
			wantPrompt: "1,22,333", wantTokens: 3, wantN: 1, wantPrompts: 1},
		{name: "completions: batch of strings", body: `{"model":"m","prompt":["first prompt","second"]}`,
			wantPrompt: "first prompt", wantTokens: 3, wantN: 1, wantPrompts: 2},
		{name: "completions: batch of token ids", body: `{"model":"m","prompt":[[1,2],[3]]}`,
			wantPrompt: "1,2", wantTokens: 2, wantN: 1, wantPrompts: 2},
		{name: "prompt_token_ids", body: `{"model":"m","prompt_token_ids":[5,6,7,8,9]}`,
			wantPrompt: "5,6,7,8,9", wantTokens: 5, wantN: 1, wantPrompts: 1},
		{name: "characters, not bytes, make tokens", body: `{"model":"m","prompt":"héllo wörld ünïcode"}`,
			wantPrompt: "héllo wörld ünïcode", wantTokens: 5, wantN: 1, wantPrompts: 1},
		{name: "no prompt at all", body: `{"model":"m"}`, wantN: 1, wantPrompts: 1},
		{name: "messages of the wrong shape", body: `{"model":"m","messages":"hi"}`, wantN: 1, wantPrompts: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			obj, err := body.Parse([]byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			r := NewRequest(obj)
			if r.Prompt() != tt.wantPrompt {
				t.Errorf("Prompt() = %q, want %q", r.Prompt(), tt.wantPrompt)
			}
			if got := r.PromptTokens(4); got != tt.wantTokens {
				t.Errorf("PromptTokens(4) = %d, want %d", got, tt.wantTokens)
			}
			if r.N != tt.wantN || r.Prompts != tt.wantPrompts {
				t.Errorf("N, Prompts = %d, %d; want %d, %d", r.N, r.Prompts, tt.wantN, tt.wantPrompts)
			}
		})
	}
}

func TestNilRequestHasNothingToGoBy(t *testing.T) {
	var r *Request
	if r.Prompt() != "" || r.PromptTokens(4) != 0 {
		t.Fatal("a nil request has a prompt")
	}
}
