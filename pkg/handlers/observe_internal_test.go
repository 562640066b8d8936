package handlers

import "testing"

func TestRedactAndTruncate(t *testing.T) {
	// Headers off the allowlist (loggedHeaders) are redacted whatever they
	// are: the well-known credentials, other APIs' keys, client addresses and
	// headers nobody has thought of.
	for _, h := range []struct{ key, value string }{
		{"authorization", "Bearer sk-1"},
		{"proxy-authorization", "Basic x"},
		{"cookie", "session=abc"},
		{"x-api-key", "k"},
		{"x-goog-api-key", "AIza-1"},
		{"x-auth-token", "t"},
		{"x-forwarded-for", "198.51.100.7"},
		{"x-envoy-external-address", "198.51.100.7"}, // Envoy sets it with use_remote_address
		{"x-anything-new", "v"},
	} {
		if got := redact(h.key, h.value); got != "[REDACTED]" {
			t.Errorf("redact(%q) = %q, want [REDACTED]", h.key, got)
		}
	}
	// Those on it are logged as they are, the path without its query.
	allowed := []struct{ key, value, want string }{
		{"x-request-id", "req-1", "req-1"},
		{":path", "/v1/completions", "/v1/completions"},
		{":path", "/v1/completions?api_key=sk-2&x=1", "/v1/completions?[REDACTED]"},
		{"content-type", "application/json", "application/json"},
		{"traceparent", "00-1-2-01", "00-1-2-01"},
	}
	for _, tt := range allowed {
		if got := redact(tt.key, tt.value); got != tt.want {
			t.Errorf("redact(%q) = %q, want %q", tt.key, got, tt.want)
		}
	}
	truncations := []struct {
		in   string
		n    int
		want string
	}{
		{"short", 10, "short"},
		{"abcdef", 3, "abc…[truncated]"},
		{"aé", 2, "a…[truncated]"}, // never half a rune
	}
	for _, tt := range truncations {
		if got := truncate([]byte(tt.in), tt.n); got != tt.want {
			t.Errorf("truncate(%q, %d) = %q, want %q", tt.in, tt.n, got, tt.want)
		}
	}
}
