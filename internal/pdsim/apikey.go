package pdsim

import (
	"crypto/subtle"
	"net/http"
	"strings"
)

// The paths an engine started with --api-key answers without the key; every
// other asks for "Authorization: Bearer <key>" and answers 401
// {"error": "Unauthorized"} without it. vLLM leaves out its health, load,
// version and metrics endpoints and guards every route it registers
// (vllm/entrypoints/serve/middleware/authenticate.py, PUBLIC_ENDPOINTS, at
// vLLM baaf6e9c; releases before guarded only /v1 paths); SGLang leaves
// out /health and /metrics (add_api_key_middleware,
// python/sglang/srt/utils.py). The simulator's own /pdsim/ is not an engine's.
var publicPaths = []string{"/health", "/ping", "/load", "/version", "/metrics", "/pdsim"}

// admits reports whether r may be served: no key is asked, r's path is
// public, or r carries the key.
func (s *Server) admits(r *http.Request) bool {
	if s.cfg.APIKey == "" || r.Method == http.MethodOptions {
		return true
	}
	for _, p := range publicPaths {
		if r.URL.Path == p || strings.HasPrefix(r.URL.Path, p+"/") {
			return true
		}
	}
	scheme, key, _ := strings.Cut(r.Header.Get("Authorization"), " ")
	return strings.EqualFold(scheme, "bearer") && subtle.ConstantTimeCompare([]byte(key), []byte(s.cfg.APIKey)) == 1
}
