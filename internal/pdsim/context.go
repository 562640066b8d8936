package pdsim

// defaultMaxModelLen is Config.MaxModelLen's default: the length vLLM
// takes from a small model's config (Qwen2.5-0.5B-Instruct's
// max_position_embeddings).
const defaultMaxModelLen = 32768

// fitsContext refuses, as vLLM does, a request whose output limit, or prompt
// and output limit together, exceed the model's context: vLLM checks the
// limit against max_model_len as it builds the request's TokenizeParams,
// then the prompt's tokens against what the limit leaves
// (TokenizeParams.__post_init__ and _token_len_check,
// vllm/renderers/params.py @ 017638d7). The Responses API and token-in
// generate are not checked here, nor SGLang, whose check and words differ.
func (s *Server) fitsContext(req *request) *apiError {
	if s.cfg.Protocol == ProtocolSGLang || req.api != apiChat && req.api != apiCompletion && req.api != apiMessages {
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
