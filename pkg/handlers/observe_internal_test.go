package handlers

import "testing"

func TestRedactAndTruncate(t *testing.T) {
	redactions := []struct{ key, value, want string }{
		{"authorization", "Bearer sk-1", "[REDACTED]"},
		{"proxy-authorization", "Basic x", "[REDACTED]"},
		{"cookie", "session=abc", "[REDACTED]"},
		{"x-api-key", "k", "[REDACTED]"},
		{"x-request-id", "req-1", "req-1"},
		{":path", "/v1/completions", "/v1/completions"},
		// Not on the list: redacted whatever they are.
		{"x-goog-api-key", "AIza-1", "[REDACTED]"},
		{"x-auth-token", "t", "[REDACTED]"},
		{"x-forwarded-for", "198.51.100.7", "[REDACTED]"},
		{"x-anything-new", "v", "[REDACTED]"},
		// The path without its query.
		{":path", "/v1/completions?api_key=sk-2&x=1", "/v1/completions?[REDACTED]"},
		{"content-type", "application/json", "application/json"},
		{"traceparent", "00-1-2-01", "00-1-2-01"},
	}
	for _, tt := range redactions {
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
