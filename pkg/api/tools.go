package api

import (
	"bytes"
	"strings"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// How the chat servers read tools and tool calls: as pydantic dumps them for
// the template, whatever the client's JSON layout.

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
		switch string(keyOf(k)) {
		case "type":
			kind = v
		case "function":
			function = v
		case "defer_loading":
			deferred = v
		}
	}
	if len(function) == 0 || function[0] != '{' {
		writeCompact(b, tool)
		return
	}
	var fields [len(functionFields)][]byte
	for k, v := range body.Members(function) {
		key := keyOf(k)
		for i, name := range functionFields {
			if string(key) == name {
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
		if string(keyOf(k)) == key {
			value = v
		}
	}
	return value
}

// keyOf is k, an object's key as spelt, decoded: the bytes between its
// quotes when it has no escape, so that a switch on it allocates nothing.
func keyOf(k []byte) []byte {
	if bytes.IndexByte(k, '\\') < 0 {
		return k[1 : len(k)-1]
	}
	return []byte(body.DecodeString(k))
}
