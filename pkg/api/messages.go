package api

import (
	"bytes"
	"encoding/json"
	"strings"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// How the chat servers read messages: the rendering that the prompts of
// chat, the Responses API and Anthropic's Messages share.

// withMessages renders the messages in raw after what b holds: each message
// as role, newline, content, newline. Text parts render as their text; other
// parts (images, audio, tool calls, items without a role) as their JSON, so
// that two prompts differing only in an image do not look alike. The head
// ends after the first user message, the preamble before it; the previous
// request, before the last reply after it that an input follows (see
// Prompt.Previous). A system message is read without Claude Code's billing
// header (unbilled); anthropic reads the roles as vLLM's Messages handler
// does (anthropicRole).
func withMessages(b *strings.Builder, raw []byte, anthropic bool) rendering {
	b.Grow(len(raw)) // the rendering is shorter than the messages' JSON: one buffer, not a chain of them
	preamble, head, previous, media := 0, 0, 0, 0
	// reply is where the run of model output being read began, -1 outside one.
	reply := -1
	for item := range body.Items(raw) { // none when raw is not a list
		m := readMessage(item)
		role, kind := m.role, m.kind
		switch output := role == "assistant" || role == "" && (kind == "reasoning" || strings.HasSuffix(kind, "_call")); {
		case head == 0:
		case output && reply < 0:
			reply = b.Len()
		case !output && reply >= 0:
			previous, reply = reply, -1
		}
		if role == "" {
			writeCompact(b, item)
			b.WriteByte('\n')
			continue
		}
		if anthropic {
			role = anthropicRole(role)
		}
		first := head == 0 && role == "user"
		if first {
			preamble = b.Len()
		}
		if role != "assistant" {
			m.reasoning = ""
		}
		if end := writeMessage(b, role, m.name, m.reasoning, m.content, m.calls); end > 0 {
			media = end
		}
		if first {
			head = b.Len()
		}
	}
	return rendering{text: b.String(), tokens: -1, preamble: preamble, head: head, previous: previous, media: media}
}

// message is what the rendering reads of a chat message, read as the
// engines read it: keys decoded, the last duplicate winning; its role, type,
// name and reasoning when strings, "" else. Its reasoning is what the engines
// hand the chat template and some templates write (Qwen3's, in the turns
// after the last user message): vLLM reads "reasoning"
// (_parse_chat_message_content,
// vllm/renderers/chat_utils/parse_chat_message_content.py @ be90fe16),
// SGLang "reasoning_content" (ChatCompletionMessageGenericParam,
// python/sglang/srt/entrypoints/openai/protocol.py @ 004c82e0).
type message struct {
	role, kind, name, reasoning string
	content, calls              []byte
}

// readMessage reads item, a message of a validated body, in one pass over
// its members: nothing when it is not an object.
func readMessage(item []byte) (m message) {
	var reasoning, reasoningContent []byte
	for k, v := range body.Members(item) {
		switch string(keyOf(k)) {
		case "role":
			m.role = text(v)
		case "type":
			m.kind = text(v)
		case "name":
			m.name = text(v)
		case "content":
			m.content = v
		case "tool_calls":
			m.calls = v
		case "reasoning":
			reasoning = v
		case "reasoning_content":
			reasoningContent = v
		}
	}
	if m.reasoning = text(reasoning); len(reasoning) == 0 || reasoning[0] != '"' {
		m.reasoning = text(reasoningContent)
	}
	return m
}

// text is raw decoded when it is a JSON string, else "".
func text(raw []byte) string {
	if len(raw) == 0 || raw[0] != '"' {
		return ""
	}
	return body.DecodeString(raw)
}

// writeMessage writes a message as its role (and name, which vLLM hands
// the chat template: _parse_chat_message_content,
// vllm/renderers/chat_utils/parse_chat_message_content.py), a newline, its
// reasoning and a newline when it has one, its content and its tool calls
// (JSON), and a newline. It returns where its last media part ends, 0 for
// none (writeContent).
func writeMessage(b *strings.Builder, role, name, reasoning string, content, calls []byte) (media int) {
	b.WriteString(role)
	if name != "" {
		b.WriteByte(' ')
		b.WriteString(name)
	}
	b.WriteByte('\n')
	if reasoning != "" {
		b.WriteString(reasoning)
		b.WriteByte('\n')
	}
	media = writeContent(b, content, role == "system")
	if len(calls) > 0 && !body.IsNull(calls) {
		writeCalls(b, calls)
	}
	b.WriteByte('\n')
	return media
}

// writeContent writes a string, or the parts of a list: text parts (chat's
// "text", the Responses API's "input_text" and "output_text") as their text,
// others as their JSON without a "cache_control" (uncached), so that parts
// of different media differ. A system message's string or "text" parts are
// written without Claude Code's billing-header line (unbilled), as vLLM
// reads them. It returns where the last media part (mediaParts) ends, 0
// for none.
func writeContent(b *strings.Builder, raw json.RawMessage, system bool) (media int) {
	if len(raw) == 0 || body.IsNull(raw) {
		return 0
	}
	if raw[0] == '"' {
		b.WriteString(unbilled(body.DecodeString(raw), system))
		return 0
	}
	for p := range body.Items(raw) {
		kind, text, ok := textPart(p)
		if ok {
			b.WriteString(unbilled(text, system && kind == "text"))
			continue
		}
		b.Write(uncached(p))
		if mediaParts[kind] {
			media = b.Len()
		}
	}
	return media
}

// mediaParts are the content parts that vLLM hands its multimodal processor
// (MM_PARSER_MAP, vllm/renderers/chat_utils/mm_parser_map.py @ 5e29e21a),
// and Anthropic's image blocks, which its Messages handler makes image_url
// parts. Each becomes as many tokens as the processor makes of the media
// (hundreds to thousands an image), which the request does not tell.
var mediaParts = map[string]bool{"image_url": true, "input_image": true, "image_embeds": true, "image_pil": true,
	"audio_url": true, "input_audio": true, "audio_embeds": true, "video_url": true, "video_embeds": true, "image": true}

// textPart reads a content part: its type, and its text when it is text
// (ok: chat's "text", the Responses API's "input_text" and "output_text"),
// keys read as the engines read them: as spelt, the last duplicate winning
// (not encoding/json's case-insensitive match, which took "TEXT" for "text").
func textPart(part []byte) (kind, words string, ok bool) {
	var t []byte
	for k, v := range body.Members(part) {
		switch string(keyOf(k)) {
		case "type":
			kind = text(v)
		case "text":
			t = v
		}
	}
	switch kind {
	case "text", "input_text", "output_text":
		return kind, text(t), len(t) > 0 && t[0] == '"'
	}
	return kind, "", false
}

var cacheControl = []byte(`"cache_control"`)

// uncached is a content part without its "cache_control". Anthropic's
// clients mark the last part of a request with one (Claude Code its last
// message's last block, a tool_result as often as not) and send the same
// part unmarked on the next turn; vLLM's Messages handler drops the field
// (AnthropicContentBlock has none, vllm/entrypoints/anthropic/protocol.py),
// so the engine's prompt for the next turn extends this one, and so must
// the rendering, or the next turn's previous request is never found.
func uncached(part []byte) []byte {
	if !bytes.Contains(part, cacheControl) {
		return part // most parts: no parse
	}
	if o, err := body.Parse(part); err == nil && o.Has("cache_control") {
		return o.Splice(body.Delete("cache_control")).Bytes()
	}
	return part
}

// writeCompact writes JSON without the whitespace between its tokens: the
// engines parse the tools and tool calls, and their templates write them
// anew, so a client that spaces them out (Python's json.dumps does) sends
// the prompt of one that does not.
func writeCompact(b *strings.Builder, raw []byte) {
	start, in := 0, false
	for i := 0; i < len(raw); i++ {
		switch c := raw[i]; {
		case in && c == '\\':
			i++
		case c == '"':
			in = !in
		case !in && (c == ' ' || c == '\n' || c == '\t' || c == '\r'):
			b.Write(raw[start:i])
			start = i + 1
		}
	}
	b.Write(raw[start:])
}

// billingHeader starts the line Claude Code puts first in its system prompt,
// with a hash that changes per request. vLLM drops that line from every
// system message (_strip_claude_code_billing_header,
// vllm/renderers/chat_utils/parse_chat_message_content.py; its Messages
// handler drops the whole block), so that the prefix cache holds across
// requests: the keys leave it out too.
const billingHeader = "x-anthropic-billing-header"

// unbilled is text without its first line when that line is a billing
// header and system says to look (a part that held only the line writes
// nothing, as vLLM drops it).
func unbilled(text string, system bool) string {
	if !system || !strings.HasPrefix(text, billingHeader) {
		return text
	}
	_, rest, _ := strings.Cut(text, "\n")
	return rest
}

// anthropicRole is a Messages role as vLLM reads it: Claude Code's "ctx"
// and "msg" are the user's (AnthropicMessage.normalize_role,
// vllm/entrypoints/anthropic/protocol.py).
func anthropicRole(role string) string {
	if role == "ctx" || role == "msg" {
		return "user"
	}
	return role
}
