package handlers_test

// The real pipeline's failures as the client sees them, driven without gRPC.

import (
	"cmp"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr/funcr"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

func TestErrorsReachTheClientAsOpenAIStyleLocalReplies(t *testing.T) {
	badLong := `{"model":"m","prompt":"caf` + "\xe9 " + strings.Repeat("a", 100_000) + `"}`
	const engine400 = `{"object":"error","message":"Stream options can only be defined when stream=True.","type":"BadRequestError","code":400}`
	tests := []struct {
		name        string
		config      string // limits and policy, before the pools
		prefill     func(http.ResponseWriter, *http.Request)
		mode        filterv3.ProcessingMode_BodySendMode
		path        string // chatPath when empty
		body        string
		chunks      int  // the body's messages: 0 for none
		noLength    bool // no content-length header
		wantStatus  int
		wantMessage string // substring of error.message; "" when the engine's own body is expected
		wantRaw     string
	}{
		{name: "invalid JSON", mode: fullDuplex, body: `{"model":`, chunks: 1, wantStatus: 400, wantMessage: "not valid JSON"},
		{
			// Found in the first chunk, while the rest arrives: still one 400 at the end.
			name: "invalid UTF-8 early in a long chunked body", mode: fullDuplex, body: badLong, chunks: 5,
			wantStatus: 400, wantMessage: "not valid UTF-8",
		},
		{name: "a model name too long", mode: buffered, body: `{"model":"` + strings.Repeat("m", 1025) + `","prompt":"x"}`, chunks: 1, wantStatus: 400,
			wantMessage: "model names are at most 1024"},
		{name: "unknown path", mode: fullDuplex, path: "/flush_cache", body: clientChat, chunks: 1, wantStatus: 404, wantMessage: "unknown path"},
		{
			name: "content-length over the limit is refused before the body", config: "limits: {max_body_bytes: 100}\n",
			mode: fullDuplex, body: strings.Repeat("x", 101), wantStatus: 413, wantMessage: "limits.max_body_bytes",
		},
		{
			name: "chunked body growing over the limit", config: "limits: {max_body_bytes: 100}\n",
			mode: fullDuplex, body: strings.Repeat("x", 120), chunks: 2, noLength: true, wantStatus: 413, wantMessage: "limits.max_body_bytes",
		},
		{
			name: "prefill engine 4xx is returned as is", prefill: enginetest.JSON(400, engine400),
			mode: fullDuplex, body: clientChat, chunks: 1, wantStatus: 400, wantRaw: engine400,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefillAddr := "127.0.0.1:1" // nothing listens there
			if tt.prefill != nil {
				prefillAddr = enginetest.Start(t, tt.prefill).Addr()
			}
			s := newServer(t, tt.config+fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, prefillAddr), handlers.Options{})
			path := cmp.Or(tt.path, chatPath)
			hs := envoymsg.Post(path, len(tt.body))
			if tt.noLength {
				hs = slices.DeleteFunc(hs, func(h envoymsg.Header) bool { return h[0] == "content-length" })
			}
			msgs := []*extprocv3.ProcessingRequest{envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, hs...), tt.mode, fullDuplex)}
			if tt.chunks > 0 {
				msgs = append(msgs, envoymsg.Chunks(envoymsg.Request, []byte(tt.body), tt.chunks, true)...)
			}
			replies := drive(t, s, msgs...)
			ir := replies[len(replies)-1].GetImmediateResponse()
			if ir == nil {
				t.Fatalf("want an ImmediateResponse, got %v", replies)
			}
			if tt.wantRaw != "" {
				if got := int(ir.GetStatus().GetCode()); got != tt.wantStatus || string(ir.GetBody()) != tt.wantRaw {
					t.Errorf("local reply %d %s, want %d and the engine's %s", got, ir.GetBody(), tt.wantStatus, tt.wantRaw)
				}
				return
			}
			checkOpenAIError(t, replies, tt.wantStatus, tt.wantMessage)
		})
	}
}

