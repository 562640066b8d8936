package pdsim

import "net/http"

// defaultMaxModelLen is Config.MaxModelLen's default: the length vLLM
// takes from a small model's config (Qwen2.5-0.5B-Instruct's
// max_position_embeddings).
const defaultMaxModelLen = 32768

// fitsContext refuses, as vLLM does, a request whose output limit, or prompt
// and output limit together, exceed the model's context: vLLM checks the
// limit against max_model_len as it builds the request's TokenizeParams,
// then the prompt's tokens against what the limit leaves
// (TokenizeParams.__post_init__ and _token_len_check,
// vllm/renderers/params.py @ 017638d7), on chat, completions, Messages and
// Responses (ResponsesRequest.build_tok_params,
// vllm/entrypoints/openai/responses/protocol.py; pdsim's model is no Harmony
// model, whose Responses handler clamps the limit on some releases).
// Token-in generate is not checked: its TokenizeParams have no length, and
// the engine stops at the context.
func (s *Server) fitsContext(req *request) *apiError {
	if s.cfg.Protocol == ProtocolSGLang {
		if aerr := s.fitsSGLangContext(req); aerr == nil || req.api != apiMessages {
			return aerr
		}
		return sglangMessagesRefusal(req.stream)
	}
	if req.api == apiGenerate {
		return nil
	}
	_, key, _ := req.limitKeys()
	limit, length := req.maxTokens, int64(s.cfg.MaxModelLen)
	if limit > length {
		return badRequest("%s=%d cannot be greater than max_model_len=%d. Please request fewer output tokens.", key, limit, length)
	}
	if left := length - limit; int64(req.promptTokens) > left {
		return badRequest("You passed %d input tokens and requested %d output tokens. However, the model's context "+
			"length is only %d tokens, resulting in a maximum input length of %d tokens. Please reduce the length of the input prompt.",
			req.promptTokens, limit, length, left)
	}
	return nil
}

// fitsSGLangContext refuses, as SGLang does, a prompt of the whole context
// or more, then a prompt and output limit that together reach it, so one
// token stays free (TokenizerManager._validate_one_request,
// python/sglang/srt/managers/tokenizer_manager.py), on every API: each
// becomes a GenerateReqInput whose sampling_params.max_new_tokens is
// checked. A completion's limit is 16 when not given
// (CompletionRequest.max_tokens, python/sglang/srt/entrypoints/openai/protocol.py);
// chat's, Messages' (run as chat) and /generate's is none, and then only the
// prompt counts. The Responses API clamps max_output_tokens to
// max(context - prompt, 512), then takes 2 off (serving_responses.py, and
// ResponsesRequest.to_sampling_params in protocol.py).
func (s *Server) fitsSGLangContext(req *request) *apiError {
	length, prompt, limit := int64(s.cfg.MaxModelLen), int64(req.promptTokens), req.maxTokens
	if prompt >= length {
		return badRequest("The input (%d tokens) is longer than the model's context length (%d tokens).", prompt, length)
	}
	switch req.api {
	case apiCompletion:
		if limit == 0 {
			limit = 16
		}
	case apiResponses:
		if most := max(length-prompt, 512); limit == 0 || limit > most {
			limit = most
		}
		limit -= 2
	}
	if limit > 0 && prompt+limit >= length {
		return badRequest("Requested token count exceeds the model's maximum context length of %d tokens. You requested a total of %d "+
			"tokens: %d tokens from the input messages and %d tokens for the completion. Please reduce the number of tokens in the "+
			"input messages or the completion to fit within the limit.", length, prompt+limit, prompt, limit)
	}
	return nil
}

// sglangMessagesRefusal is how SGLang's /v1/messages answers a request its
// tokenizer manager refuses. The handler runs it as a chat completion: the
// chat handler turns the refusal into its error answer, which the Anthropic
// handler, wanting a completion, answers with its own 500 "Internal
// processing error" (AnthropicServing._handle_non_streaming,
// python/sglang/srt/entrypoints/anthropic/serving.py @ 0198d48d). A stream's
// 200 is sent before the chat stream is read, and the chat stream raises a
// refusal that comes before its first chunk (_generate_chat_stream,
// openai/serving_chat.py @ 002897c2; releases before yielded it as an error
// chunk instead): the connection ends without an event.
func sglangMessagesRefusal(stream bool) *apiError {
	if stream {
		return &apiError{http.StatusOK, "pdsim: the stream ends before its first event"}
	}
	return &apiError{http.StatusInternalServerError, "Internal processing error"}
}
