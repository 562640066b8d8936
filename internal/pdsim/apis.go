package pdsim

import (
	"encoding/json"
	"strings"
)

// The engine APIs pdsim serves inference on. Each reads its prompt, its token
// limits and its KV handoff where the real engine does.
const (
	apiChat           apiKind = iota
	apiCompletion             // POST /v1/completions
	apiResponses              // vLLM's POST /v1/responses
	apiGenerate               // vLLM's token-in POST /inference/v1/generate
	apiSGLangGenerate         // SGLang's native POST /generate
	apiMessages               // vLLM's Anthropic POST /v1/messages
)

// idPrefix starts the engine's request ids, as vLLM names them.
func (a apiKind) idPrefix() string {
	switch a {
	case apiCompletion:
		return "cmpl-"
	case apiResponses:
		return "resp_"
	case apiGenerate:
		return "generate-tokens-"
	case apiSGLangGenerate:
		return ""
	}
	return "chatcmpl-"
}

// checksModel: SGLang's generate has no model field.
func (a apiKind) checksModel() bool { return a != apiSGLangGenerate }

// prompt is the request's prompt as hashed for the KV, and the field that
// names it in an error: vLLM's Responses API prepends instructions to input;
// SGLang's generate takes text or input_ids.
func (a apiKind) prompt(fields map[string]json.RawMessage) (json.RawMessage, string) {
	switch a {
	case apiChat:
		raw, _ := present(fields, "messages")
		return raw, "messages"
	case apiResponses:
		input, ok := present(fields, "input")
		if !ok {
			return nil, "input"
		}
		instructions, _ := present(fields, "instructions")
		both, _ := json.Marshal([]json.RawMessage{orNull(instructions), input})
		return both, "input"
	case apiMessages: // the system prompt, then the messages
		messages, ok := present(fields, "messages")
		if !ok {
			return nil, "messages"
		}
		system, _ := present(fields, "system")
		both, _ := json.Marshal([]json.RawMessage{orNull(system), messages})
		return both, "messages"
	case apiGenerate:
		raw, _ := present(fields, "token_ids")
		return raw, "token_ids"
	case apiSGLangGenerate:
		if raw, ok := present(fields, "input_ids"); ok {
			return raw, "input_ids"
		}
		raw, _ := present(fields, "text")
		return raw, "text"
	}
	raw, _ := present(fields, "prompt")
	return raw, "prompt"
}

// limitKeys are the fields of the output limits and the object they are in
// (nil: the top level).
func (r *request) limitKeys() (in map[string]json.RawMessage, maxKey, minKey string) {
	switch r.api {
	case apiResponses:
		return r.fields, "max_output_tokens", ""
	case apiMessages:
		return r.fields, "max_tokens", ""
	case apiGenerate:
		return object(r.fields, "sampling_params"), "max_tokens", "min_tokens"
	case apiSGLangGenerate:
		return object(r.fields, "sampling_params"), "max_new_tokens", "min_new_tokens"
	case apiChat:
		if _, ok := present(r.fields, "max_completion_tokens"); ok {
			return r.fields, "max_completion_tokens", "min_tokens" // chat prefers it over max_tokens
		}
	}
	return r.fields, "max_tokens", "min_tokens"
}

// kvRaw is the request's kv_transfer_params where the engine reads it: vLLM's
// generate hands the engine only sampling_params, so there it is in
// sampling_params.extra_args, and one at the top level is ignored.
func (r *request) kvRaw() (json.RawMessage, bool) {
	if r.api == apiGenerate {
		return present(object(object(r.fields, "sampling_params"), "extra_args"), "kv_transfer_params")
	}
	return present(r.fields, "kv_transfer_params")
}

// object is key's value when it is a JSON object; nil otherwise.
func object(fields map[string]json.RawMessage, key string) map[string]json.RawMessage {
	var m map[string]json.RawMessage
	if raw, ok := present(fields, key); ok && strings.HasPrefix(string(raw), "{") {
		json.Unmarshal(raw, &m)
	}
	return m
}

func orNull(raw json.RawMessage) json.RawMessage {
	if raw == nil {
		return json.RawMessage("null")
	}
	return raw
}
