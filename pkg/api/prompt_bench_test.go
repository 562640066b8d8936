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
