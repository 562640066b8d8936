package handlers_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

func TestErrorsReachTheClientAsOpenAIStyleLocalReplies(t *testing.T) {
	badLong := `{"model":"m","prompt":"caf` + "\xe9 " + strings.Repeat("a", 100_000) + `"}`
	const engine400 = `{"object":"error","message":"Stream options can only be defined when stream=True.","type":"BadRequestError","code":400}`
	tests := []struct {
		name        string
		config      string // pools and policy; %s is a prefill endpoint answering with prefillAnswer
		prefill     func(http.ResponseWriter, *http.Request)
		msgs        []*extprocv3.ProcessingRequest
		wantStatus  int
		wantMessage string // substring of error.message; "" when the engine's own body is expected
		wantRaw     string
	}{
		{
			name: "STREAMED mode names the supported modes", wantStatus: 500, wantMessage: "FULL_DUPLEX_STREAMED, BUFFERED or NONE",
			msgs: []*extprocv3.ProcessingRequest{postHeaders(filterv3.ProcessingMode_STREAMED, chatPath, clientChat)},
		},
		{
			name: "BUFFERED_PARTIAL body cut at the buffer limit", wantStatus: 500, wantMessage: "FULL_DUPLEX_STREAMED, BUFFERED or NONE",
			msgs: []*extprocv3.ProcessingRequest{postHeaders(filterv3.ProcessingMode_BUFFERED_PARTIAL, chatPath, clientChat), requestBody(clientChat[:20], false)},
		},
		{
			name: "NONE mode with a body that could not be scrubbed", wantStatus: 500, wantMessage: "FULL_DUPLEX_STREAMED or BUFFERED",
			msgs: []*extprocv3.ProcessingRequest{postHeaders(filterv3.ProcessingMode_NONE, chatPath, clientChat)},
		},
		{
			name: "invalid JSON", wantStatus: 400, wantMessage: "not valid JSON",
			msgs: []*extprocv3.ProcessingRequest{postHeaders(fullDuplex, chatPath, `{"model":`), requestBody(`{"model":`, true)},
		},
		{
			// Found in the first chunk, while the rest arrives: still one 400 at the end.
			name: "invalid UTF-8 early in a long chunked body", wantStatus: 400, wantMessage: "not valid UTF-8",
			msgs: append([]*extprocv3.ProcessingRequest{postHeaders(fullDuplex, chatPath, badLong)}, split(badLong, 5)...),
		},
		{
			name: "missing model", wantStatus: 400, wantMessage: `no "model"`,
			msgs: []*extprocv3.ProcessingRequest{postHeaders(buffered, chatPath, `{"prompt":"x"}`), requestBody(`{"prompt":"x"}`, true)},
		},
		{
			name: "unknown path", wantStatus: 404, wantMessage: "unknown path",
			msgs: []*extprocv3.ProcessingRequest{postHeaders(fullDuplex, "/v1/embeddings", clientChat), requestBody(clientChat, true)},
		},
		{
			name: "content-length over the limit is refused before the body", wantStatus: 413, wantMessage: "limits.max_body_bytes",
			config: "limits: {max_body_bytes: 100}\n",
			msgs:   []*extprocv3.ProcessingRequest{postHeaders(fullDuplex, chatPath, strings.Repeat("x", 101))},
		},
		{
			name: "chunked body growing over the limit", wantStatus: 413, wantMessage: "limits.max_body_bytes",
			config: "limits: {max_body_bytes: 100}\n",
			msgs: []*extprocv3.ProcessingRequest{requestHeaders(fullDuplex, false, hdr{":method", "POST"}, hdr{":path", chatPath}),
				requestBody(strings.Repeat("x", 60), false), requestBody(strings.Repeat("x", 60), false)},
		},
		{
			name: "prefill engine 4xx is returned as is", wantStatus: 400, wantRaw: engine400,
			prefill: enginetest.JSON(400, engine400),
			msgs:    []*extprocv3.ProcessingRequest{postHeaders(fullDuplex, chatPath, clientChat), requestBody(clientChat, true)},
		},
		{
			name: "prefill 5xx with on_failure fail", wantStatus: 502, wantMessage: "prefill leg failed",
			config: "prefill: {on_failure: fail}\n", prefill: enginetest.JSON(503, `{}`),
			msgs: []*extprocv3.ProcessingRequest{postHeaders(fullDuplex, chatPath, clientChat), requestBody(clientChat, true)},
		},
		{
			name: "prefill unreachable with on_failure fail", wantStatus: 503, wantMessage: "prefill leg failed",
			config: "prefill: {on_failure: fail}\n",
			msgs:   []*extprocv3.ProcessingRequest{postHeaders(buffered, chatPath, clientChat), requestBody(clientChat, true)},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefillAddr := "127.0.0.1:1" // nothing listens there
			if tt.prefill != nil {
				prefillAddr = enginetest.Start(t, tt.prefill).Addr()
			}
			c := startServer(t, testConfig(t, tt.config+fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, prefillAddr)), handlers.Options{})
			replies := exchange(t, c, tt.msgs...)
			ir := replies[len(replies)-1].GetImmediateResponse()
			if ir == nil {
				t.Fatalf("want an ImmediateResponse, got %v", replies)
			}
			if got := int(ir.GetStatus().GetCode()); got != tt.wantStatus {
				t.Errorf("status = %d, want %d (body %s)", got, tt.wantStatus, ir.GetBody())
			}
			if tt.wantRaw != "" {
				if string(ir.GetBody()) != tt.wantRaw {
					t.Errorf("body = %s, want the engine's %s", ir.GetBody(), tt.wantRaw)
				}
				return
			}
			status, body := immediateOf(t, replies)
			e, _ := body["error"].(map[string]any)
			if msg, _ := e["message"].(string); !strings.Contains(msg, tt.wantMessage) || e["type"] == nil || e["code"] != float64(status) {
				t.Errorf("error body = %v, want message containing %q, a type and code %d", body, tt.wantMessage, status)
			}
		})
	}
}