// A failure whose cause would tell the client an internal address, or Go's
// transport error (which quotes the leg's URL and query), reaches the client
// as a message naming its request id; the cause is in the request's log line.
// An engine's own 4xx still passes as the engine wrote it (above).
func TestErrorsHideInternalAddressesAndNameTheRequest(t *testing.T) {
	dead := "127.0.0.1:1" // nothing listens there
	tests := []struct {
		name       string
		prefill    func(t *testing.T) string
		wantStatus int
	}{
		{"prefill unreachable", func(*testing.T) string { return dead }, 503},
		{"prefill 5xx", func(t *testing.T) string {
			return enginetest.Start(t, enginetest.JSON(503, `{"detail":"10.0.0.5 is sad"}`)).Addr()
		}, 502},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			addr := tt.prefill(t)
			var mu sync.Mutex
			var logged strings.Builder
			log := funcr.New(func(_, args string) {
				mu.Lock()
				defer mu.Unlock()
				logged.WriteString(args + "\n")
			}, funcr.Options{})
			p := newPipeline(t, fmt.Sprintf("connector: kv-nixl\nprefill: {on_failure: fail}\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
				addr, fakeEndpoint))
			replies := drive(t, handlers.NewServer(p, handlers.Options{}, log),
				envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false,
					envoymsg.Post(chatPath+"?api_key=s3cret", len(clientChat), envoymsg.Header{"x-request-id", "req-e1"})...), fullDuplex, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(clientChat), true))
			checkOpenAIError(t, replies, tt.wantStatus, "request id req-e1")
			body := string(replies[len(replies)-1].GetImmediateResponse().GetBody())
			for _, leak := range []string{addr, "127.0.0.1", "10.0.0.5", "s3cret", "dial", "Post ", "http://"} {
				if strings.Contains(body, leak) {
					t.Errorf("the client's error shows %q: %s", leak, body)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if !strings.Contains(logged.String(), `"detail"=`) || !strings.Contains(logged.String(), addr) {
				t.Errorf("the request's log line lacks the cause naming %s:\n%s", addr, logged.String())
			}
		})
	}
}

// A Messages API client gets the router's own errors in Anthropic's shape,
// as vLLM's Messages handler words those it raises: {"type":"error","error":{"type",
// "message"}}, the type Anthropic's API gives the status.
func TestMessagesErrorsAreAnthropicStyle(t *testing.T) {
	tests := []struct {
		name, path, config, body string
		wantStatus               int
		wantType, wantMessage    string
	}{
		{name: "missing model", body: `{"max_tokens":8,"messages":[]}`, wantStatus: 400, wantType: "invalid_request_error", wantMessage: `no "model"`},
		// The Anthropic SDK's beta client (Claude Code's) asks with ?beta=true.
		{name: "missing model, beta", path: "/v1/messages?beta=true", body: `{"max_tokens":8,"messages":[]}`,
			wantStatus: 400, wantType: "invalid_request_error", wantMessage: `no "model"`},
		// Claude Code counts tokens beside its Messages requests: vLLM answers
		// count_tokens' errors in Anthropic's shape, and so must the router.
		{name: "count_tokens over the body limit", path: "/v1/messages/count_tokens?beta=true", config: "limits: {max_body_bytes: 100}\n",
			body: `{"model":"m","messages":[],"x":"` + strings.Repeat("x", 100) + `"}`, wantStatus: 413, wantType: "request_too_large", wantMessage: "limits.max_body_bytes"},
		{name: "count_tokens not JSON", path: "/v1/messages/count_tokens", body: `{"model":`, wantStatus: 400, wantType: "invalid_request_error", wantMessage: "JSON"},
		{name: "over the body limit", config: "limits: {max_body_bytes: 100}\n", body: `{"model":"m","max_tokens":8,"messages":[],"x":"` + strings.Repeat("x", 100) + `"}`,
			wantStatus: 413, wantType: "request_too_large", wantMessage: "limits.max_body_bytes"},
		{name: "prefill unreachable with on_failure fail", config: "prefill: {on_failure: fail}\n", body: `{"model":"m","max_tokens":8,"messages":[]}`,
			wantStatus: 503, wantType: "overloaded_error", wantMessage: "prefill leg failed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newServer(t, tt.config+`connector: kv-nixl
pools: {prefill: {endpoints: ["127.0.0.1:1"]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, handlers.Options{})
			path := cmp.Or(tt.path, "/v1/messages")
			replies := drive(t, s, envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(path, len(tt.body))...), fullDuplex, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(tt.body), true))
			got, body := immediateOf(t, replies)
			e, _ := body["error"].(map[string]any)
			if msg, _ := e["message"].(string); got != tt.wantStatus || body["type"] != "error" || e["type"] != tt.wantType || !strings.Contains(msg, tt.wantMessage) || len(body) != 2 || len(e) != 2 {
				t.Errorf("local reply %d %v, want %d {\"type\":\"error\",\"error\":{\"type\":%q,\"message\": ...%s...}}", got, body, tt.wantStatus, tt.wantType, tt.wantMessage)
			}
		})
	}
}
