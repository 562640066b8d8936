package api

import (
	"encoding/json"
	"slices"
	"strconv"
	"strings"
	"testing"
)

func TestPromptReaders(t *testing.T) {
	tests := []struct {
		name        string
		api         *API
		body        string
		wantText    string
		wantTokens  int // exact, -1 when the body has no token ids
		wantN       int
		wantPrompts int
		wantMixedN  []int // SGLang's list of sampling_params whose n differ
	}{
		{name: "chat: role and content in order", api: Chat,
			body:     `{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}`,
			wantText: "system\nBe brief.\nuser\nHi\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "chat: text parts joined, other parts as JSON", api: Chat,
			body:     `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"What is"},{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":" this?"}]}]}`,
			wantText: "user\nWhat is{\"type\":\"image_url\",\"image_url\":{\"url\":\"u\"}} this?\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "chat: tools first, tool calls kept, escapes decoded", api: Chat,
			body:     `{"model":"m","tools":[{"type":"function"}],"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"user","content":"a\"b"}]}`,
			wantText: "[{\"type\":\"function\"}]\nassistant\n[{\"id\":\"1\"}]\nuser\na\"b\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		// The engines hand the template a tool as pydantic dumps it, and a
		// tool call's arguments parsed.
		{name: "chat: a tool's fields in the engines' order, a call's arguments as the JSON they hold", api: Chat,
			body: `{"tools":[{"function":{"x":1,"parameters":{"b":{},"a":{}},"description":"d","name":"f","name":"g"}},{"type":"web"}],` +
				`"messages":[{"role":"user","content":"Q"},{"role":"assistant","tool_calls":[{"id":"1","function":{"arguments":"{\"a\": [1, \"x y\"]}","name":"g"}},{"id":"2","function":{"arguments":{"a":1}}}]}]}`,
			wantText: `[{"type":"function","function":{"name":"g","description":"d","parameters":{"b":{},"a":{}}}},{"type":"web"}]` + "\nuser\nQ\nassistant\n" +
				`[{"id":"1","function":{"arguments":{"a":[1,"x y"]},"name":"g"}},{"id":"2","function":{"arguments":{"a":1}}}]` + "\n",
			wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "chat: an assistant's reasoning before its content", api: Chat,
			body:     `{"messages":[{"role":"user","content":"Q"},{"role":"assistant","reasoning":"think","content":"A"},{"role":"assistant","reasoning_content":"more","content":"B"}]}`,
			wantText: "user\nQ\nassistant\nthink\nA\nassistant\nmore\nB\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		// The engines read a part's keys as spelt, the last duplicate
		// winning (Python's json); encoding/json would match "TEXT" too.
		{name: "chat: a text part's keys as spelt, the last duplicate", api: Chat,
			body:     `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"long question","TEXT":""},{"type":"text","Text":"x","text":"a","text":"b"}]}]}`,
			wantText: "user\nlong questionb\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "chat: a message's keys decoded, the last duplicate", api: Chat,
			body:     `{"messages":[{"role":"user","ro\u006ce":"system","content":"a","content":"b","name":1}]}`,
			wantText: "system\nb\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "chat: n", api: Chat, body: `{"model":"m","n":3,"messages":[{"role":"user","content":"Hi"}]}`,
			wantText: "user\nHi\n", wantTokens: -1, wantN: 3, wantPrompts: 1},
		{name: "chat: messages of the wrong shape", api: Chat, body: `{"model":"m","messages":"hi"}`, wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "completions: string", api: Completions, body: `{"model":"m","prompt":"Once upon a time"}`,
			wantText: "Once upon a time", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "completions: token ids count exactly", api: Completions, body: `{"model":"m","prompt":[1, 22, 333]}`,
			wantText: "1,22,333", wantTokens: 3, wantN: 1, wantPrompts: 1},
		{name: "completions: batch of strings", api: Completions, body: `{"model":"m","prompt":["first prompt","second"]}`,
			wantText: "first prompt", wantTokens: -1, wantN: 1, wantPrompts: 2},
		{name: "completions: batch of token ids", api: Completions, body: `{"model":"m","prompt":[[1,2],[3]],"n":2}`,
			wantText: "1,2", wantTokens: 2, wantN: 2, wantPrompts: 2},
		{name: "completions: a batch nested deeper is not read", api: Completions, body: `{"model":"m","prompt":[[[1,2]],[[3]]]}`,
			wantTokens: -1, wantN: 1, wantPrompts: 2},
		{name: "completions: token ids nested deeper are not read", api: Completions, body: `{"model":"m","prompt":[[[[1,2]]]]}`,
			wantTokens: -1, wantN: 1, wantPrompts: 1},
		// vLLM runs an engine request per prompt_embeds entry, besides the
		// prompt's, and hands back the first one's KV params alone.
		{name: "completions: two prompt embeddings are a batch", api: Completions, body: `{"model":"m","prompt_embeds":["QUJD","REVG"]}`,
			wantTokens: -1, wantN: 1, wantPrompts: 2},
		{name: "completions: a prompt and its embedding are two", api: Completions, body: `{"model":"m","prompt":"hi","prompt_embeds":"QUJD"}`,
			wantText: "hi", wantTokens: -1, wantN: 1, wantPrompts: 2},
		{name: "completions: one embedding alone is one", api: Completions, body: `{"model":"m","prompt_embeds":"QUJD"}`,
			wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "completions: one embedding beside a null prompt is one", api: Completions, body: `{"model":"m","prompt":null,"prompt_embeds":"QUJD"}`,
			wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "completions: null embeddings are none", api: Completions, body: `{"model":"m","prompt":"hi","prompt_embeds":null}`,
			wantText: "hi", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "completions: prompt_token_ids", api: Completions, body: `{"model":"m","prompt_token_ids":[5,6,7,8,9]}`,
			wantText: "5,6,7,8,9", wantTokens: 5, wantN: 1, wantPrompts: 1},
		{name: "completions: no prompt at all", api: Completions, body: `{"model":"m"}`, wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "responses: instructions, then a string input", api: Responses,
			body:     `{"model":"m","instructions":"Be brief.","input":"Hi there"}`,
			wantText: "Be brief.\nuser\nHi there\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "responses: items, input_text parts as text, other items as JSON", api: Responses,
			body: `{"input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"Hi"},{"type":"input_image","image_url":"u"}]},` +
				`{"type":"function_call_output","call_id":"c","output":"42"},{"role":"assistant","content":"ok"}]}`,
			wantText:   "user\nHi{\"type\":\"input_image\",\"image_url\":\"u\"}\n{\"type\":\"function_call_output\",\"call_id\":\"c\",\"output\":\"42\"}\nassistant\nok\n",
			wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "messages: system, then messages", api: Messages,
			body:     `{"model":"m","system":"Be brief.","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}]}`,
			wantText: "Be brief.\nuser\nHi\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "messages: tools first, Claude Code's billing-header blocks and roles as vLLM reads them", api: Messages,
			body: `{"model":"m","tools":[{"name":"t"}],"system":[{"type":"text","text":"x-anthropic-billing-header: cch=1;"},{"type":"text","text":"You are Claude Code."}],` +
				`"messages":[{"role":"system","content":[{"type":"text","text":"x-anthropic-billing-header: cch=2;"},{"type":"text","text":"Inline."}]},{"role":"msg","content":"Hi"}]}`,
			wantText: "[{\"name\":\"t\"}]\nYou are Claude Code.\nsystem\nInline.\nuser\nHi\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "messages: a system string loses its billing-header line", api: Messages,
			body:     `{"model":"m","system":"x-anthropic-billing-header: cch=1;\nBe brief.","messages":[{"role":"user","content":"Hi"}]}`,
			wantText: "Be brief.\nuser\nHi\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "chat: a system message loses Claude Code's billing-header line, as vLLM drops it", api: Chat,
			body: `{"model":"m","messages":[{"role":"system","content":"x-anthropic-billing-header: cch=1;\nYou are Claude Code."},` +
				`{"role":"system","content":[{"type":"text","text":"x-anthropic-billing-header: cch=2;"},{"type":"text","text":"More."}]},{"role":"user","content":"x-anthropic-billing-header: kept"}]}`,
			wantText: "system\nYou are Claude Code.\nsystem\nMore.\nuser\nx-anthropic-billing-header: kept\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "responses: tools first, then instructions", api: Responses,
			body:     `{"tools":[{"type":"function","name":"a"}],"instructions":"Be brief.","input":"Hi"}`,
			wantText: "[{\"type\":\"function\",\"name\":\"a\"}]\nBe brief.\nuser\nHi\n", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "generate: token ids, n in sampling_params", api: Generate,
			body:     `{"token_ids":[9,8,7,6],"sampling_params":{"n":2,"max_tokens":5}}`,
			wantText: "9,8,7,6", wantTokens: 4, wantN: 2, wantPrompts: 1},
		{name: "generate: no sampling_params", api: Generate, body: `{"token_ids":[1]}`, wantText: "1", wantTokens: 1, wantN: 1, wantPrompts: 1},
		{name: "SGLang generate: text", api: SGLangGenerate, body: `{"text":"Once upon","sampling_params":{"max_new_tokens":8}}`,
			wantText: "Once upon", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "SGLang generate: a batch of texts with n", api: SGLangGenerate, body: `{"text":["a b","c"],"sampling_params":{"n":3}}`,
			wantText: "a b", wantTokens: -1, wantN: 3, wantPrompts: 2},
		{name: "SGLang generate: a list of sampling_params, n in each", api: SGLangGenerate, body: `{"text":["a b","c"],"sampling_params":[{"n":3},{"n":3}]}`,
			wantText: "a b", wantTokens: -1, wantN: 3, wantPrompts: 2},
		{name: "SGLang generate: a list whose n differ reads the first, and tells each", api: SGLangGenerate,
			body: `{"text":["a b","c"],"sampling_params":[{"n":1},{"n":4}]}`, wantText: "a b", wantTokens: -1, wantN: 1, wantPrompts: 2, wantMixedN: []int{1, 4}},
		{name: "SGLang generate: a list without n", api: SGLangGenerate, body: `{"text":["a b","c"],"sampling_params":[{},{"max_new_tokens":2}]}`,
			wantText: "a b", wantTokens: -1, wantN: 1, wantPrompts: 2},
		{name: "SGLang generate: input_ids count exactly", api: SGLangGenerate, body: `{"input_ids":[4,5,6]}`,
			wantText: "4,5,6", wantTokens: 3, wantN: 1, wantPrompts: 1},
		{name: "SGLang generate: a batch of input_ids", api: SGLangGenerate, body: `{"input_ids":[[4,5],[6]]}`,
			wantText: "4,5", wantTokens: 2, wantN: 1, wantPrompts: 2},
		// SGLang's own client sends every field of GenerateReqInput, the
		// unused ones null: a null input_ids leaves the prompt to text.
		{name: "SGLang generate: text beside a null input_ids", api: SGLangGenerate, body: `{"text":["a b","c"],"input_ids":null}`,
			wantText: "a b", wantTokens: -1, wantN: 1, wantPrompts: 2},
		{name: "SGLang generate: input_ids nested deeper are not read", api: SGLangGenerate, body: `{"input_ids":[[[4,5]]]}`,
			wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "characters, not bytes", api: Completions, body: `{"model":"m","prompt":"héllo wörld"}`,
			wantText: "héllo wörld", wantTokens: -1, wantN: 1, wantPrompts: 1},
		{name: "pass-through: nothing to go by", api: passthrough, body: `{"model":"m","input":"x","n":4}`, wantTokens: -1, wantN: 1, wantPrompts: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.api.Prompt(parsed(t, tt.body))
			if p.N != tt.wantN || p.Prompts != tt.wantPrompts || !slices.Equal(p.MixedN, tt.wantMixedN) {
				t.Errorf("N, Prompts, MixedN = %d, %d, %v; want %d, %d, %v", p.N, p.Prompts, p.MixedN, tt.wantN, tt.wantPrompts, tt.wantMixedN)
			}
			if p.Text() != tt.wantText {
				t.Errorf("Text() = %q, want %q", p.Text(), tt.wantText)
			}
			if p.Tokens() != tt.wantTokens {
				t.Errorf("Tokens() = %d, want %d", p.Tokens(), tt.wantTokens)
			}
		})
	}
}

// TestPromptMedia: Media is where the last image, audio or video part ends
// in Text, in each API that takes them; 0 for text, tool calls and the
// Responses API's other items.
func TestPromptMedia(t *testing.T) {
	tests := []struct {
		name string
		api  *API
		body string
		want string // Text up to Media; "" for none
	}{
		{name: "chat: an image between texts", api: Chat,
			body: `{"messages":[{"role":"user","content":[{"type":"text","text":"Is"},{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":" red?"}]}]}`,
			want: `user` + "\n" + `Is{"type":"image_url","image_url":{"url":"u"}}`},
		{name: "chat: the last of audio and video", api: Chat,
			body: `{"messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"QQ==","format":"wav"}}]},` +
				`{"role":"assistant","content":"ok"},{"role":"user","content":[{"type":"video_url","video_url":{"url":"v"}},{"type":"text","text":"?"}]}]}`,
			want: "user\n" + `{"type":"input_audio","input_audio":{"data":"QQ==","format":"wav"}}` + "\nassistant\nok\nuser\n" + `{"type":"video_url","video_url":{"url":"v"}}`},
		{name: "chat: text and tool calls only", api: Chat,
			body: `{"messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}`},
		{name: "responses: input_image", api: Responses,
			body: `{"input":[{"role":"user","content":[{"type":"input_image","image_url":"data:image/png;base64,QQ=="},{"type":"input_text","text":"?"}]}]}`,
			want: "user\n" + `{"type":"input_image","image_url":"data:image/png;base64,QQ=="}`},
		{name: "responses: a function call output is no media", api: Responses,
			body: `{"input":[{"type":"function_call_output","call_id":"c","output":"42"}]}`},
		{name: "messages: an image block", api: Messages,
			body: `{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"u"}},{"type":"text","text":"?"}]}]}`,
			want: "user\n" + `{"type":"image","source":{"type":"url","url":"u"}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.api.Prompt(parsed(t, tt.body))
			if got := p.Text()[:p.Media()]; got != tt.want {
				t.Errorf("Text()[:Media()] = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestNilPromptHasNothingToGoBy(t *testing.T) {
	var p *Prompt
	if p.Text() != "" || p.Tokens() != -1 || p.Preamble() != "" || p.Head() != "" || p.Previous() != "" || p.Media() != 0 {
		t.Fatal("a nil prompt has a text")
	}
}

// The head is what every turn of a conversation repeats, so a conversation's
// turns must share it however long the history grows; the previous request
// of a turn is the turn before it, as the client sent it.
func TestPromptHeadAndPrevious(t *testing.T) {
	tests := []struct {
		name     string
		api      *API
		turns    []string // bodies of successive turns, each continuing the one before
		wantHead string
		// wantPreamble, when set, is every turn's preamble.
		wantPreamble string
		// wantPrevious is the first turn's previous request; a later turn's
		// is the turn before it.
		wantPrevious string
	}{
		{name: "chat: system and the first user message", api: Chat, turns: []string{
			`{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}`,
			`{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"More"}]}`,
		}, wantHead: "system\nBe brief.\nuser\nHi\n", wantPreamble: "system\nBe brief.\n"},
		{name: "chat: tools are part of it", api: Chat, turns: []string{
			`{"tools":[{"type":"function"}],"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"}]}`,
		}, wantHead: "[{\"type\":\"function\"}]\nuser\nHi\n", wantPreamble: "[{\"type\":\"function\"}]\n"}, // a last assistant message is a prefill, not a reply
		{name: "chat: a tool call and its result", api: Chat, turns: []string{
			`{"messages":[{"role":"user","content":"Hi"}]}`,
			`{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"a"}]},{"role":"tool","content":"42"}]}`,
			`{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"a"}]},{"role":"tool","content":"42"},{"role":"assistant","content":"It is 42."},{"role":"user","content":"Thanks"}]}`,
		}, wantHead: "user\nHi\n"},
		{name: "chat: an example reply before the first user message answers nothing", api: Chat, turns: []string{
			`{"messages":[{"role":"system","content":"Echo."},{"role":"assistant","content":"Echo."},{"role":"user","content":"Hi"}]}`,
		}, wantHead: "system\nEcho.\nassistant\nEcho.\nuser\nHi\n", wantPreamble: "system\nEcho.\nassistant\nEcho.\n"},
		{name: "chat: no user message, no head", api: Chat, turns: []string{
			`{"messages":[{"role":"system","content":"Be brief."}]}`,
		}},
		{name: "chat: token ids, no head", api: Chat, turns: []string{
			`{"messages":[{"role":"user","content":"Hi"}],"prompt_token_ids":[1,2]}`,
		}},
		{name: "completions: no messages, no head", api: Completions, turns: []string{`{"prompt":"Once upon a time"}`}},
		{name: "responses: a string input, then items", api: Responses, turns: []string{
			`{"instructions":"Be brief.","input":"Hi"}`,
			`{"instructions":"Be brief.","input":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"More"}]}`,
		}, wantHead: "Be brief.\nuser\nHi\n", wantPreamble: "Be brief.\n"},
		{name: "responses: items through the first user item", api: Responses, turns: []string{
			`{"input":[{"role":"developer","content":"Be brief."},{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"}]}`,
		}, wantHead: "developer\nBe brief.\nuser\nHi\n", wantPreamble: "developer\nBe brief.\n"},
		{name: "responses: reasoning and parallel tool calls are one reply", api: Responses, turns: []string{
			`{"input":[{"role":"user","content":"Weather in Paris and Rome?"}]}`,
			`{"input":[{"role":"user","content":"Weather in Paris and Rome?"},{"type":"reasoning","summary":[]},{"type":"function_call","call_id":"p","name":"weather","arguments":"{\"city\":\"Paris\"}"},{"type":"function_call","call_id":"r","name":"weather","arguments":"{\"city\":\"Rome\"}"},{"type":"function_call_output","call_id":"p","output":"sunny"},{"type":"function_call_output","call_id":"r","output":"rain"}]}`,
			`{"input":[{"role":"user","content":"Weather in Paris and Rome?"},{"type":"reasoning","summary":[]},{"type":"function_call","call_id":"p","name":"weather","arguments":"{\"city\":\"Paris\"}"},{"type":"function_call","call_id":"r","name":"weather","arguments":"{\"city\":\"Rome\"}"},{"type":"function_call_output","call_id":"p","output":"sunny"},{"type":"function_call_output","call_id":"r","output":"rain"},{"role":"assistant","content":"Sunny, and rain."},{"role":"user","content":"Thanks"}]}`,
		}, wantHead: "user\nWeather in Paris and Rome?\n"},
		{name: "messages: an assistant prefill is not a reply", api: Messages, turns: []string{
			`{"messages":[{"role":"user","content":"Hi"}]}`,
			`{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"JSON, please"},{"role":"assistant","content":"{"}]}`,
		}, wantHead: "user\nHi\n"},
		// Examples after the first user message read as earlier turns: the
		// prompt cannot tell them apart (scheduling asks whether that
		// request was ever sent).
		{name: "chat: a few-shot example reads as a turn", api: Chat, turns: []string{
			`{"messages":[{"role":"user","content":"2+2"},{"role":"assistant","content":"4"},{"role":"user","content":"3+3"}]}`,
		}, wantHead: "user\n2+2\n", wantPrevious: "user\n2+2\n"},
		{name: "messages: system and the first user message", api: Messages, turns: []string{
			`{"system":"Be brief.","messages":[{"role":"user","content":"Hi"}]}`,
			`{"system":"Be brief.","messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"More"}]}`,
		}, wantHead: "Be brief.\nuser\nHi\n"},
		{name: "messages: a billing header that changes per request changes no key", api: Messages, turns: []string{
			`{"system":[{"type":"text","text":"x-anthropic-billing-header: cch=1;"},{"type":"text","text":"Be brief."}],"messages":[{"role":"user","content":"Hi"}]}`,
			`{"system":[{"type":"text","text":"x-anthropic-billing-header: cch=2;"},{"type":"text","text":"Be brief."}],"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"More"}]}`,
		}, wantHead: "Be brief.\nuser\nHi\n", wantPreamble: "Be brief.\n"},
		{name: "messages: Claude Code's ctx and msg roles are the user's", api: Messages, turns: []string{
			`{"messages":[{"role":"msg","content":"Hi"}]}`,
			`{"messages":[{"role":"msg","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"ctx","content":"More"}]}`,
		}, wantHead: "user\nHi\n"},
		// Claude Code marks the last block of a request's last message, and
		// sends it unmarked on the next turn; vLLM drops the field.
		{name: "messages: a cache_control that moves to the next turn's last block", api: Messages, turns: []string{
			`{"messages":[{"role":"user","content":"Fix the test"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"go test"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"--- FAIL","cache_control":{"type":"ephemeral"}}]}]}`,
			`{"messages":[{"role":"user","content":"Fix the test"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"go test"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"--- FAIL"}]},{"role":"assistant","content":[{"type":"tool_use","id":"t2","name":"Edit","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t2","content":"ok","cache_control":{"type":"ephemeral"}}]}]}`,
		}, wantHead: "user\nFix the test\n", wantPrevious: "user\nFix the test\n"},
		{name: "generate: token ids, no head", api: Generate, turns: []string{`{"token_ids":[1,2,3]}`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var texts []string
			for i, turn := range tt.turns {
				p := tt.api.Prompt(parsed(t, turn))
				if got := p.Head(); got != tt.wantHead {
					t.Errorf("turn %d: Head() = %q, want %q", i+1, got, tt.wantHead)
				}
				if !strings.HasPrefix(p.Text(), p.Head()) {
					t.Errorf("turn %d: Head() %q does not start Text() %q", i+1, p.Head(), p.Text())
				}
				// The preamble is the head before its first user message.
				if rest, ok := strings.CutPrefix(p.Head(), p.Preamble()); !ok || p.Head() != "" && !strings.HasPrefix(rest, "user\n") {
					t.Errorf("turn %d: Preamble() %q is not Head() %q before its user message", i+1, p.Preamble(), p.Head())
				}
				if tt.wantPreamble != "" && p.Preamble() != tt.wantPreamble {
					t.Errorf("turn %d: Preamble() = %q, want %q", i+1, p.Preamble(), tt.wantPreamble)
				}
				want := tt.wantPrevious
				if i > 0 {
					want = texts[i-1]
				}
				if got := p.Previous(); got != want {
					t.Errorf("turn %d: Previous() = %q, want %q", i+1, got, want)
				}
				texts = append(texts, p.Text())
			}
		})
	}
}

