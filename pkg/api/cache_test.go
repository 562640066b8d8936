package api

import (
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// TestPromptCache: the model a request names (SGLang's native API, its
// lora_path) and its cache_salt, what the engine keys its cached blocks with
// besides their text: a LoRA adapter's and a salted prompt's blocks are
// their own. The body's "model" alone says which engines serve it.
func TestPromptCache(t *testing.T) {
	for _, tt := range []struct {
		name, body string
		api        *API
		want       kvevents.Keys
	}{
		{"a chat request", `{"model":"m","messages":[]}`, Chat, kvevents.Keys{Model: "m"}},
		{"an adapter's, salted", `{"model":"sql-lora","messages":[],"cache_salt":"t1"}`, Chat, kvevents.Keys{Model: "sql-lora", Salt: "t1"}},
		{"a null cache_salt is none", `{"model":"m","prompt":"hi","cache_salt":null}`, Completions, kvevents.Keys{Model: "m"}},
		{"token-in generate, salted", `{"token_ids":[7],"cache_salt":"s"}`, Generate, kvevents.Keys{Salt: "s"}},
		{"Anthropic's Messages: vLLM drops its cache_salt", `{"model":"m","messages":[],"cache_salt":"t1"}`, Messages, kvevents.Keys{Model: "m"}},
		{"SGLang's adapter", `{"text":"x","lora_path":"sql-lora"}`, SGLangGenerate, kvevents.Keys{Model: "sql-lora"}},
		{"SGLang's adapter beside the base model", `{"model":"base","lora_path":"sql-lora","messages":[]}`, Chat, kvevents.Keys{Model: "sql-lora"}},
		{"a batch's adapters, all one", `{"text":["x","y"],"lora_path":["sql-lora","sql-lora"]}`, SGLangGenerate, kvevents.Keys{Model: "sql-lora"}},
		{"a batch's adapters, not one", `{"model":"base","text":["x","y"],"lora_path":["a1","a2"]}`, SGLangGenerate, kvevents.Keys{Model: "base"}},
		{"an empty lora_path", `{"model":"base","messages":[],"lora_path":""}`, Chat, kvevents.Keys{Model: "base"}},
		{"none", `{"text":"x"}`, SGLangGenerate, kvevents.Keys{}},
	} {
		p := tt.api.PromptOf(parsed(t, tt.body), VLLM)
		if p.Cache != tt.want {
			t.Errorf("%s: cache %+v, want %+v", tt.name, p.Cache, tt.want)
		}
		if want := parsedString(t, tt.body, "model"); p.Model != want {
			t.Errorf("%s: model %q, want the body's %q", tt.name, p.Model, want)
		}
	}
}

// parsedString is body's string field, "" when it has none.
func parsedString(t *testing.T, body, field string) string {
	s, _ := parsed(t, body).String(field)
	return s
}
