package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// Outside Kubernetes nothing takes a stopping replica out of Envoy's
// rotation before it stops listening but Envoy's own health checks. With a
// shutdown delay, SIGTERM turns health NOT_SERVING while new streams are still
// routed, until the delay runs out or a second signal cuts it short; then the
// listener closes. Without one it closes at once, as before.
func TestShutdownDelayServesNewStreamsWhileNotReady(t *testing.T) {
	tests := []struct {
		name  string
		delay time.Duration
		end   func(r *running, over chan<- time.Time) // ends the delay
	}{
		{name: "no delay: the listener closes at SIGTERM"},
		{name: "the delay runs out", delay: time.Hour, end: func(_ *running, over chan<- time.Time) { over <- time.Now() }},
		{name: "a second SIGTERM ends it", delay: time.Hour, end: func(r *running, _ chan<- time.Time) { r.signals <- syscall.SIGTERM }},
		{name: "an interrupt ends it", delay: time.Hour, end: func(r *running, _ chan<- time.Time) { r.signals <- os.Interrupt }},
	}
	prefill := enginetest.Start(t, prefillOK)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
				prefill.Addr(), decodeEP), Options{ShutdownDelay: tt.delay, Grace: time.Minute}, logr.Discard())
			over := make(chan time.Time, 1)
			r.after = func(d time.Duration) <-chan time.Time {
				if d != tt.delay {
					t.Errorf("the delay waited for is %s, want %s", d, tt.delay)
				}
				return over
			}

			r.signals <- syscall.SIGTERM
			select {
			case <-r.draining:
			case <-time.After(10 * time.Second):
				t.Fatal("SIGTERM did not begin the shutdown")
			}
			if tt.end != nil {
				replies, err := r.tryExchange(post(chatPath, `{"model":"m","prompt":"hi"}`)...)
				if err != nil || len(replies) == 0 || destination(replies[0]) != decodeEP {
					t.Errorf("a stream opened during the delay = %v, %v; want it routed to %s", replies, err, decodeEP)
				}
				for _, svc := range []string{"", extProcService, "readiness"} {
					resp, err := r.ready.health.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
					if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
						t.Errorf("health of %q during the delay = %v, %v; want NOT_SERVING", svc, resp.GetStatus(), err)
					}
				}
				if code, body := r.get(t, "/readyz"); code != http.StatusServiceUnavailable {
					t.Errorf("/readyz during the delay = %d %q, want 503", code, body)
				}
				tt.end(r, over)
			}
			if err := r.wait(t); err != nil {
				t.Errorf("Serve = %v, want a clean shutdown", err)
			}
			if c, err := net.Dial("tcp", r.grpcAddr); err == nil {
				c.Close()
				t.Errorf("the ext_proc listener still accepts once the server stopped")
			}
		})
	}
}

// SIGHUP asks a daemon to read its config again; Go's default for it is to
// exit, and pd-extproc exited with no drain. It reads --config at once, and
// says so, whether running or in the shutdown delay, and serves on.
func TestSIGHUPReadsTheConfigAgain(t *testing.T) {
	tests := []struct {
		name      string
		file      string // the --config file's content; "" none given
		delaying  bool   // SIGHUP comes during the shutdown delay
		wantLines []string
	}{
		{name: "a file rejected before is rejected again", file: "connector: kv-nixl\npools: {decode: {endpoints: 7}}\n",
			wantLines: []string{"SIGHUP: reading the config file again", "config change rejected"}},
		{name: "during the shutdown delay", file: "connector: kv-nixl\npools: {decode: {endpoints: 7}}\n", delaying: true,
			wantLines: []string{"SIGHUP: reading the config file again", "config change rejected"}},
		{name: "no --config", wantLines: []string{"SIGHUP: no --config file to read again"}},
	}
	prefill := enginetest.Start(t, prefillOK)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := Options{Grace: time.Minute}
			if tt.file != "" {
				opts.ConfigPath = filepath.Join(t.TempDir(), "extproc.yaml")
				if err := os.WriteFile(opts.ConfigPath, []byte(tt.file), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if tt.delaying {
				opts.ShutdownDelay = time.Hour
			}
			lines := make(chan string, 1024)
			r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
				prefill.Addr(), decodeEP), opts, funcr.NewJSON(func(s string) { lines <- s }, funcr.Options{}))
			if tt.file != "" {
				awaitLine(t, lines, "config change rejected") // the watch's first read
			}
			if tt.delaying {
				r.signals <- syscall.SIGTERM
				awaitLine(t, lines, "shutting down")
			}
			r.signals <- syscall.SIGHUP
			for _, want := range tt.wantLines {
				awaitLine(t, lines, want)
			}
			replies, err := r.tryExchange(post(chatPath, `{"model":"m","prompt":"hi"}`)...)
			if err != nil || len(replies) == 0 || destination(replies[0]) != decodeEP {
				t.Errorf("a stream opened after SIGHUP = %v, %v; want it routed to %s", replies, err, decodeEP)
			}
			if tt.delaying {
				r.signals <- syscall.SIGTERM // the delay went on: end it
			}
		})
	}
}

