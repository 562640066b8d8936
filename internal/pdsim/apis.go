package pdsim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
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

// jsonOnly says whether the API's route refuses a Content-Type other than
// application/json (validate_json_request: every vLLM API here; SGLang's
// OpenAI ones, not its /generate, python/sglang/srt/entrypoints/http_server.py).
func (a apiKind) jsonOnly() bool { return a != apiSGLangGenerate }

// prompt is the request's prompt as hashed for the KV, and the field that
// names it in an error: vLLM's Responses API prepends instructions to input,
// Anthropic's Messages API its system prompt to the messages;
// SGLang's generate takes text or input_ids.
func (a apiKind) prompt(fields map[string]json.RawMessage) (json.RawMessage, string) {
	switch a {
	case apiChat:
		return chatPrompt(fields, true), "messages"
	case apiResponses:
		return preambled(fields, "instructions", "input")
	case apiMessages:
		return preambled(fields, "system", "messages")
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

// preambled is key's value after what the API puts before it (the Responses
// API's instructions, Anthropic's system prompt); nil without key.
func preambled(fields map[string]json.RawMessage, preamble, key string) (json.RawMessage, string) {
	raw, ok := present(fields, key)
	if !ok {
		return nil, key
	}
	pre, _ := present(fields, preamble)
	both, _ := json.Marshal([]json.RawMessage{orNull(pre), raw})
	return both, key
}

// output is what a request asks of the output: samples of each prompt, and
// the limits of each.
type output struct {
	samples   int   // n
	maxTokens int64 // 0: no cap
	minTokens int64
	ignoreEOS bool // not read for Messages: vLLM's Anthropic request has no such field
}

func (r *request) readTokenLimits() *apiError {
	fields, limit, least := r.limitKeys()
	_, given := present(fields, limit)
	if !given && r.api == apiMessages {
		return badRequest("%s: Field required", limit) // Anthropic's max_tokens is not optional
	}
	var aerr *apiError
	if r.maxTokens, aerr = intField(fields, limit); aerr != nil {
		return aerr
	}
	if given && r.maxTokens < 1 {
		return badRequest("%s must be at least 1, got %d.", limit, r.maxTokens)
	}
	if r.minTokens, aerr = intField(fields, least); aerr != nil {
		return aerr
	}
	if r.minTokens < 0 {
		return badRequest("min_tokens must be greater than or equal to 0, got %d.", r.minTokens)
	}
	if r.api != apiMessages {
		if r.ignoreEOS, aerr = boolField(fields, "ignore_eos"); aerr != nil {
			return aerr
		}
	}
	if r.maxTokens > 0 && r.minTokens > r.maxTokens {
		return badRequest("min_tokens must be less than or equal to max_tokens=%d, got %d.", r.maxTokens, r.minTokens)
	}
	return nil
}

// outputTokens is how many tokens the simulated model emits and why it stops:
// it would say EOS after naturalLen tokens, min_tokens suppresses that, and
// max_tokens cuts it short.
func (r *request) outputTokens(naturalLen int) (int, string) {
	n := max(int64(naturalLen), r.minTokens)
	if r.maxTokens > 0 && n >= r.maxTokens {
		return int(r.maxTokens), "length"
	}
	return int(n), "stop"
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
	case apiSGLangGenerate: // pdsim runs a batch once, as its first prompt
		return sglangSampling(r.fields), "max_new_tokens", "min_new_tokens"
	case apiChat:
		if _, ok := present(r.fields, "max_completion_tokens"); ok {
			return r.fields, "max_completion_tokens", "min_tokens" // chat prefers it over max_tokens
		}
	}
	return r.fields, "max_tokens", "min_tokens"
}

// readSamples reads n, the samples asked for of each prompt: at the top
// level of chat and completions, in vLLM's generate's sampling_params, and
// in SGLang's, an object or a list of them, whose first entry counts and
// whose entries must agree (_handle_parallel_sampling in SGLang's
// io_struct.py).
func (r *request) readSamples() (aerr *apiError) {
	switch r.api {
	case apiResponses, apiMessages:
		r.samples = 1
	case apiGenerate:
		r.samples, aerr = samplesIn(object(r.fields, "sampling_params"))
	case apiSGLangGenerate: // a list's first entry's n, the others' equal to it
		var list []map[string]json.RawMessage
		raw, _ := present(r.fields, "sampling_params")
		if json.Unmarshal(raw, &list) != nil || len(list) == 0 {
			list = []map[string]json.RawMessage{object(r.fields, "sampling_params")}
		}
		for i, sp := range list {
			n, aerr := samplesIn(sp)
			switch {
			case aerr != nil:
				return aerr
			case i == 0:
				r.samples = n
			case n != r.samples:
				return badRequest("The parallel_sample_num should be the same for all samples in sample params.")
			}
		}
	default:
		r.samples, aerr = samplesIn(r.fields)
	}
	return aerr
}

// sglangSampling is SGLang's sampling_params, or the first of a list of them.
func sglangSampling(fields map[string]json.RawMessage) map[string]json.RawMessage {
	raw, _ := present(fields, "sampling_params")
	var list []map[string]json.RawMessage
	if json.Unmarshal(raw, &list) == nil && len(list) > 0 {
		return list[0]
	}
	return object(fields, "sampling_params")
}

// samplesIn is the n of fields, 1 when absent.
func samplesIn(fields map[string]json.RawMessage) (int, *apiError) {
	if _, ok := present(fields, "n"); !ok {
		return 1, nil
	}
	n, aerr := intField(fields, "n")
	return int(n), aerr
}

// batch is how many prompts the request has, and whether it is a batch
// (a list of them, even of one): a completions prompt or SGLang's text or
// input_ids.
func (r *request) batch() (prompts int, isBatch bool) {
	var raw json.RawMessage
	switch r.api {
	case apiCompletion:
		raw, _ = present(r.fields, "prompt")
	case apiSGLangGenerate:
		var ok bool
		if raw, ok = present(r.fields, "input_ids"); !ok {
			raw, _ = present(r.fields, "text")
		}
	}
	var list []json.RawMessage
	if json.Unmarshal(raw, &list) != nil || len(list) == 0 || !strings.HasPrefix(string(list[0]), "[") && !strings.HasPrefix(string(list[0]), `"`) {
		return 1, false // one string, or one list of token ids
	}
	return len(list), true
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

// chatPrompt is a chat request's messages, after what vLLM's template also
// renders before them: its tools, and its template variables
// (chat_template_kwargs: enable_thinking, documents, reasoning_effort...). The
// chat endpoint (endpoint true) also takes documents and reasoning_effort as
// fields of its own, which win (ChatCompletionRequest.build_chat_params
// merges them over the kwargs); vLLM's /tokenize has no such fields
// (TokenizeChatRequest), only the kwargs, so its ids for a request that sets
// them as fields start otherwise than the ones cached. nil without messages.
func chatPrompt(fields map[string]json.RawMessage, endpoint bool) json.RawMessage {
	messages, ok := present(fields, "messages")
	if !ok {
		return nil
	}
	var kwargs map[string]json.RawMessage
	if raw, ok := present(fields, "chat_template_kwargs"); ok {
		_ = json.Unmarshal(raw, &kwargs) // not an object: no template variables
	}
	var before []byte
	if raw, ok := present(fields, "tools"); ok {
		before = fmt.Appendf(before, "{%q:%s},", "tools", raw)
	}
	for _, key := range slices.Sorted(maps.Keys(kwargs)) {
		if raw, ok := present(kwargs, key); ok && key != "documents" && key != "reasoning_effort" {
			before = fmt.Appendf(before, "{%q:%s},", key, raw)
		}
	}
	for _, key := range []string{"documents", "reasoning_effort"} {
		raw, ok := present(kwargs, key)
		if field, isField := present(fields, key); endpoint && isField {
			raw, ok = field, true
		}
		if ok {
			before = fmt.Appendf(before, "{%q:%s},", key, raw)
		}
	}
	list := bytes.TrimSpace(messages)
	if before == nil || len(list) < 2 || list[0] != '[' || len(bytes.TrimSpace(list[1:len(list)-1])) == 0 {
		return messages // no more to render, or not a list of messages: refused as it is
	}
	return slices.Concat([]byte{'['}, before, list[1:])
}
