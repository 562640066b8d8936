package pdsim

import (
	"bytes"
	"io"
	"net/http"
)

// otherRoutes are the engine endpoints besides inference that a gateway may
// pass through (embeddings, tokenizing, stored responses), and admin ones it
// must never let through. All are recorded, so a test can tell which body
// reached which engine, and that no admin request reached any.
func (s *Server) otherRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /v1/embeddings", s.recorded(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"object": "list", "model": s.cfg.Model,
			"data":  []map[string]any{{"object": "embedding", "index": 0, "embedding": []float64{0.25, -0.5, 1}}},
			"usage": map[string]int{"prompt_tokens": 1, "total_tokens": 1}})
	}))
	tokenize := s.recorded(s.tokenize)
	detokenize := s.recorded(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"prompt": "tok0"})
	})
	if !s.cfg.NoRender && s.cfg.Protocol != ProtocolSGLang {
		mux.HandleFunc("POST /v1/chat/completions/render", s.recorded(s.render(apiChat)))
		mux.HandleFunc("POST /v1/completions/render", s.recorded(s.render(apiCompletion)))
		mux.HandleFunc("POST /v1/responses/render", s.recorded(s.render(apiResponses)))
	}
	mux.HandleFunc("POST /tokenize", tokenize)
	mux.HandleFunc("POST /detokenize", detokenize)
	if s.cfg.Protocol == ProtocolSGLang { // SGLang's /v1 spellings; vLLM has none (vllm/entrypoints/serve/tokenize/api_router.py)
		mux.HandleFunc("POST /v1/tokenize", tokenize)
		mux.HandleFunc("POST /v1/detokenize", detokenize)
	}
	// vLLM's Anthropic API counts a Messages request's input tokens.
	mux.HandleFunc("POST /v1/messages/count_tokens", s.recorded(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]int{"input_tokens": 2})
	}))
	stored := s.recorded(s.storedResponse)
	mux.HandleFunc("GET /v1/responses/{id}", stored)
	mux.HandleFunc("POST /v1/responses/{id}/cancel", stored)
	for _, admin := range []string{"/flush_cache", "/reset_prefix_cache", "/start_profile", "/stop_profile", "/sleep", "/wake_up", "/collective_rpc"} {
		mux.HandleFunc(admin, s.recorded(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/flush_cache" || r.URL.Path == "/reset_prefix_cache" { // SGLang's and vLLM's (dev mode)
				s.ResetPrefixCache()
			}
			writeJSON(w, http.StatusOK, map[string]string{})
		}))
	}
}

// ResetPrefixCache forgets every cached block, as an eviction of all of them
// or an engine restart would.
func (s *Server) ResetPrefixCache() { s.metrics.cache.reset() }

// CachedBlocks is how many blocks the prefix cache holds now.
func (s *Server) CachedBlocks() int { return s.metrics.cache.len() }

// recorded serves a request with answer after recording it with its body.
func (s *Server) recorded(answer http.HandlerFunc) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		ex := s.begin(r, body)
		w := &statusWriter{ResponseWriter: rw}
		defer func() {
			ex.rec.Status = w.status
			s.finish(ex)
		}()
		answer(w, r)
	}
}
