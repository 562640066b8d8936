package scheduling

import (
	"fmt"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

func TestRequestReadsItsAPIsPrompt(t *testing.T) {
	tests := []struct {
		name       string
		api        *api.API
		body       string
		wantTokens int // at 4 characters per token
		wantN      int
	}{
		{"characters, rounded up", api.Chat, `{"messages":[{"role":"user","content":"Hi"}]}`, 2, 1}, // "user\nHi\n"
		{"characters, not bytes", api.Completions, `{"prompt":"héllo wörld ünïcode"}`, 5, 1},
		{"token ids count exactly", api.Generate, `{"token_ids":[1,2,3,4,5,6,7,8,9],"sampling_params":{"n":4}}`, 9, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			obj, err := body.Parse([]byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			r := NewRequest(tt.api.Prompt(obj))
			if got := r.PromptTokens(4); got != tt.wantTokens || r.N != tt.wantN {
				t.Errorf("PromptTokens(4), N = %d, %d; want %d, %d", got, r.N, tt.wantTokens, tt.wantN)
			}
		})
	}
}

func TestNilRequestHasNothingToGoBy(t *testing.T) {
	var r *Request
	if r.Prompt() != "" || r.PromptTokens(4) != 0 {
		t.Fatal("a nil request has a prompt")
	}
	if (&Request{N: 1, Prompts: 1}).Prompt() != "" {
		t.Fatal("a request without a prompt has one")
	}
}

// TestTheKeyFollowsTheRenderedPrompt: two requests get the same prefix key
// (namespace and rendered text, which the ranking and the local hint both
// hash) exactly when the engine renders and caches their prompts alike. The
// fields besides the messages that change what vLLM or SGLang renders (a
// request's own chat template, its template kwargs, with the documents and
// reasoning effort merged into them, a message's name) or what their
// caches key blocks with (SGLang's extra_key) set requests apart; the
// JSON's whitespace and key order, which the engines parse away, do not.
func TestTheKeyFollowsTheRenderedPrompt(t *testing.T) {
	const msgs = `"messages":[{"role":"system","content":"S"},{"role":"user","content":"Q"}]`
	chat := func(fields string) string { return `{"model":"m",` + fields + msgs + `}` }
	// routes.messages_decode_only routes the table's copy of the Messages API.
	decodeOnlyMessages, err := api.NewTable(nil, api.Messages).Match("POST", "/v1/messages")
	if err != nil || decodeOnlyMessages == api.Messages {
		t.Fatalf("Match = %p, %v; want the table's copy of the Messages API", decodeOnlyMessages, err)
	}
	tests := []struct {
		name string
		api  *api.API
		a, b string
		same bool
	}{
		{"a request's chat template", api.Chat, chat(``), chat(`"chat_template":"{{ messages }}",`), false},
		{"two chat templates", api.Chat, chat(`"chat_template":"A",`), chat(`"chat_template":"B",`), false},
		{"enable_thinking", api.Chat, chat(``), chat(`"chat_template_kwargs":{"enable_thinking":false},`), false},
		{"gpt-oss's reasoning effort in the kwargs", api.Chat,
			chat(`"chat_template_kwargs":{"reasoning_effort":"low"},`), chat(`"chat_template_kwargs":{"reasoning_effort":"high"},`), false},
		{"reasoning_effort", api.Chat, chat(`"reasoning_effort":"low",`), chat(`"reasoning_effort":"high",`), false},
		{"documents", api.Chat, chat(``), chat(`"documents":[{"title":"a","text":"x"}],`), false},
		{"SGLang's extra_key", api.Chat, chat(``), chat(`"extra_key":"k",`), false},
		{"cache_salt", api.Chat, chat(`"cache_salt":"a",`), chat(`"cache_salt":"b",`), false},
		{"the adapter", api.Chat, chat(`"model":"lora-a",`), chat(`"model":"lora-b",`), false},
		{"a message's name", api.Chat,
			`{"messages":[{"role":"user","name":"alice","content":"Q"}]}`, `{"messages":[{"role":"user","name":"bob","content":"Q"}]}`, false},
		{"the Responses API's reasoning effort", api.Responses,
			`{"input":"Q","reasoning":{"effort":"low"}}`, `{"input":"Q","reasoning":{"effort":"high"}}`, false},
		{"Anthropic's effort, which vLLM reads as reasoning_effort", api.Messages,
			`{"model":"m","messages":[{"role":"user","content":"Q"}],"output_config":{"effort":"low"}}`,
			`{"model":"m","messages":[{"role":"user","content":"Q"}],"output_config":{"effort":"high"}}`, false},
		{"Anthropic's effort under routes.messages_decode_only", decodeOnlyMessages,
			`{"model":"m","messages":[{"role":"user","content":"Q"}],"output_config":{"effort":"low"}}`,
			`{"model":"m","messages":[{"role":"user","content":"Q"}],"output_config":{"effort":"high"}}`, false},
		{"whitespace in the tools", api.Chat,
			chat(`"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],`),
			chat(`"tools": [ {"type": "function", "function": {"name": "f", "parameters": { }}} ],`), true},
		{"whitespace in a tool call", api.Chat,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","content":"4"}]}`,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","tool_calls":[ { "id": "1", "function": { "name": "f", "arguments": "{}" } } ]},{"role":"tool","content":"4"}]}`, true},
		{"whitespace in a Responses item", api.Responses,
			`{"input":[{"role":"user","content":"Q"},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}]}`,
			`{"input":[{"role":"user","content":"Q"},{ "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}" }]}`, true},
		// vLLM and SGLang hand the template each tool as pydantic dumps it:
		// its known fields, in the model's order, whatever the client sent.
		{"a tool's keys in another order", api.Chat,
			chat(`"tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"a":1}}}],`),
			chat(`"tools":[{"function":{"parameters":{"a":1},"description":"d","name":"f"},"type":"function"}],`), true},
		{"a field of a tool that no engine reads", api.Chat,
			chat(`"tools":[{"type":"function","function":{"name":"f"}}],`), chat(`"tools":[{"type":"function","function":{"name":"f","x-origin":"mcp"},"x-origin":"mcp"}],`), true},
		{"an empty list of tools, which the engines render as none", api.Chat, chat(``), chat(`"tools":[],`), true},
		{"a tool without its type, which the engines default", api.Chat,
			chat(`"tools":[{"type":"function","function":{"name":"f"}}],`), chat(`"tools":[{"function":{"name":"f"}}],`), true},
		{"a tool's parameters in another order, which templates write as sent", api.Chat,
			chat(`"tools":[{"type":"function","function":{"name":"f","parameters":{"a":1,"b":2}}}],`),
			chat(`"tools":[{"type":"function","function":{"name":"f","parameters":{"b":2,"a":1}}}],`), false},
		// Both engines parse a tool call's arguments before the template
		// writes them: the string's whitespace never reaches the prompt.
		{"whitespace inside a tool call's arguments", api.Chat,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{\"city\":\"Paris\",\"n\":[1,2]}"}}]},{"role":"tool","content":"4"}]}`,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{\"city\": \"Paris\", \"n\": [1, 2]}"}}]},{"role":"tool","content":"4"}]}`, true},
		{"another argument", api.Chat,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{\"city\":\"Paris\"}"}}]}]}`,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{\"city\":\"Rome\"}"}}]}]}`, false},
		// vLLM hands the template an assistant message's reasoning, SGLang
		// its reasoning_content; Qwen3's template writes it in the turns
		// after the last user message.
		{"an assistant message's reasoning", api.Chat,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","reasoning":"look it up","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","content":"4"}]}`,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","reasoning":"ask","tool_calls":[{"id":"1","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","content":"4"}]}`, false},
		{"an assistant message's reasoning_content", api.Chat,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","content":"A"},{"role":"user","content":"R"}]}`,
			`{"messages":[{"role":"user","content":"Q"},{"role":"assistant","reasoning_content":"think","content":"A"},{"role":"user","content":"R"}]}`, false},
		{"the body's key order", api.Chat, `{"model":"m",` + msgs + `,"stream":true}`, `{"stream":true,` + msgs + `,"model":"m"}`, true},
		{"the kwargs' key order and whitespace", api.Chat,
			chat(`"chat_template_kwargs":{"enable_thinking":false,"x":[1,2]},`), chat(`"chat_template_kwargs": { "x": [1, 2], "enable_thinking": false },`), true},
		{"documents merged into the kwargs, as vLLM does", api.Chat,
			chat(`"documents":[{"title":"a","text":"x"}],`), chat(`"chat_template_kwargs":{"documents":[{"title":"a","text":"x"}]},`), true},
		{"add_generation_prompt: the end of the prompt only", api.Chat, chat(``), chat(`"add_generation_prompt":false,`), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, b := keyOf(t, tt.api, api.VLLM, tt.a), keyOf(t, tt.api, api.VLLM, tt.b)
			if same := a == b; same != tt.same {
				t.Errorf("keyed alike: %v, want %v\n%s\n%s", same, tt.same, a, b)
			}
		})
	}
	// tool_choice: vLLM renders every tool whatever it says (unless started
	// with --exclude-tools-when-tool-choice-none); SGLang none for "none",
	// and only the one a named choice names.
	const tools = `"tools":[{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"g"}}],`
	for _, tt := range []struct {
		name   string
		engine api.Family
		a, b   string
		same   bool
	}{
		{"vLLM: tool_choice none", api.VLLM, chat(tools), chat(tools + `"tool_choice":"none",`), true},
		{"vLLM: a named tool_choice", api.VLLM, chat(tools), chat(tools + `"tool_choice":{"type":"function","function":{"name":"g"}},`), true},
		{"SGLang: tool_choice none renders no tools", api.SGLang, chat(``), chat(tools + `"tool_choice":"none",`), true},
		{"SGLang: a named tool_choice renders that tool", api.SGLang,
			chat(`"tools":[{"type":"function","function":{"name":"g"}}],`), chat(tools + `"tool_choice":{"type":"function","function":{"name":"g"}},`), true},
		{"SGLang: tool_choice auto renders every tool", api.SGLang, chat(tools), chat(tools + `"tool_choice":"auto",`), true},
		{"SGLang: tools and none", api.SGLang, chat(tools), chat(tools + `"tool_choice":"none",`), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			a, b := keyOf(t, api.Chat, tt.engine, tt.a), keyOf(t, api.Chat, tt.engine, tt.b)
			if same := a == b; same != tt.same {
				t.Errorf("keyed alike: %v, want %v\n%s\n%s", same, tt.same, a, b)
			}
		})
	}
}

// keyOf is what keys body's blocks in the ranking and the local hint, as
// engine renders the prompt.
func keyOf(t *testing.T, a *api.API, engine api.Family, raw string) string {
	t.Helper()
	obj, err := body.Parse([]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	r := NewRequest(a.PromptOf(obj, engine))
	return fmt.Sprintf("%x %q", r.namespace(), r.Prompt())
}
