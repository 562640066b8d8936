package server

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/go-logr/logr/funcr"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
)

// logLines collects JSON log lines at verbosity 2 (protocol detail).
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) add(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, s)
}

func (l *logLines) all(t *testing.T) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, s := range l.lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			t.Fatalf("log line is not JSON: %s", s)
		}
		out = append(out, m)
	}
	return out
}

func (l *logLines) raw() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

func TestOneRequestLinePerRequestWithIDAndNoSecrets(t *testing.T) {
	const (
		prompt = "SECRET-PROMPT-TEXT"
		token  = "Bearer sk-secret-token"
		id     = "req-7"
	)
	chat := `{"model":"m","messages":[{"role":"user","content":"` + prompt + `"}]}`
	tests := []struct {
		name       string
		prefill    http.HandlerFunc
		body       string
		logPrompts bool
		want       map[string]any // fields of the "request" line
		wantLines  []string       // other messages that must appear, carrying the request id
	}{
		{
			name: "P/D routed", prefill: prefillOK, body: chat,
			want:      map[string]any{"mode": "pd", "reason": "long_prompt", "outcome": "routed", "api": "chat", "decode": decodeEP, "bodyBytes": float64(len(chat))},
			wantLines: []string{"request headers"},
		},
		{
			name: "prefill failure falls back", prefill: enginetest.JSON(503, `{}`), body: chat,
			want:      map[string]any{"mode": "decode_only", "reason": "prefill_failed", "outcome": "routed", "decode": decodeEP},
			wantLines: []string{"prefill failed; decode will recompute the prompt"},
		},
		{
			name: "rejected", prefill: prefillOK, body: `{"model":"` + strings.Repeat("m", 1025) + `","messages":"` + prompt + `"}`,
			want: map[string]any{"mode": "none", "outcome": "4xx", "status": float64(400)},
		},
		{
			name: "prompts logged only when asked", prefill: prefillOK, body: chat, logPrompts: true,
			want: map[string]any{"outcome": "routed", "body": chat},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			logs := &logLines{}
			log := funcr.NewJSON(logs.add, funcr.Options{Verbosity: 2})
			prefill := enginetest.Start(t, tt.prefill)
			r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
				prefill.Addr(), decodeEP), Options{LogPrompts: tt.logPrompts}, log)
			r.exchange(t, post(chatPath, tt.body, hdr{"x-request-id", id}, hdr{"authorization", token}, hdr{"cookie", "session=abc"})...)

			var requestLines []map[string]any
			seen := map[string]bool{}
			for _, line := range logs.all(t) {
				logger, _ := line["logger"].(string)
				// The pools' background work (pipeline/scheduling: the engines'
				// model lists, their server info) belongs to no request.
				perRequest := strings.HasPrefix(logger, "extproc") || strings.HasPrefix(logger, "pipeline") && !strings.HasPrefix(logger, "pipeline/scheduling")
				if perRequest {
					if line["requestID"] != id {
						t.Errorf("per-request line without requestID %q: %v", id, line)
					}
				}
				msg, _ := line["msg"].(string)
				seen[msg] = true
				if msg == "request" {
					requestLines = append(requestLines, line)
				}
				if h, ok := line["headers"].(map[string]any); ok {
					if h["authorization"] != "[REDACTED]" || h["cookie"] != "[REDACTED]" || h[":path"] != chatPath {
						t.Errorf("logged headers %v: want authorization and cookie redacted, others kept", h)
					}
				}
			}
			if len(requestLines) != 1 {
				t.Fatalf("%d \"request\" lines, want exactly 1:\n%s", len(requestLines), logs.raw())
			}
			for k, want := range tt.want {
				if got := requestLines[0][k]; got != want {
					t.Errorf("request line %s = %v, want %v", k, got, want)
				}
			}
			for _, k := range []string{"processing", "prefillTime", "prefill"} {
				if _, ok := requestLines[0][k]; !ok {
					t.Errorf("request line lacks %s: %v", k, requestLines[0])
				}
			}
			for _, msg := range tt.wantLines {
				if !seen[msg] {
					t.Errorf("no %q line:\n%s", msg, logs.raw())
				}
			}
			raw := logs.raw()
			if strings.Contains(raw, "sk-secret") || strings.Contains(raw, "session=abc") {
				t.Errorf("a secret header value reached the logs:\n%s", raw)
			}
			if strings.Contains(raw, prompt) != tt.logPrompts {
				t.Errorf("prompt text in logs = %v, want %v (--log-prompts):\n%s", !tt.logPrompts, tt.logPrompts, raw)
			}
		})
	}
}
