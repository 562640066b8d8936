package pdsim

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
)

// tokenizeResponse is vLLM's TokenizeResponse, its fields in order.
type tokenizeResponse struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []uint64 `json:"tokens"`
	TokenStrs   []string `json:"token_strs"`
}

// tokenize serves vLLM's POST /tokenize: {"prompt"} as /v1/completions reads
// it (a string, or token ids, which stay themselves), or {"messages"} as
// /v1/chat/completions does, tokenized exactly as the engine caches that
// prompt, so the ids cut into blocks are the token_ids of the KV events the
// request causes. A chat's tokens are its messages': tools,
// add_generation_prompt and add_special_tokens change nothing in the
// simulated template, and documents and reasoning_effort, which the
// template renders before them (chatPrompt), are not fields of vLLM's
// /tokenize: given as chat_template_kwargs, they are rendered alike.
// SGLang's takes a prompt only (TokenizeRequest, python/sglang/srt/
// entrypoints/openai/serving_tokenize.py), and refuses messages alone.
func (s *Server) tokenize(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil || fields == nil {
		s.writeError(w, badRequest("JSON decode error: the body must be a JSON object"))
		return
	}
	if raw, ok := present(fields, "model"); ok {
		var model string
		if json.Unmarshal(raw, &model) != nil {
			s.writeError(w, badRequest("model: Input should be a valid string"))
			return
		}
		if !s.serves(model) {
			s.writeError(w, &apiError{http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", model)})
			return
		}
	}
	api := apiCompletion
	raw, key := api.prompt(fields)
	if _, ok := present(fields, "messages"); ok && s.cfg.Protocol != ProtocolSGLang {
		api, raw, key = apiChat, chatPrompt(fields, false), "messages"
	}
	if raw == nil {
		s.writeError(w, badRequest("%s: Field required", key))
		return
	}
	prompt, err := api.decodePrompt(raw)
	if err != nil {
		s.writeError(w, badRequest("%s: %v", key, err))
		return
	}
	tokens := append([]uint64{}, tokenize(prompt)...) // [] for an empty prompt, not null
	writeJSON(w, http.StatusOK, tokenizeResponse{Count: len(tokens), MaxModelLen: s.cfg.MaxModelLen, Tokens: tokens})
}

// render serves vLLM's render endpoints (POST /v1/chat/completions/render,
// /v1/completions/render, /v1/responses/render): the request validated as
// its endpoint does (a previous_response_id it does not store is a 404), and
// its ids as the endpoint computes them, {"token_ids": [...]} in vLLM's
// GenerateRequest (a list of them for completions). Older vLLM releases
// and SGLang have none (Config.NoRender).
func (s *Server) render(api apiKind) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if status := s.renderFails(); status != 0 {
			s.writeErrorFor(api, w, &apiError{status, "pdsim: injected render failure"})
			return
		}
		body, _ := io.ReadAll(r.Body)
		req, aerr := s.parseRequest(api, r.Header.Get("X-Request-Id"), body)
		if aerr != nil {
			s.writeErrorFor(api, w, aerr)
			return
		}
		rendered := map[string]any{"request_id": req.id, "token_ids": append([]uint64{}, req.tokens...), "model": req.model}
		if api == apiCompletion {
			writeJSON(w, http.StatusOK, []any{rendered})
			return
		}
		writeJSON(w, http.StatusOK, rendered)
	}
}
