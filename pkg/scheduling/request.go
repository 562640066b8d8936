package scheduling

import (
	"encoding/json"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Request is what scheduling reads of one client request. The zero value (or
// nil) is a request with nothing to go by: pickers fall back to load.
type Request struct {
	// N is the number of choices asked for ("n"), 1 when absent.
	N int
	// Prompts is the number of prompts: a completions batch has several.
	Prompts int
	// Subset restricts picking to an endpoint-picker subset hint.
	Subset Subset

	// The prompt is rendered on first use: only prefix affinity and a
	// min_prompt_tokens threshold read it, and rendering a long chat costs more
	// than everything else the service does with the body.
	render   sync.Once
	obj      *body.Object
	prompt   string
	tokenIDs int // exact prompt length when the body carries token ids, else -1
}

// NewRequest reads a parsed OpenAI-style body (chat or completions).
func NewRequest(obj *body.Object) *Request {
	r := &Request{N: 1, Prompts: 1, tokenIDs: -1, obj: obj}
	if n, ok := obj.Int("n"); ok {
		r.N = int(n)
	}
	if raw, ok := obj.Raw("prompt"); ok && raw[0] == '[' && !obj.Has("messages") {
		// An array is token ids or a batch: the decider needs to know which now.
		r.render.Do(r.renderBody)
	}
	return r
}

// Prompt is the prompt as the prefix index sees it: chat messages rendered in
// order as role and content, a completions prompt as is, token ids in decimal.
func (r *Request) Prompt() string {
	if r == nil {
		return ""
	}
	r.render.Do(r.renderBody)
	return r.prompt
}

func (r *Request) renderBody() {
	obj := r.obj
	switch {
	case obj == nil:
	case obj.Has("messages"):
		r.prompt = renderChat(obj)
	case obj.Has("prompt"):
		raw, _ := obj.Raw("prompt")
		r.prompt, r.tokenIDs, r.Prompts = renderPrompt(raw)
	}
	if obj == nil {
		return
	}
	if raw, ok := obj.Raw("prompt_token_ids"); ok {
		if ids, ok := tokenIDs(raw); ok {
			r.prompt, r.tokenIDs = ids, countIDs(ids)
		}
	}
}

// PromptTokens is the prompt's length in tokens: exact when the body carries
// token ids, else the characters divided by charsPerToken, rounded up.
func (r *Request) PromptTokens(charsPerToken float64) int {
	if r == nil {
		return 0
	}
	prompt := r.Prompt()
	if r.tokenIDs >= 0 {
		return r.tokenIDs
	}
	if charsPerToken <= 0 {
		charsPerToken = 4
	}
	chars := float64(utf8.RuneCountInString(prompt))
	return int((chars + charsPerToken - 1) / charsPerToken)
}

type chatMessage struct {
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	ToolCalls json.RawMessage `json:"tool_calls"`
}

type contentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// renderChat writes tools (which chat templates put first) and then each
// message as role, newline, content, newline. Text parts render as their
// text; other parts (images, audio) as their JSON, so that two prompts differing
// only in an image do not look alike.
func renderChat(obj *body.Object) string {
	var b strings.Builder
	if raw, ok := obj.Raw("tools"); ok && !body.IsNull(raw) {
		b.Write(raw)
		b.WriteByte('\n')
	}
	raw, _ := obj.Raw("messages")
	var msgs []chatMessage
	if json.Unmarshal(raw, &msgs) != nil {
		return b.String()
	}
	for _, m := range msgs {
		b.WriteString(m.Role)
		b.WriteByte('\n')
		writeContent(&b, m.Content)
		if len(m.ToolCalls) > 0 && !body.IsNull(m.ToolCalls) {
			b.Write(m.ToolCalls)
		}
		b.WriteByte('\n')
	}
	return b.String()
}

func writeContent(b *strings.Builder, raw json.RawMessage) {
	if len(raw) == 0 || body.IsNull(raw) {
		return
	}
	if raw[0] == '"' {
		var s string
		if json.Unmarshal(raw, &s) == nil {
			b.WriteString(s)
		}
		return
	}
	var parts []json.RawMessage
	if json.Unmarshal(raw, &parts) != nil {
		return
	}
	for _, p := range parts {
		var cp contentPart
		if json.Unmarshal(p, &cp) == nil && cp.Type == "text" {
			b.WriteString(cp.Text)
		} else {
			b.Write(p)
		}
	}
}

// renderPrompt reads a completions prompt: a string, token ids, or a batch of
// either (the first is rendered, all are counted).
func renderPrompt(raw []byte) (prompt string, tokens, prompts int) {
	switch raw[0] {
	case '"':
		var s string
		_ = json.Unmarshal(raw, &s)
		return s, -1, 1
	case '[':
		if ids, ok := tokenIDs(raw); ok {
			return ids, countIDs(ids), 1
		}
		var batch []json.RawMessage
		if json.Unmarshal(raw, &batch) != nil || len(batch) == 0 {
			return "", -1, 1
		}
		prompt, tokens, _ = renderPrompt(batch[0])
		return prompt, tokens, len(batch)
	}
	return "", -1, 1
}

// tokenIDs renders a JSON array of integers as decimal ids joined by commas.
func tokenIDs(raw []byte) (string, bool) {
	var ids []int64
	if len(raw) == 0 || raw[0] != '[' || json.Unmarshal(raw, &ids) != nil {
		return "", false
	}
	b := make([]byte, 0, len(ids)*6)
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, id, 10)
	}
	return string(b), true
}

func countIDs(ids string) int {
	if ids == "" {
		return 0
	}
	return strings.Count(ids, ",") + 1
}