// awaitLine waits, bounded, for the next log line whose message starts with
// prefix, passing over the others, and returns its fields.
func awaitLine(t *testing.T, lines <-chan string, prefix string) map[string]any {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case l := <-lines:
			var m map[string]any
			if err := json.Unmarshal([]byte(l), &m); err != nil {
				t.Fatalf("log line is not JSON: %s", l)
			}
			if msg, _ := m["msg"].(string); strings.HasPrefix(msg, prefix) {
				return m
			}
		case <-timeout:
			t.Fatalf("no log line %q", prefix)
			return nil
		}
	}
}

// breakingListener fails its Accept with err once broken, as a listener
// whose socket the system took away does.
type breakingListener struct {
	net.Listener
	err atomic.Pointer[error]
}

func (l *breakingListener) breakWith(err error) {
	l.err.Store(&err)
	l.Listener.Close()
}

func (l *breakingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if broke := l.err.Load(); err != nil && broke != nil {
		return nil, *broke
	}
	return c, err
}

// A listener that fails mid-run begins the shutdown; its error was logged
// only when Serve returned, after the delay and the grace, so the
// "shutting down" line an operator reads first gave no cause. It names the
// error at once, and Serve still returns it.
func TestAListenerFailureIsLoggedWhenTheShutdownBegins(t *testing.T) {
	for _, name := range []string{"ext_proc", "admin"} {
		t.Run(name, func(t *testing.T) {
			cfg, err := config.Parse([]byte(fmt.Sprintf("connector: kv-nixl\npools: {decode: {endpoints: [%q]}}", decodeEP)))
			if err != nil {
				t.Fatal(err)
			}
			lines := make(chan string, 1024)
			signals := make(chan os.Signal, 1)
			s, err := New(cfg, Options{ShutdownDelay: time.Hour, Grace: time.Minute, Signals: signals},
				funcr.NewJSON(func(s string) { lines <- s }, funcr.Options{}))
			if err != nil {
				t.Fatal(err)
			}
			s.after = func(time.Duration) <-chan time.Time { return nil } // the delay ends only by a signal
			var lis [2]*breakingListener
			for i := range lis {
				l, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				lis[i] = &breakingListener{Listener: l}
			}
			served := make(chan error, 1)
			go func() { served <- s.Serve(context.Background(), lis[0], lis[1]) }()

			broke := errors.New("accept: the socket is gone")
			lis[map[string]int{"ext_proc": 0, "admin": 1}[name]].breakWith(broke)
			line := awaitLine(t, lines, "shutting down")
			if line["error"] != broke.Error() {
				t.Errorf("the shutting-down line = %v; want error %q", line, broke)
			}
			signals <- syscall.SIGTERM // ends the delay
			select {
			case err := <-served:
				if !errors.Is(err, broke) {
					t.Errorf("Serve = %v, want %v", err, broke)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Serve did not return")
			}
		})
	}
}

// Once the listener has closed, streams in flight get --shutdown-grace
// (the shipped Deployment's is 555 s). A signal then (the second with no
// delay, the third after one a second signal ended) cuts them and ends the
// process now, as an operator pressing ctrl-C again expects; it was
// ignored. SIGHUP still only reads the config.
func TestAnotherSignalDuringTheGraceCutsTheStreams(t *testing.T) {
	tests := []struct {
		name    string
		delay   time.Duration
		signals []os.Signal // after the first SIGTERM, once the stream is held
		cut     bool
		line    string // logged for the last signal
	}{
		{name: "no delay: a second SIGTERM", signals: []os.Signal{syscall.SIGTERM}, cut: true,
			line: "another signal: cutting the remaining streams and prefill legs now"},
		{name: "a second signal ended the delay, a third", delay: time.Hour, signals: []os.Signal{syscall.SIGTERM, os.Interrupt}, cut: true,
			line: "another signal: cutting the remaining streams and prefill legs now"},
		{name: "SIGHUP cuts nothing", signals: []os.Signal{syscall.SIGHUP}, line: "SIGHUP: no --config file to read again"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			release := make(chan struct{})
			prefill := enginetest.Start(t, blocked(release, prefillOK))
			defer close(release)
			lines := make(chan string, 1024)
			r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
				prefill.Addr(), decodeEP), Options{ShutdownDelay: tt.delay, Grace: time.Hour}, funcr.NewJSON(func(s string) { lines <- s }, funcr.Options{}))
			r.after = func(time.Duration) <-chan time.Time { return nil } // the delay ends only by a signal

			done := make(chan error, 1)
			go func() {
				replies, err := r.tryExchange(post(chatPath, `{"model":"m","prompt":"hi"}`)...)
				if err == nil && (len(replies) == 0 || destination(replies[0]) != decodeEP) {
					err = fmt.Errorf("replies %v, not routed to %s", replies, decodeEP)
				}
				done <- err
			}()
			prefill.Await(t) // the stream is in flight, held by the prefill leg
			r.signals <- syscall.SIGTERM
			for _, sig := range tt.signals {
				r.signals <- sig // each waits until the one before was taken
			}
			awaitLine(t, lines, tt.line)
			if !tt.cut {
				release <- struct{}{}
			}
			select {
			case err := <-done:
				if tt.cut != (err != nil) {
					t.Errorf("the stream in flight ended with %v; want it cut: %v", err, tt.cut)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the stream in flight is still held: the signal did not cut it")
			}
			if err := r.wait(t); err != nil {
				t.Errorf("Serve = %v, want a clean shutdown", err)
			}
		})
	}
}
