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
		m, err := body.Parse(item) // read as the engines read it: keys as spelt, the last duplicate
		role, kind := "", ""
		if err == nil {
			role, _ = m.String("role")
			kind, _ = m.String("type")
		}
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
		content, _ := m.Raw("content")
		if anthropic {
			role = anthropicRole(role)
		}
		calls, _ := m.Raw("tool_calls")
		first := head == 0 && role == "user"
		if first {
			preamble = b.Len()
		}
		name, _ := m.String("name")
		var reasoning string
		if role == "assistant" {
			reasoning = reasoningOf(m)
		}
		if end := writeMessage(b, role, name, reasoning, content, calls); end > 0 {
			media = end
		}
		if first {
			head = b.Len()
		}
	}
	return rendering{text: b.String(), tokens: -1, preamble: preamble, head: head, previous: previous, media: media}
}

// reasoningOf is an assistant message's reasoning, which the engines hand
// the chat template and some templates write (Qwen3's, in the turns after
// the last user message): vLLM reads "reasoning"
// (_parse_chat_message_content,
// vllm/renderers/chat_utils/parse_chat_message_content.py @ be90fe16),
// SGLang "reasoning_content" (ChatCompletionMessageGenericParam,
// python/sglang/srt/entrypoints/openai/protocol.py @ 004c82e0).
func reasoningOf(m *body.Object) string {
	if s, ok := m.String("reasoning"); ok {
		return s
	}
	s, _ := m.String("reasoning_content")
	return s
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
func textPart(part []byte) (kind, text string, ok bool) {
	if len(part) == 0 || part[0] != '{' {
		return "", "", false
	}
	o, err := body.Parse(part)
	if err != nil {
		return "", "", false
	}
	switch kind, _ = o.String("type"); kind {
	case "text", "input_text", "output_text":
		text, ok = o.String("text")
	}
	return kind, text, ok
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

var arguments = []byte(`"arguments"`)

// writeCalls writes an assistant's tool calls as their JSON, each call's
// arguments string as the JSON it holds: vLLM (_postprocess_messages,
// vllm/renderers/chat_utils/parse_chat_message.py @ be90fe16) and SGLang
// (normalize_assistant_tool_call_arguments, serving_chat.py @ 002897c2)
// parse it before the template writes it, so its whitespace never reaches
// the prompt.
func writeCalls(b *strings.Builder, calls []byte) {
	if calls[0] != '[' || !bytes.Contains(calls, arguments) {
		writeCompact(b, calls)
		return
	}
	b.WriteByte('[')
	n := 0
	for call := range body.Items(calls) {
		if n++; n > 1 {
			b.WriteByte(',')
		}
		args := member(member(call, "function"), "arguments")
		if len(args) == 0 || args[0] != '"' {
			writeCompact(b, call)
			continue
		}
		start := cap(call) - cap(args) // args is call[start:start+len(args)]
		writeCompact(b, call[:start])
		writeCompact(b, []byte(body.DecodeString(args)))
		writeCompact(b, call[start+len(args):])
	}
	b.WriteByte(']')
}

// writeTools writes the request's tools that keep says the engine renders
// (all when keep is nil), when there are any, as their JSON; a chat tool as
// writeTool does.
func writeTools(b *strings.Builder, o *body.Object, keep func(tool []byte) bool) {
	raw, ok := o.Raw("tools")
	if !ok || body.IsNull(raw) {
		return
	}
	if raw[0] != '[' {
		writeCompact(b, raw)
		b.WriteByte('\n')
		return
	}
	n := 0
	for tool := range body.Items(raw) {
		if keep != nil && !keep(tool) {
			continue
		}
		if n++; n == 1 {
			b.WriteByte('[')
		} else {
			b.WriteByte(',')
		}
		writeTool(b, tool)
	}
	if n > 0 {
		b.WriteString("]\n")
	}
}

// sglangTools says which of a chat request's tools SGLang renders
// (_process_messages, serving_chat.py @ 002897c2): none for tool_choice
// "none", only the one a named choice names, else all (nil). vLLM renders
// them all unless started with --exclude-tools-when-tool-choice-none
// (render_chat, vllm/renderers/online_renderer.py @ 01063cd0), which a
// request does not tell.
func sglangTools(o *body.Object) func(tool []byte) bool {
	if choice, _ := o.String("tool_choice"); choice == "none" {
		return func([]byte) bool { return false }
	}
	choice, _ := o.Raw("tool_choice")
	name := member(member(choice, "function"), "name")
	if len(name) == 0 || name[0] != '"' {
		return nil
	}
	want := body.DecodeString(name)
	return func(tool []byte) bool {
		name := member(member(tool, "function"), "name")
		return len(name) > 0 && name[0] == '"' && body.DecodeString(name) == want
	}
}

// functionFields are the fields of a chat tool's function that the engines
// hand the template, in their order: pydantic's model_dump writes the fields
// a model declares, in its order, whatever order the client sent, and no
// others (FunctionDefinition, vllm/entrypoints/generate/base/protocol.py @
// 022e555d; SGLang's Function, python/sglang/srt/entrypoints/openai/protocol.py
// @ 004c82e0, declares the same fields, description first).
var functionFields = [...]string{"name", "description", "parameters", "strict", "defer_loading"}

// writeTool writes a chat tool ({"type", "function"}) as its type ("function"
// when absent, the models' default), its function's fields (functionFields)
// and its defer_loading, in that order (ChatCompletionToolsParam,
// vllm/entrypoints/openai/chat_completion/protocol.py @ 002032ee; SGLang's
// Tool); another API's tool as its JSON.
func writeTool(b *strings.Builder, tool []byte) {
	kind, function, deferred := []byte(`"function"`), []byte(nil), []byte(nil)
	for k, v := range body.Members(tool) {
		switch {
		case named(k, "type"):
			kind = v
		case named(k, "function"):
			function = v
		case named(k, "defer_loading"):
			deferred = v
		}
	}
	if len(function) == 0 || function[0] != '{' {
		writeCompact(b, tool)
		return
	}
	var fields [len(functionFields)][]byte
	for k, v := range body.Members(function) {
		for i, name := range functionFields {
			if named(k, name) {
				fields[i] = v
			}
		}
	}
	b.WriteString(`{"type":`)
	writeCompact(b, kind)
	b.WriteString(`,"function":`)
	sep := byte('{')
	for i, v := range fields {
		if v != nil {
			b.WriteByte(sep)
			b.WriteByte('"')
			b.WriteString(functionFields[i])
			b.WriteString(`":`)
			writeCompact(b, v)
			sep = ','
		}
	}
	if sep == '{' {
		b.WriteByte('{')
	}
	b.WriteByte('}')
	if deferred != nil {
		b.WriteString(`,"defer_loading":`)
		writeCompact(b, deferred)
	}
	b.WriteByte('}')
}

// member is the value of key in raw, a validated JSON object (the last
// duplicate, keys read decoded, as the engines read them); nil when raw is
// not an object or has no such key.
func member(raw []byte, key string) (value []byte) {
	for k, v := range body.Members(raw) {
		if named(k, key) {
			value = v
		}
	}
	return value
}

// named says whether k, a key as spelt, is name once decoded.
func named(k []byte, name string) bool {
	if bytes.IndexByte(k, '\\') < 0 {
		return len(k) == len(name)+2 && string(k[1:len(k)-1]) == name
	}
	return body.DecodeString(k) == name
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
