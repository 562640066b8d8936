package api

import (
	"encoding/json"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Tokens is how a request's prompt becomes the token ids its engine
// computes, for routing by the engines' KV cache events: the ids themselves
// when the body carries them, else the body of a request to vLLM's
// /tokenize that answers them ({"tokens": [...]}). Neither when the API has
// no such form (Responses, Anthropic Messages) or the body is a batch.
type Tokens struct {
	IDs []int64
	Ask []byte
}

// The fields of a chat request that vLLM's /tokenize (TokenizeChatRequest,
// vllm/entrypoints/openai/protocol.py) reads to render it as the chat
// endpoint does: the same template, tools and generation prompt. Their
// defaults there are the chat endpoint's (add_generation_prompt true,
// add_special_tokens false).
var chatTokenizeFields = []string{"model", "messages", "tools", "add_generation_prompt", "continue_final_message",
	"add_special_tokens", "chat_template", "chat_template_kwargs", "mm_processor_kwargs"}

func chatTokens(o *body.Object) Tokens {
	if ids, ok := idsOf(o, "prompt_token_ids"); ok {
		return Tokens{IDs: ids}
	}
	return Tokens{Ask: fieldsOf(o, chatTokenizeFields)}
}

// completionsTokens: a string prompt is asked for (TokenizeCompletionRequest:
// model, prompt, add_special_tokens), token ids are taken as they are.
func completionsTokens(o *body.Object) Tokens {
	for _, name := range []string{"prompt_token_ids", "prompt"} {
		if ids, ok := idsOf(o, name); ok {
			return Tokens{IDs: ids}
		}
	}
	if raw, ok := o.Raw("prompt"); ok && len(raw) > 0 && raw[0] == '"' {
		return Tokens{Ask: fieldsOf(o, []string{"model", "prompt", "add_special_tokens"})}
	}
	return Tokens{} // a batch
}

// generateTokens: vLLM's token-in generate carries its ids.
func generateTokens(o *body.Object) Tokens {
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