func TestFailedPrefillIsRetriedThenFallsBackToDecodeOnly(t *testing.T) {
	tests := []struct {
		name       string
		failures   int32 // how many prefill requests fail, across both endpoints, before they succeed
		wantParams bool
	}{
		{"5xx then success on the other endpoint", 1, true},
		{"both fail: decode recomputes", 2, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var seen atomic.Int32
			answer := func(w http.ResponseWriter, r *http.Request) {
				if seen.Add(1) <= tt.failures {
					enginetest.JSON(503, `{}`)(w, r)
					return
				}
				prefillOK(w, r)
			}
			a, b := enginetest.Start(t, answer), enginetest.Start(t, answer)
			c := startServer(t, testConfig(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q, %q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, a.Addr(), b.Addr())), handlers.Options{})
			replies := exchange(t, c, postHeaders(fullDuplex, chatPath, clientChat), requestBody(clientChat, true))
			decodeBody := streamedBody(t, replies[1:])
			if got := strings.Contains(decodeBody, nixlParams); got != tt.wantParams {
				t.Errorf("decode body has prefill params = %v, want %v: %s", got, tt.wantParams, decodeBody)
			}
			if strings.Contains(decodeBody, "evil") || strings.Contains(decodeBody, "bootstrap_room") {
				t.Errorf("client-supplied transfer fields reached the decode body: %s", decodeBody)
			}
			if na, nb := len(a.Requests()), len(b.Requests()); na != 1 || nb != 1 {
				t.Errorf("prefill attempts = %d + %d, want one on each endpoint", na, nb)
			}
		})
	}
}

// blockingEngine holds each request until released or cancelled, and reports
// how each ended.
type blockingEngine struct {
	*enginetest.Engine
	release chan struct{}
	ended   chan error // ctx error of each request: nil when it completed
}

func newBlockingEngine(t *testing.T, answer func(http.ResponseWriter, *http.Request)) *blockingEngine {
	b := &blockingEngine{release: make(chan struct{}), ended: make(chan error, 10)}
	b.Engine = enginetest.Start(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-b.release:
			answer(w, r)
			b.ended <- nil
		case <-r.Context().Done():
			b.ended <- r.Context().Err()
		}
	})
	return b
}

func (b *blockingEngine) outcome(t *testing.T) error {
	t.Helper()
	select {
	case err := <-b.ended:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("the prefill request neither completed nor was cancelled")
		return nil
	}
}

