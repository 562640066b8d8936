package api

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// BenchmarkChatRender renders a long chat (81 messages, 100 KB) as prefix
// affinity reads it: the costliest thing the service does with a body.
func BenchmarkChatRender(b *testing.B) {
	msgs := []map[string]string{{"role": "system", "content": strings.Repeat("Be helpful. ", 100)}}
	for i := range 80 {
		msgs = append(msgs, map[string]string{"role": []string{"user", "assistant"}[i%2], "content": strings.Repeat(fmt.Sprintf("turn %d says \"this\". ", i), 60)})
	}
	raw, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs})
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		obj, _ := body.Parse(raw)
		_ = Chat.Prompt(obj).Text()
	}
}

// BenchmarkAgentRender renders an agent's request as prefix affinity reads
// it: 30 tools (JSON schemas), 40 turns with tool calls and their results.
func BenchmarkAgentRender(b *testing.B) {
	tools := make([]any, 30)
	for i := range tools {
		tools[i] = map[string]any{"type": "function", "function": map[string]any{"name": fmt.Sprintf("tool_%d", i),
			"description": strings.Repeat("Does a useful thing. ", 10),
			"parameters": map[string]any{"type": "object", "properties": map[string]any{
				"path": map[string]any{"type": "string", "description": "a path"}, "limit": map[string]any{"type": "integer"}}}}}
	}
	msgs := []any{map[string]any{"role": "system", "content": strings.Repeat("You are an agent. ", 200)}}
	for i := range 40 {
		msgs = append(msgs,
			map[string]any{"role": "user", "content": strings.Repeat(fmt.Sprintf("step %d ", i), 30)},
			map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{"id": fmt.Sprint("c", i), "type": "function",
				"function": map[string]any{"name": "tool_1", "arguments": `{"path": "/src/main.go", "limit": 100}`}}}},
			map[string]any{"role": "tool", "tool_call_id": fmt.Sprint("c", i), "content": strings.Repeat("file line\n", 50)})
	}
	raw, _ := json.MarshalIndent(map[string]any{"model": "m", "messages": msgs, "tools": tools, "chat_template_kwargs": map[string]any{"enable_thinking": false}}, "", " ")
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		obj, _ := body.Parse(raw)
		p := Chat.Prompt(obj)
		_ = p.Text()
	}
}
