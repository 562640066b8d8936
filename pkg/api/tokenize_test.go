package api

import (
	"slices"
	"testing"
)

// TestTokenizeAsksForWhatTheEngineComputes: a chat request's /tokenize body
// keeps the fields that change its rendering and nothing else; token ids in
// the body are taken as they are; a batch has no one prompt.
func TestTokenizeAsksForWhatTheEngineComputes(t *testing.T) {
	tests := []struct {
		name, body string
		api        *API
		ids        []int64
		ask        string
	}{
		{"chat", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true,"tools":[],"chat_template_kwargs":{"enable_thinking":false}}`,
			Chat, nil, `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[],"chat_template_kwargs":{"enable_thinking":false}}`},
		{"chat with prompt_token_ids", `{"model":"m","messages":[],"prompt_token_ids":[1,2,3]}`, Chat, []int64{1, 2, 3}, ""},
		{"a completions string", `{"model":"m","prompt":"hello","max_tokens":1,"add_special_tokens":false}`, Completions, nil,
			`{"model":"m","prompt":"hello","add_special_tokens":false}`},
		{"completions token ids", `{"model":"m","prompt":[5,6]}`, Completions, []int64{5, 6}, ""},
		{"a completions batch", `{"model":"m","prompt":["a","b"]}`, Completions, nil, ""},
		{"token-in generate", `{"token_ids":[7,8,9],"sampling_params":{}}`, Generate, []int64{7, 8, 9}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := tt.api.Tokenize(parsed(t, tt.body))
			if !slices.Equal(got.IDs, tt.ids) || string(got.Ask) != tt.ask {
				t.Errorf("Tokenize = %v, %s; want %v, %s", got.IDs, got.Ask, tt.ids, tt.ask)
			}
		})
	}
	for _, a := range []*API{Responses, Messages, SGLangGenerate} {
		if a.Tokenize != nil {
			t.Errorf("%s has a Tokenize, but no /tokenize form of vLLM's", a.Name)
		}
	}
}