func TestBufferedSlowPrefillExtendsEnvoysMessageTimer(t *testing.T) {
	prefill := newBlockingEngine(t, prefillOK)
	c := startServer(t, testConfig(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, prefill.Addr())),
		handlers.Options{OverrideAfter: time.Millisecond, OverrideTimeout: 90 * time.Second})
	s, err := c.Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer s.CloseSend()
	s.Send(postHeaders(buffered, chatPath, clientChat))
	s.Send(requestBody(clientChat, true))
	if r, err := s.Recv(); err != nil || r.GetRequestHeaders() == nil {
		t.Fatalf("first reply = %v, %v; want the headers reply", r, err)
	}
	r, err := s.Recv() // the prefill engine is still holding the request
	if err != nil || r.Response != nil || r.GetOverrideMessageTimeout().AsDuration() != 90*time.Second {
		t.Fatalf("reply while prefill runs = %v, %v; want only override_message_timeout 90s", r, err)
	}
	close(prefill.release)
	if r, err := s.Recv(); err != nil || r.GetRequestBody().GetResponse().GetBodyMutation() == nil {
		t.Fatalf("reply after prefill = %v, %v; want the body reply", r, err)
	}
}

func TestStreamEndCancelsSequentialButNotConcurrentPrefill(t *testing.T) {
	tests := []struct {
		connector  string
		wantCancel bool
	}{
		{"kv-nixl", true},    // nobody will use the KV once the client is gone
		{"kv-sglang", false}, // the decode engine is waiting to pair with this leg
	}
	for _, tt := range tests {
		t.Run(tt.connector, func(t *testing.T) {
			prefill := newBlockingEngine(t, prefillOK)
			c := startServer(t, testConfig(t, fmt.Sprintf(`connector: %s
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, tt.connector, prefill.Addr())), handlers.Options{})
			ctx, cancel := context.WithCancel(context.Background())
			s, err := c.Process(ctx)
			if err != nil {
				t.Fatal(err)
			}
			s.Send(postHeaders(fullDuplex, chatPath, clientChat))
			s.Send(requestBody(clientChat, true))
			prefill.Await(t)
			if !tt.wantCancel {
				// Envoy is answered while the concurrent leg is still in flight.
				if r, err := s.Recv(); err != nil || r.GetRequestHeaders() == nil {
					t.Fatalf("reply = %v, %v; want the routing before the prefill completes", r, err)
				}
			}
			cancel() // Envoy resets the stream (the client left, or its replies are all in)
			if tt.wantCancel {
				if err := prefill.outcome(t); err == nil {
					t.Error("the sequential prefill leg was not cancelled with the stream")
				}
				return
			}
			close(prefill.release)
			if err := prefill.outcome(t); err != nil {
				t.Errorf("the concurrent prefill leg was cancelled with the stream: %v", err)
			}
		})
	}
}

func TestOverMaxStreamsIsShedWith429(t *testing.T) {
	c := startServer(t, testConfig(t, `pools: {decode: {endpoints: ["10.1.1.1:8000"]}}`),
		handlers.Options{MaxStreams: 1, RetryAfter: 2 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	held, err := c.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	held.Send(postHeaders(buffered, chatPath, clientChat))
	if r, err := held.Recv(); err != nil || r.GetRequestHeaders() == nil {
		t.Fatalf("held stream: %v, %v", r, err)
	}

	replies := exchange(t, c, postHeaders(fullDuplex, chatPath, clientChat), requestBody(clientChat, true))
	status, body := immediateOf(t, replies)
	retry, _ := headerValue(replies[0].GetImmediateResponse().GetHeaders(), "retry-after")
	if status != 429 || retry != "2" || body["error"] == nil {
		t.Errorf("over the limit: status %d, retry-after %q, body %v; want 429, 2 and an error", status, retry, body)
	}

	cancel() // the held request ends: the next one is served
	held.Recv()
	// The server may take a moment to see the held stream's end: retry, bounded.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		replies = exchange(t, c, requestHeaders(fullDuplex, true, hdr{":method", "GET"}, hdr{":path", "/v1/models"}))
		if replies[0].GetImmediateResponse() == nil {
			break
		}
	}
	if replies[0].GetRequestHeaders() == nil {
		t.Errorf("after the held stream ended: %v", replies[0])
	}
}
