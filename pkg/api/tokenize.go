package api

import (
	"encoding/json"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Tokens is how a request's prompt becomes the token ids its engine
// computes, for routing by the engines' KV cache events: the ids themselves
// when the body carries them, else requests to the engine that answer them.
// None when the API has no such request (Responses, Anthropic Messages),
// the body is a batch, or it carries a cache_salt: vLLM keys a salted
// prompt's blocks with the salt (its first block's extra keys), so the
// prompt's plain ids would find blocks the engine will not reuse for it.
type Tokens struct {
	IDs []int64
	// RenderPath is vLLM's render endpoint for the request's API, which
	// renders the request (the same body) as its endpoint does and answers
	// the ids generation computes: {"token_ids": [...]}, or a list of them
	// for completions. "" when the API has none.
	RenderPath string
	// Ask is the body of a request to vLLM's /tokenize, for engines without
	// the render endpoint (older vLLM releases, SGLang): {"tokens": [...]}.
	// /tokenize is given fewer of the request's fields than the endpoint
	// renders (not documents or reasoning_effort, nor the endpoint's
	// truncation or its tools dropped for tool_choice "none"), so its ids
	// can differ where a template uses them.
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

func chatTokens(o *body.Object) Tokens {
	if o.Has("cache_salt") {
		return Tokens{}
	}
	return Tokens{RenderPath: ChatRenderPath, Ask: fieldsOf(o, chatTokenizeFields)}
}

// completionsTokens: token ids are taken as they are (vLLM adds no special
// tokens to them), a string prompt is asked for (TokenizeCompletionRequest:
// model, prompt, add_special_tokens).
func completionsTokens(o *body.Object) Tokens {
	switch raw, _ := o.Raw("prompt"); {
	case o.Has("cache_salt"):
	case len(raw) > 0 && raw[0] == '"':
		return Tokens{RenderPath: CompletionsRenderPath, Ask: fieldsOf(o, []string{"model", "prompt", "add_special_tokens"})}
	default:
		if ids, ok := idsOf(o, "prompt"); ok {
			return Tokens{IDs: ids}
		}
	}
	return Tokens{} // a batch, or salted
}

// responsesTokens: the Responses API has no /tokenize form, only its render
// endpoint. A request that continues a stored response (previous_response_id)
// is rendered only by the engine that stores it; another refuses it.
func responsesTokens(o *body.Object) Tokens {
	if o.Has("cache_salt") {
		return Tokens{}
	}
	return Tokens{RenderPath: ResponsesRenderPath}
}

// generateTokens: vLLM's token-in generate carries its ids.
func generateTokens(o *body.Object) Tokens {
	if o.Has("cache_salt") {
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

// fieldsOf is a JSON object of o's fields of these names, as they are.
func fieldsOf(o *body.Object, names []string) []byte {
	out := []byte{'{'}
	for _, name := range names {
		raw, ok := o.Raw(name)
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
