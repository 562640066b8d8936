package server

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
)

// With no decode engine configured (the embedded default names none) the
// server starts, is not ready, and says what to set.
func TestNoDecodePoolServesNotReadyAndSaysWhatToSet(t *testing.T) {
	logs := &logLines{}
	r := start(t, "connector: kv-nixl\n", Options{}, funcr.NewJSON(logs.add, funcr.Options{}))
	if code, body := r.get(t, "/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz = %d %q, want 503", code, body)
	}
	line := waitLogLine(t, logs, "no decode engine is configured")
	msg := line["msg"].(string)
	for _, want := range []string{"pools.decode.endpoints", "pools.decode.dns", "pools.decode.kubernetes", "--config"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the line does not name %s: %q", want, msg)
		}
	}
	if line["config"] != "the embedded default config (no --config given)" {
		t.Errorf("config = %v, want the embedded default named", line["config"])
	}
}

// waitLogLine waits, bounded, for a line whose message starts with prefix.
func waitLogLine(t *testing.T, logs *logLines, prefix string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		for _, l := range logs.all(t) {
			if msg, _ := l["msg"].(string); strings.HasPrefix(msg, prefix) {
				return l
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log line %q:\n%s", prefix, logs.raw())
		}
		time.Sleep(10 * time.Millisecond) // the watch runs on its own goroutine: poll, bounded
	}
}