// TestTokenIDsReadAsEncodingJSONDoes: an array is token ids exactly when
// encoding/json decodes it into []int64, with the same ids, but for null,
// which encoding/json reads as 0 and the engines refuse.
func TestTokenIDsReadAsEncodingJSONDoes(t *testing.T) {
	for _, raw := range []string{`[]`, `[0]`, `[-0]`, `[1, 2 ,3]`, `[9223372036854775807]`, `[-9223372036854775808]`,
		`[9223372036854775808]`, `[-9223372036854775809]`, `[18446744073709551615]`, `[99999999999999999999]`,
		`[1.0]`, `[1e3]`, `[-]`, `["1"]`, `[1,""]`, `[null]`, `[[1]]`, `[true]`, `"12"`} {
		var ids []int64
		wantOK := raw[0] == '[' && json.Unmarshal([]byte(raw), &ids) == nil && !strings.Contains(raw, "null")
		r, ok := tokenIDs([]byte(raw))
		if ok != wantOK {
			t.Errorf("tokenIDs(%s) ok = %v, want %v", raw, ok, wantOK)
			continue
		}
		if !ok {
			continue
		}
		want := make([]string, len(ids))
		for i, id := range ids {
			want[i] = strconv.FormatInt(id, 10)
		}
		if r.text != strings.Join(want, ",") || r.tokens != len(ids) {
			t.Errorf("tokenIDs(%s) = %q, %d tokens; want %q, %d", raw, r.text, r.tokens, strings.Join(want, ","), len(ids))
		}
	}
}

// writeCompact drops the whitespace between JSON tokens and keeps every
// byte of the strings, escapes included.
func TestWriteCompact(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{`{ "a" : [ 1, 2 ],` + "\n\t" + `"b": "x y" }`, `{"a":[1,2],"b":"x y"}`},
		{`{"q": "say \"hi there\" ", "n": 1}`, `{"q":"say \"hi there\" ","n":1}`},
		{`{"path": "C:\\dir\\", "next": " k "}`, `{"path":"C:\\dir\\","next":" k "}`},
		{`{"p": "\\\" x", "z": 2}`, `{"p":"\\\" x","z":2}`},
		{`["a b", "c`, `["a b","c`}, // a string that never closes keeps its bytes
		{`""`, `""`},
		{` `, ``},
	} {
		var b strings.Builder
		writeCompact(&b, []byte(tt.in))
		if b.String() != tt.want {
			t.Errorf("writeCompact(%q) = %q, want %q", tt.in, b.String(), tt.want)
		}
	}
}
