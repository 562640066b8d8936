package pdsim

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// An engine started with --api-key answers 401 {"error": "Unauthorized"} to
// a caller without its key on every path but its health, load, version and
// metrics ones, and serves one that has it.
func TestAPIKey(t *testing.T) {
	s := start(t, Config{APIKey: "sk-engine"})
	open := start(t, Config{})
	chat := `{"model":"pdsim","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	tests := []struct {
		name          string
		s             *Server
		method, path  string
		body          string
		authorization string
		want          int
	}{
		{"chat without the key", s, "POST", "/v1/chat/completions", chat, "", 401},
		{"chat with another key", s, "POST", "/v1/chat/completions", chat, "Bearer sk-other", 401},
		{"chat with the key, not as a bearer token", s, "POST", "/v1/chat/completions", chat, "Basic sk-engine", 401},
		{"chat with the key", s, "POST", "/v1/chat/completions", chat, "Bearer sk-engine", 200},
		{"models without the key", s, "GET", "/v1/models", "", "", 401},
		{"models with the key", s, "GET", "/v1/models", "", "bearer sk-engine", 200},
		{"tokenize without the key", s, "POST", "/tokenize", `{"prompt":"hi"}`, "", 401},
		{"health", s, "GET", "/health", "", "", 200},
		{"metrics", s, "GET", "/metrics", "", "", 200},
		{"no key asked", open, "POST", "/v1/chat/completions", chat, "", 200},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(tc.method, "http://"+tc.s.Addr()+tc.path, strings.NewReader(tc.body))
			req.Header.Set("Content-Type", "application/json")
			if tc.authorization != "" {
				req.Header.Set("Authorization", tc.authorization)
			}
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.want {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.want, body)
			}
			if tc.want == 401 && strings.TrimSpace(string(body)) != `{"error":"Unauthorized"}` {
				t.Errorf("body %s, want vLLM's {\"error\":\"Unauthorized\"}", body)
			}
		})
	}
}
