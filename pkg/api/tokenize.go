package api

import (
	"encoding/json"
	"strconv"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Tokens is how a request's prompt becomes the token ids its engine
// computes, for routing by the engines' KV cache events: the ids themselves
// when the body carries them, else requests to the engine that answer them
// (API.TokensOf).
type Tokens struct {
	IDs []int64
	// RenderPath is vLLM's render endpoint for the request's API, which
	// renders the request (the same body) as its endpoint does and answers
	// the ids generation computes: {"token_ids": [...]}, or a list of them
	// for completions. "" when the API has none.
	RenderPath string
	// Ask is the body of a request to vLLM's /tokenize, for engines without
	// the render endpoint (older vLLM releases, SGLang): {"tokens": [...]}.
	// /tokenize takes fewer fields than the endpoint renders: documents and
	// reasoning_effort go in its chat_template_kwargs, as the endpoint
	// merges them there, but its truncation, its tools dropped for
	// tool_choice "none" and gpt-oss's Harmony format cannot be asked for,
	// so its ids can differ where those apply.
	Ask []byte
}

// The render endpoints (vllm/entrypoints/serve/render/api_router.py; the
// Responses API's in newer releases than the others).
const (
	ChatRenderPath        = "/v1/chat/completions/render"
	CompletionsRenderPath = "/v1/completions/render"
	ResponsesRenderPath   = "/v1/responses/render"
)

// The fields of a chat request that vLLM's /tokenize (TokenizeChatRequest,
// vllm/entrypoints/serve/tokenize/protocol.py) reads to render it as the
// chat endpoint does: the same template, tools and generation prompt. Their
// defaults there are the chat endpoint's (add_generation_prompt true,
// add_special_tokens false).
var chatTokenizeFields = []string{"model", "messages", "tools", "add_generation_prompt", "continue_final_message",
	"add_special_tokens", "chat_template", "chat_template_kwargs", "mm_processor_kwargs"}

// TokensOf says how to get a request's token ids (what else keys its blocks
// is its Prompt's Cache): none when the API has no way to ask (Anthropic
// Messages, SGLang's generate), the body is a batch, or its cache_salt is
// not one the engine takes (a string, not empty).
//
// A request with truncate_prompt_tokens is computed from its last tokens
// only (vLLM cuts token prompts too: TokenizeParams, vllm/renderers/params.py),
// which only the render endpoint answers: neither the body's ids nor
// /tokenize's are what the engine caches.
func (a *API) TokensOf(o *body.Object) Tokens {
	if a.Tokenize == nil {
		return Tokens{}
	}
	if raw, set := o.Raw("cache_salt"); set && !body.IsNull(raw) {
		if salt, ok := o.String("cache_salt"); !ok || salt == "" {
			return Tokens{}
		}
	}
	t := a.Tokenize(o)
	if present(o, "truncate_prompt_tokens") {
		return Tokens{RenderPath: t.RenderPath}
	}
	return t
}

func chatTokens(o *body.Object) Tokens {
	ask := fieldsOf(o, chatTokenizeFields, map[string][]byte{"chat_template_kwargs": templateKwargs(o)})
	return Tokens{RenderPath: ChatRenderPath, Ask: ask}
}

// templateKwargs is a chat request's chat_template_kwargs as vLLM's chat
// endpoint renders with them (ChatCompletionRequest.build_chat_params):
// its documents and reasoning_effort fields merged over them, and, with a
// reasoning_effort, enable_thinking unless the kwargs set it. nil when the
// request sets none of them.
func templateKwargs(o *body.Object) []byte {
	raw, _ := o.Raw("chat_template_kwargs")
	var kwargs map[string]json.RawMessage
	if len(raw) > 0 && !body.IsNull(raw) && json.Unmarshal(raw, &kwargs) != nil {
		return raw // not an object: the engine refuses it as it is
	}
	merged := false
	for _, key := range []string{"documents", "reasoning_effort"} {
		if v, ok := o.Raw(key); ok && !body.IsNull(v) {
			if kwargs == nil {
				kwargs = map[string]json.RawMessage{}
			}
			kwargs[key], merged = v, true
		}
	}
	if effort, ok := o.String("reasoning_effort"); ok {
		if _, set := kwargs["enable_thinking"]; !set {
			kwargs["enable_thinking"] = json.RawMessage(strconv.FormatBool(effort != "none"))
		}
	}
	if !merged {
		return nil
	}
	out, _ := json.Marshal(kwargs)
	return out
}

// completionsTokens: token ids are taken as they are (vLLM adds no special
// tokens to them), a string prompt is asked for (TokenizeCompletionRequest:
// model, prompt, add_special_tokens).
func completionsTokens(o *body.Object) Tokens {
	if raw, _ := o.Raw("prompt"); len(raw) > 0 && raw[0] == '"' {
		return Tokens{RenderPath: CompletionsRenderPath, Ask: fieldsOf(o, []string{"model", "prompt", "add_special_tokens"}, nil)}
	}
	ids, _ := idsOf(o, "prompt")
	return Tokens{IDs: ids} // none for a batch
}

// responsesTokens: the Responses API has no /tokenize form, only its render
// endpoint, which renders no request that continues a stored response
// (previous_response_id): vLLM's stateless render server refuses it ("not
// supported by the stateless render endpoint"; releases before dropped the
// stored history), so it is not asked.
func responsesTokens(o *body.Object) Tokens {
	if present(o, "previous_response_id") {
		return Tokens{}
	}
	return Tokens{RenderPath: ResponsesRenderPath}
}

// generateTokens: vLLM's token-in generate carries its ids, unless its
// sampling_params cut them (truncate_prompt_tokens, a SamplingParams field).
func generateTokens(o *body.Object) Tokens {
	var params struct {
		Truncate json.RawMessage `json:"truncate_prompt_tokens"`
	}
	if raw, ok := o.Raw("sampling_params"); ok && json.Unmarshal(raw, &params) == nil && len(params.Truncate) > 0 && !body.IsNull(params.Truncate) {
		return Tokens{}
	}
	ids, _ := idsOf(o, "token_ids")
	return Tokens{IDs: ids}
}

func idsOf(o *body.Object, name string) ([]int64, bool) {
	raw, ok := o.Raw(name)
	if !ok || len(raw) == 0 || raw[0] != '[' {
		return nil, false
	}
	var ids []int64
	if json.Unmarshal(raw, &ids) != nil || len(ids) == 0 {
		return nil, false
	}
	return ids, true
}

// fieldsOf is a JSON object of o's fields of these names, as they are, or
// as given in instead when it has one of them (nil: as it is).
func fieldsOf(o *body.Object, names []string, instead map[string][]byte) []byte {
	out := []byte{'{'}
	for _, name := range names {
		raw, ok := o.Raw(name)
		if v := instead[name]; v != nil {
			raw, ok = v, true
		}
		if !ok {
			continue
		}
		if len(out) > 1 {
			out = append(out, ',')
		}
		out = append(out, body.Quote(name)...)
		out = append(out, ':')
		out = append(out, raw...)
	}
	return append(out, '}')
}
