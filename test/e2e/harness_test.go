// Package e2e runs the whole path on loopback: the Envoy emulator (driven by
// config/envoy/envoy.yaml), the real extproc binary, and engine simulators.
package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// extprocBin is built once for the package from the working tree.
var extprocBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "pd-e2e")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if extprocBin, err = testbed.BuildExtproc(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// extproc is a running extproc process and what it has logged.
type extproc struct {
	*testbed.Extproc
	log *logBuffer
}

// logBuffer keeps every line a process logs.
type logBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Logs returns what the process has logged so far.
func (x *extproc) Logs() string { return x.log.String() }

// waitLog waits, bounded, until extproc has logged a line containing s.
func (x *extproc) waitLog(t *testing.T, s string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(x.Logs(), s) {
		if time.Now().After(deadline) {
			t.Fatalf("extproc never logged %q:\n%s", s, x.Logs())
		}
		time.Sleep(10 * time.Millisecond) // polling a log we do not control: bounded above
	}
}

// startExtproc runs the binary with cfg (its Config, and the addresses or
// the wait when they matter) at -v 1, every log line written at once, and
// shows its logs when the test fails.
func startExtproc(t *testing.T, cfg testbed.ExtprocConfig) *extproc {
	t.Helper()
	x := &extproc{log: &logBuffer{}}
	// Registered first, so it runs once the process has stopped.
	t.Cleanup(func() {
		for _, s := range beyondLoopback(x.Logs()) {
			t.Errorf("extproc reached beyond loopback: %s", s)
		}
		if t.Failed() {
			t.Logf("extproc logs:\n%s", x.Logs())
		}
	})
	cfg.Bin, cfg.Log = extprocBin, x.log
	cfg.Args = append([]string{"-v", "1", "--log-flush-interval", "0"}, cfg.Args...)
	x.Extproc = testbed.MustStartExtproc(t, cfg)
	return x
}

// beyondLoopback lists what extproc's log shows it reached off the host: a
// pool endpoint that is no loopback address (the pools ask each for its
// models), and a DNS query (Go's resolver names the server: "lookup NAME on
// SERVER"). Another host may answer, or drop packets until a timeout.
func beyondLoopback(logs string) []string {
	var found []string
	for line := range strings.Lines(logs) {
		found = append(found, dnsQuery.FindAllString(line, -1)...)
		var kv map[string]any
		if json.Unmarshal([]byte(line), &kv) != nil {
			continue
		}
		for _, key := range []string{"prefill", "decode", "endpoint"} {
			addrs, _ := kv[key].([]any)
			if s, ok := kv[key].(string); ok {
				addrs = []any{s}
			}
			for _, a := range addrs {
				s, _ := a.(string)
				if ap, err := netip.ParseAddrPort(s); err == nil && !ap.Addr().IsLoopback() {
					found = append(found, key+" "+s)
				}
			}
		}
	}
	slices.Sort(found)
	return slices.Compact(found)
}

var dnsQuery = regexp.MustCompile(`lookup \S+ on [^\s"]+:\d+`)

// The check reads extproc's own lines (as it logs them at -v 1).
func TestBeyondLoopbackReadsExtprocsLog(t *testing.T) {
	for _, tt := range []struct{ name, line, want string }{
		{"a static endpoint", `{"msg":"extproc serving","grpc":"127.0.0.1:3","prefill":[],"decode":["10.1.1.1:8000"]}`, "decode 10.1.1.1:8000"},
		{"one found and asked", `{"msg":"the models the engine serves","pool":"decode","endpoint":"[fd00::1]:8000"}`, "endpoint [fd00::1]:8000"},
		{"a DNS query", `{"msg":"DNS lookup failed","error":"lookup decode.invalid on 10.255.255.53:53: no such host"}`, "lookup decode.invalid on 10.255.255.53:53"},
		{"all on loopback", `{"msg":"request","prefill":"127.0.0.1:4","decode":"[::1]:5","endpoint":"127.0.0.2:6"}`, ""},
		{"a name no resolver asks for", `{"msg":"DNS lookup failed","error":"lookup ` + strings.Repeat("x", 64) + `.invalid: no such host"}`, ""},
	} {
		if got := strings.Join(beyondLoopback(tt.line+"\n"), "; "); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}

// logTo sends a simulator's lines to the test log (shown on failure or -v).
func logTo(t *testing.T) testbed.LineFunc {
	return func(line string) { t.Log(line) }
}

// poolQuestion says whether r is what pd-extproc's pools ask of every
// engine on their own (GET /v1/models, the models it serves), not a leg of
// a client's request: fakes that count legs leave it out.
func poolQuestion(r *http.Request) bool {
	return r.Method == http.MethodGet && r.URL.Path == "/v1/models"
}
