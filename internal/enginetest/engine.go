// Package enginetest is a fake engine for unit tests: an HTTP server that
// records what it receives and answers as a test tells it to, and a reader
// of JSON bodies as the engines read them. The end-to-end tests use the real
// simulator (internal/pdsim) instead.
package enginetest

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// Request is what the engine received.
type Request struct {
	Body   string
	Header http.Header
}

// Engine is a running fake engine.
type Engine struct {
	*httptest.Server
	mu       sync.Mutex
	requests []Request
	awaited  int           // of requests, how many Await has returned
	arrived  chan struct{} // a request came since Await last looked
}

// model is the one model the engine lists at GET /v1/models, which pools
// ask of every engine; that question is answered apart, neither recorded
// nor given to the test's answer.
const model = "m"

// Start serves answer on loopback until the test ends.
func Start(t testing.TB, answer http.HandlerFunc) *Engine {
	e := &Engine{arrived: make(chan struct{}, 1)}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && r.URL.Path == "/v1/models" {
			JSON(http.StatusOK, `{"object":"list","data":[{"id":"`+model+`","object":"model"}]}`)(w, r)
			return
		}
		b, _ := io.ReadAll(r.Body)
		e.mu.Lock()
		e.requests = append(e.requests, Request{Body: string(b), Header: r.Header.Clone()})
		e.mu.Unlock()
		select { // never blocks: a test's pools scrape and check the engine unawaited
		case e.arrived <- struct{}{}:
		default:
		}
		answer(w, r)
	}))
	t.Cleanup(e.Close)
	return e
}

// Addr is the engine's ip:port, as pools list it.
func (e *Engine) Addr() string { return strings.TrimPrefix(e.URL, "http://") }

// Await waits for the next request, bounded so that a missing one fails the test.
func (e *Engine) Await(t testing.TB) {
	t.Helper()
	for {
		e.mu.Lock()
		if e.awaited < len(e.requests) {
			e.awaited++
			e.mu.Unlock()
			return
		}
		e.mu.Unlock()
		Receive(t, e.arrived, "the engine never received the request")
	}
}

// Receive returns the next value from ch, what an engine fake reports; if
// none comes within 10 s, the test fails saying missing.
func Receive[T any](t testing.TB, ch <-chan T, missing string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatal(missing)
		var zero T
		return zero
	}
}

// Requests returns what the engine received, in order.
func (e *Engine) Requests() []Request {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.requests)
}

// Decode reads b as vLLM and SGLang read a JSON body: numbers exact, the
// last of duplicate keys wins (as encoding/json into a map). Anything but
// one JSON value fails the test.
func Decode(t testing.TB, b []byte) any {
	t.Helper()
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil || d.More() {
		t.Fatalf("not one JSON value (%v): %q", err, b)
	}
	return v
}

// JSON answers status with a JSON body.
func JSON(status int, body string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		io.WriteString(w, body)
	}
}

// StreamError is the event with which vLLM ends a chat or completions stream
// whose request fails after its 200 (finish reason "error": a KV load that
// failed, under kv_load_failure_policy "fail"), as its json.dumps prints it
// (vllm/entrypoints/generate/base/serving.py, _raise_if_error).
const StreamError = "data: {\"error\": {\"message\": \"Internal server error\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n"
