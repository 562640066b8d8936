package api

import (
	"slices"
	"testing"
)

// TestTokenizeAsksForWhatTheEngineComputes: a chat or completions request is
// rendered by its API's render endpoint, and its /tokenize body keeps the
// fields that change its rendering and nothing else; token ids in the body
// are taken as they are unless the request cuts them to its last
// (truncate_prompt_tokens), which only the render endpoint answers; a batch
// has no one prompt, and one with a cache_salt the engine refuses is not
// looked up.
func TestTokenizeAsksForWhatTheEngineComputes(t *testing.T) {
	tests := []struct {
		name, body string
		api        *API
		ids        []int64
		render     string
		ask        string
	}{
		{"chat", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true,"tools":[],"chat_template_kwargs":{"enable_thinking":false}}`,
			Chat, nil, ChatRenderPath, `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[],"chat_template_kwargs":{"enable_thinking":false}}`},
		{"chat with prompt_token_ids, which vLLM ignores", `{"model":"m","messages":[{"role":"user","content":"hi"}],"prompt_token_ids":[1,2,3]}`,
			Chat, nil, ChatRenderPath, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`},
		{"salted chat", `{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":"tenant-1"}`, Chat, nil, ChatRenderPath,
			`{"model":"m","messages":[{"role":"user","content":"hi"}]}`},
		{"chat with a cache_salt the engine refuses", `{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":""}`, Chat, nil, "", ""},
		{"chat with documents and reasoning_effort: template kwargs, as the endpoint merges them",
			`{"model":"m","messages":[],"documents":[{"text":"d"}],"reasoning_effort":"high","chat_template_kwargs":{"x":1,"documents":[]}}`, Chat, nil, ChatRenderPath,
			`{"model":"m","messages":[],"chat_template_kwargs":{"documents":[{"text":"d"}],"enable_thinking":true,"reasoning_effort":"high","x":1}}`},
		{"chat with reasoning_effort none and enable_thinking set",
			`{"model":"m","messages":[],"reasoning_effort":"none","chat_template_kwargs":{"enable_thinking":true}}`, Chat, nil, ChatRenderPath,
			`{"model":"m","messages":[],"chat_template_kwargs":{"enable_thinking":true,"reasoning_effort":"none"}}`},
		{"chat with reasoning_effort none", `{"model":"m","messages":[],"reasoning_effort":"none"}`, Chat, nil, ChatRenderPath,
			`{"model":"m","messages":[],"chat_template_kwargs":{"enable_thinking":false,"reasoning_effort":"none"}}`},
		{"a completions string", `{"model":"m","prompt":"hello","max_tokens":1,"add_special_tokens":false}`, Completions, nil,
			CompletionsRenderPath, `{"model":"m","prompt":"hello","add_special_tokens":false}`},
		{"completions token ids", `{"model":"m","prompt":[5,6]}`, Completions, []int64{5, 6}, "", ""},
		{"salted completions token ids", `{"model":"m","prompt":[5,6],"cache_salt":"s"}`, Completions, []int64{5, 6}, "", ""},
		{"completions with a cache_salt the engine refuses", `{"model":"m","prompt":[5,6],"cache_salt":7}`, Completions, nil, "", ""},
		{"a completions batch", `{"model":"m","prompt":["a","b"]}`, Completions, nil, "", ""},
		{"token-in generate", `{"token_ids":[7,8,9],"sampling_params":{}}`, Generate, []int64{7, 8, 9}, "", ""},
		{"salted token-in generate", `{"token_ids":[7,8,9],"sampling_params":{},"cache_salt":"s"}`, Generate, []int64{7, 8, 9}, "", ""},
		{"chat cut to its last tokens: rendered only, as /tokenize cannot cut", `{"model":"m","messages":[{"role":"user","content":"hi"}],"truncate_prompt_tokens":8}`,
			Chat, nil, ChatRenderPath, ""},
		{"a completions string cut to its last tokens", `{"model":"m","prompt":"hello","truncate_prompt_tokens":8}`, Completions, nil, CompletionsRenderPath, ""},
		{"completions token ids cut to their last: not the body's", `{"model":"m","prompt":[5,6,7],"truncate_prompt_tokens":2}`, Completions, nil, "", ""},
		{"completions token ids, truncate_prompt_tokens null", `{"model":"m","prompt":[5,6,7],"truncate_prompt_tokens":null}`, Completions, []int64{5, 6, 7}, "", ""},
		{"token-in generate cut by its sampling params", `{"token_ids":[7,8,9],"sampling_params":{"truncate_prompt_tokens":2}}`, Generate, nil, "", ""},
		{"responses: rendered only", `{"model":"m","input":"hi"}`, Responses, nil, ResponsesRenderPath, ""},
		{"responses continuing a stored response, which no render endpoint renders", `{"model":"m","input":"hi","previous_response_id":"resp_1"}`,
			Responses, nil, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := tt.api.TokensOf(parsed(t, tt.body))
			if !slices.Equal(got.IDs, tt.ids) || got.RenderPath != tt.render || string(got.Ask) != tt.ask {
				t.Errorf("Tokenize = %v, %q, %s; want %v, %q, %s", got.IDs, got.RenderPath, got.Ask, tt.ids, tt.render, tt.ask)
			}
		})
	}
	for _, a := range []*API{Messages, SGLangGenerate} {
		if a.Tokenize != nil {
			t.Errorf("%s has a Tokenize, but no /tokenize or render form of vLLM's", a.Name)
		}
	}
}
