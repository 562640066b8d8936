package api

import (
	"encoding/json"
	"strconv"
	"strings"
	"sync"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Prompt is one request's prompt as scheduling reads it: how many samples
// and prompts it asks for at once, and its text and exact length only when
// asked for: only prefix affinity and a pd.min_prompt_tokens threshold read
// them, and rendering a long chat costs more than everything else the
// service does with the body.
type Prompt struct {
	N       int // samples asked for ("n"), 1 when absent
	Prompts int // prompts in the request: a batch has several

	once   sync.Once
	render func() (text string, tokens int)
	text   string
	tokens int
	head   int // bytes of text through the first user message; set by render
}

func newPrompt(n int, render func() (string, int)) *Prompt {
	return &Prompt{N: n, Prompts: 1, render: render}
}

func noPrompt() *Prompt { return newPrompt(1, func() (string, int) { return "", -1 }) }

// Text is the prompt as the prefix index sees it: chat messages rendered in
// order as role and content, a completions prompt as is, token ids in decimal.
func (p *Prompt) Text() string {
	if p == nil {
		return ""
	}
	p.once.Do(p.do)
	return p.text
}

// Tokens is the prompt's exact length when the body carries token ids, else -1.
func (p *Prompt) Tokens() int {
	if p == nil {
		return -1
	}
	p.once.Do(p.do)
	return p.tokens
}

// Head is the start of Text that every later turn of the same conversation
// repeats: everything through the first user message (tools, system or
// developer messages, instructions, and that message). It is empty when the
// prompt has no messages, or none from the user.
func (p *Prompt) Head() string {
	if p == nil {
		return ""
	}
	p.once.Do(p.do)
	return p.text[:p.head]
}

func (p *Prompt) do() { p.text, p.tokens = p.render() }

// samples reads an integer n (absent or not an integer: 1).
func samples(o *body.Object) int {
	if o == nil {
		return 1
	}
	if n, ok := o.Int("n"); ok {
		return int(n)
	}
	return 1
}

// chatPrompt: messages, after the tools chat templates put first.
func chatPrompt(o *body.Object) *Prompt {
	p := newPrompt(samples(o), nil)
	p.render = func() (string, int) {
		return withTokenIDs(o, func() (string, int) {
			var b strings.Builder
			if raw, ok := o.Raw("tools"); ok && !body.IsNull(raw) {
				b.Write(raw)
				b.WriteByte('\n')
			}
			raw, _ := o.Raw("messages")
			p.head = writeMessages(&b, raw)
			return b.String(), -1
		})
	}
	return p
}

// completionsPrompt: a string, token ids, or a batch of either. An array is
// told apart now, as the decider needs to know whether it is a batch.
func completionsPrompt(o *body.Object) *Prompt {
	raw, _ := o.Raw("prompt")
	p := promptOf(samples(o), raw)
	render := p.render
	p.render = func() (string, int) { return withTokenIDs(o, render) }
	return p
}

// promptOf reads a prompt (absent when raw is nil): a string, token ids, or a
// batch of either. An array is read at once, as the decider needs to know
// whether it is a batch; a string only when asked for.
func promptOf(n int, raw []byte) *Prompt {
	p := newPrompt(n, func() (string, int) {
		if len(raw) == 0 {
			return "", -1
		}
		text, tokens, _ := renderPrompt(raw)
		return text, tokens
	})
	if len(raw) > 0 && raw[0] == '[' {
		text, tokens, prompts := renderPrompt(raw)
		p.Prompts = prompts
		p.render = func() (string, int) { return text, tokens }
	}
	return p
}

// withTokenIDs prefers prompt_token_ids, vLLM's older spelling of a token
// prompt, when the body has them.
func withTokenIDs(o *body.Object, render func() (string, int)) (string, int) {
	if raw, ok := o.Raw("prompt_token_ids"); ok {
		if ids, ok := tokenIDs(raw); ok {
			return ids, countIDs(ids)
		}
	}
	return render()
}

// responsesPrompt: instructions, then the input: items, or a string, which
// is one user message and renders as one, so that a conversation that starts
// with a string and goes on with items keeps its head.
func responsesPrompt(o *body.Object) *Prompt {
	p := newPrompt(1, nil)
	p.render = func() (string, int) {
		var b strings.Builder
		if s, ok := o.String("instructions"); ok {
			b.WriteString(s)
			b.WriteByte('\n')
		}
		raw, _ := o.Raw("input")
		if len(raw) > 0 && raw[0] == '"' {
			b.WriteString("user\n")
			writeContent(&b, raw)
			b.WriteByte('\n')
			p.head = b.Len()
		} else {
			p.head = writeMessages(&b, raw)
		}
		return b.String(), -1
	}
	return p
}

// messagesPrompt: Anthropic's system, then its messages.
func messagesPrompt(o *body.Object) *Prompt {
	p := newPrompt(1, nil)
	p.render = func() (string, int) {
		var b strings.Builder
		if raw, ok := o.Raw("system"); ok && !body.IsNull(raw) {
			writeContent(&b, raw)
			b.WriteByte('\n')
		}
		raw, _ := o.Raw("messages")
		p.head = writeMessages(&b, raw)
		return b.String(), -1
	}
	return p
}

// generatePrompt: vLLM's token-in API, whose length is exact.
func generatePrompt(o *body.Object) *Prompt {
	sp, _ := o.Object("sampling_params")
	return newPrompt(samples(sp), func() (string, int) {
		raw, _ := o.Raw("token_ids")
		if ids, ok := tokenIDs(raw); ok {
			return ids, countIDs(ids)
		}
		return "", -1
	})
}

// sglangGeneratePrompt: SGLang's native API, text or input_ids, either one
// prompt or a batch; n is in sampling_params.
func sglangGeneratePrompt(o *body.Object) *Prompt {
	sp, _ := o.Object("sampling_params")
	raw, ok := o.Raw("input_ids")
	if !ok {
		raw, _ = o.Raw("text")
	}
	return promptOf(samples(sp), raw)
}

type message struct {
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	ToolCalls json.RawMessage `json:"tool_calls"`
}

// writeMessages writes each message as role, newline, content, newline.
// Text parts render as their text; other parts (images, audio, tool
// calls, items without a role) as their JSON, so that two prompts
// differing only in an image do not look alike. It returns the length of b
// through the first user message, 0 when there is none (Prompt.Head).
func writeMessages(b *strings.Builder, raw []byte) (head int) {
	var items []json.RawMessage
	if json.Unmarshal(raw, &items) != nil {
		return 0
	}
	for _, item := range items {
		var m message
		if json.Unmarshal(item, &m) != nil || m.Role == "" {
			b.Write(item)
			b.WriteByte('\n')
			continue
		}
		b.WriteString(m.Role)
		b.WriteByte('\n')
		writeContent(b, m.Content)
		if len(m.ToolCalls) > 0 && !body.IsNull(m.ToolCalls) {
			b.Write(m.ToolCalls)
		}
		b.WriteByte('\n')
		if head == 0 && m.Role == "user" {
			head = b.Len()
		}
	}
	return head
}

type contentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// writeContent writes a string, or the parts of a list: text parts (chat's
// "text", the Responses API's "input_text" and "output_text") as their text.
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
		if json.Unmarshal(p, &cp) == nil && (cp.Type == "text" || cp.Type == "input_text" || cp.Type == "output_text") {
			b.WriteString(cp.Text)
		} else {
			b.Write(p)
		}
	}
}

// renderPrompt reads a prompt: a string, token ids, or a batch of either
// (the first is rendered, all are counted).
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
