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
