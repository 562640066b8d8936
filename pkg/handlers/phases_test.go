package handlers_test

// The phases of an exchange, driven message by message with a fake Router and
// a recording sink: what Envoy gets back for each shape of stream.

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"google.golang.org/grpc/metadata"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/response"
)

// prompt is a completions request of about n bytes.
func prompt(n int) string {
	return `{"model":"m","prompt":"` + strings.Repeat("a", max(n-25, 0)) + `"}`
}

// withParams splices transfer parameters in before the client's closing brace,
// as the pipeline does: three pieces, two of them the client's bytes.
func withParams(client []byte) body.Spliced {
	return body.Spliced{client[:len(client)-1], []byte(`,"kv_transfer_params":{"remote_port":5600}`), client[len(client)-1:]}
}

func TestFullDuplexHoldsTheHeadersReplyAndStreamsTheBody(t *testing.T) {
	tests := []struct {
		name     string
		body     string
		chunks   int
		trailers bool // trailers, not end_of_stream on the last chunk, end the body
		decode   func([]byte) body.Spliced
		want     string // the decode body
		replies  int    // body replies
	}{
		{name: "one chunk, passed on untouched", body: clientChat, chunks: 1, want: clientChat, replies: 1},
		{name: "chunked, rewritten in pieces", body: prompt(200_000), chunks: 7, decode: withParams,
			want: strings.TrimSuffix(prompt(200_000), "}") + `,"kv_transfer_params":{"remote_port":5600}}`, replies: 4},
		{name: "exactly one reply's worth", body: prompt(62_000), chunks: 3, want: prompt(62_000), replies: 1},
		{name: "one byte over a reply's worth", body: prompt(62_001), chunks: 3, want: prompt(62_001), replies: 2},
		{name: "empty body: routed as none, one empty reply", body: "", chunks: 1, want: "", replies: 1},
		{name: "trailers end the body", body: clientChat, chunks: 2, trailers: true, want: clientChat, replies: 1},
		{name: "trailers end a long rewritten body", body: prompt(130_000), chunks: 3, trailers: true, decode: withParams,
			want: strings.TrimSuffix(prompt(130_000), "}") + `,"kv_transfer_params":{"remote_port":5600}}`, replies: 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &fakeRouter{decode: tt.decode}
			s := handlers.NewServer(r, handlers.Options{}, logr.Discard())
			msgs := append([]*extprocv3.ProcessingRequest{envoymsg.WithModes(
				envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(tt.body), envoymsg.Header{"x-request-id", "req-1"})...),
				fullDuplex, fullDuplex)},
				envoymsg.Chunks(envoymsg.Request, []byte(tt.body), tt.chunks, !tt.trailers)...)
			if tt.trailers {
				msgs = append(msgs, envoymsg.Trailers(envoymsg.Request))
			}
			rec := newRecorder()
			x := s.Open(t.Context(), rec)
			defer x.Close()
			for i, m := range msgs {
				if done, err := x.Handle(m); done || err != nil {
					t.Fatalf("message %d ended the stream: %v", i, err)
				}
				if n := len(rec.all()); i < len(msgs)-1 && n != 0 {
					t.Fatalf("%d replies before the body was complete (message %d): the headers reply carries the routing", n, i)
				}
			}
			replies := rec.all()

			if len(replies) == 0 || replies[0].GetRequestHeaders() == nil {
				t.Fatalf("first reply is not the request headers reply: %v", replies)
			}
			checkRouting(t, replies[0], fakeEndpoint, "req-1")
			bodyReplies := replies[1:]
			if tt.trailers {
				if last := replies[len(replies)-1]; last.GetRequestTrailers() == nil {
					t.Errorf("last reply is not the trailers reply: %v", last)
				}
				bodyReplies = replies[1 : len(replies)-1]
			}
			if got := streamedBody(t, bodyReplies, tt.trailers); got != tt.want {
				t.Errorf("decode body:\n got %.200s\nwant %.200s", got, tt.want)
			}
			if len(bodyReplies) != tt.replies {
				t.Errorf("%d body replies, want %d", len(bodyReplies), tt.replies)
			}
			call := "Route"
			if tt.body == "" {
				call = "RouteHeaders" // no bytes are no body
			}
			if !slices.Equal(r.calls, []string{call}) || string(r.seen[0].Body) != tt.body || r.seen[0].RequestID != "req-1" || r.seen[0].Path != chatPath {
				t.Errorf("router calls %v; want one %s with the whole body, req-1 and the path", r.calls, call)
			}
		})
	}
}

func TestBufferedRoutesInTheBodyReply(t *testing.T) {
	rewritten := strings.TrimSuffix(clientChat, "}") + `,"kv_transfer_params":{"remote_port":5600}}`
	tests := []struct {
		name          string
		mode          filterv3.ProcessingMode_BodySendMode
		contentLength bool
		trailers      bool
		decode        func([]byte) body.Spliced
		wantBody      string // the body mutation; "" for none
	}{
		{name: "rewritten, content-length sent", mode: buffered, contentLength: true, decode: withParams, wantBody: rewritten},
		{name: "rewritten, chunked request", mode: buffered, decode: withParams, wantBody: rewritten},
		{name: "untouched: not sent back", mode: buffered, contentLength: true},
		{name: "untouched, chunked request", mode: buffered},
		{name: "trailers follow the body", mode: buffered, contentLength: true, trailers: true, decode: withParams, wantBody: rewritten},
		{name: "BUFFERED_PARTIAL, the whole body in", mode: filterv3.ProcessingMode_BUFFERED_PARTIAL, contentLength: true, decode: withParams, wantBody: rewritten},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &fakeRouter{decode: tt.decode}
			s := handlers.NewServer(r, handlers.Options{}, logr.Discard())
			hs := envoymsg.Post(chatPath, len(clientChat))
			if !tt.contentLength {
				hs = slices.DeleteFunc(hs, func(h envoymsg.Header) bool { return h[0] == "content-length" })
			}
			msgs := []*extprocv3.ProcessingRequest{
				envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, hs...), tt.mode, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(clientChat), !tt.trailers),
			}
			if tt.trailers {
				msgs = append(msgs, envoymsg.Trailers(envoymsg.Request))
			}
			replies := drive(t, s, msgs...)

			if len(replies) != len(msgs) {
				t.Fatalf("got %d replies, want one per message: %v", len(replies), replies)
			}
			// A CONTINUE that removes only the client's own destination.
			if hr := replies[0].GetRequestHeaders(); hr == nil || len(hr.GetResponse().GetHeaderMutation().GetSetHeaders()) != 0 ||
				!slices.Equal(hr.GetResponse().GetHeaderMutation().GetRemoveHeaders(), []string{handlers.DestinationHeader}) || hr.GetResponse().GetClearRouteCache() {
				t.Errorf("BUFFERED headers reply must continue, removing only %s, got %v", handlers.DestinationHeader, replies[0])
			}
			br := replies[1].GetRequestBody().GetResponse()
			if br == nil {
				t.Fatalf("second reply is not the body reply: %v", replies[1])
			}
			checkRouting(t, replies[1], fakeEndpoint, "")
			if got := string(br.GetBodyMutation().GetBody()); got != tt.wantBody || (tt.wantBody == "") != (br.GetBodyMutation() == nil) {
				t.Errorf("body mutation %v, want %q", br.GetBodyMutation(), tt.wantBody)
			}
			cl, ok := headerValue(br.GetHeaderMutation(), "content-length")
			switch {
			case tt.wantBody == "" && ok:
				t.Errorf("content-length %q set for a body left as the client sent it", cl)
			case tt.wantBody != "" && tt.contentLength && cl != fmt.Sprint(len(tt.wantBody)):
				t.Errorf("content-length = %q, want %d (Envoy answers 500 on a mismatch)", cl, len(tt.wantBody))
			case !tt.contentLength && ok:
				t.Errorf("content-length %q set on a chunked request", cl)
			}
			if tt.trailers && replies[2].GetRequestTrailers() == nil {
				t.Errorf("last reply is not the trailers reply: %v", replies[2])
			}
			if !slices.Equal(r.calls, []string{"Route"}) || string(r.seen[0].Body) != clientChat {
				t.Errorf("router calls %v; want one Route with the whole body", r.calls)
			}
		})
	}
}

// Envoy's message timer runs while a BUFFERED body is routed; a slow route
// (a prefill leg) gets one override_message_timeout. The bubble's clock moves
// only when every goroutine in it is blocked, so the timings are exact.
func TestBufferedSlowRoutingExtendsEnvoysMessageTimerOnce(t *testing.T) {
	const after = time.Second
	tests := []struct {
		name          string
		overrideAfter time.Duration
		slow          bool // routing waits until the test has seen ten periods of overrideAfter pass
		wantOverride  bool
	}{
		{"slow routing", after, true, true},
		{"fast routing", after, false, false},
		{"override_after 0, slow routing", 0, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				r := &fakeRouter{decode: withParams}
				if tt.slow {
					r.block = make(chan struct{})
				}
				s := handlers.NewServer(r, handlers.Options{OverrideAfter: tt.overrideAfter, OverrideTimeout: 90 * time.Second}, logr.Discard())
				rec := newRecorder()
				x := s.Open(t.Context(), rec)
				defer x.Close()
				x.Handle(envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), buffered, fullDuplex))
				routed := make(chan error, 1)
				go func() {
					_, err := x.Handle(envoymsg.Body(envoymsg.Request, []byte(clientChat), true))
					routed <- err
				}()
				time.Sleep(10 * after) // the bubble's clock: a timer sending more than once would have
				synctest.Wait()
				if tt.slow {
					close(r.block)
				}
				if err := <-routed; err != nil {
					t.Fatal(err)
				}

				replies := rec.all()
				want := 2
				if tt.wantOverride {
					want = 3
					if o := replies[1]; o.Response != nil || o.GetOverrideMessageTimeout().AsDuration() != 90*time.Second {
						t.Errorf("reply while routing = %v; want only override_message_timeout 90s", o)
					}
				}
				if len(replies) != want {
					t.Fatalf("got %d replies, want %d: %v", len(replies), want, replies)
				}
				if replies[0].GetRequestHeaders() == nil || replies[want-1].GetRequestBody().GetResponse().GetBodyMutation() == nil {
					t.Errorf("replies %v; want the headers reply first and the body reply last", replies)
				}
			})
		})
	}
}

func TestBodilessRequestsRouteFromHeaders(t *testing.T) {
	get := []envoymsg.Header{{":method", "GET"}, {":path", "/v1/models"}}
	tests := []struct {
		name      string
		msg       *extprocv3.ProcessingRequest
		requestID string // "" when a UUID must be made
		method    string // what the router is told
	}{
		{"GET with end_of_stream", envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, true, get...), fullDuplex, fullDuplex), "", "GET"},
		{"GET with end_of_stream, BUFFERED", envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, true, get...), buffered, buffered), "", "GET"},
		{"GET keeps the client's request id",
			envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, true, append(get, envoymsg.Header{"x-request-id", "req-7"})...), fullDuplex, fullDuplex), "req-7", "GET"},
		{"body mode NONE, no body", envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post("/v1/models", 0)...),
			filterv3.ProcessingMode_NONE, filterv3.ProcessingMode_NONE), "", "POST"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &fakeRouter{}
			replies := drive(t, handlers.NewServer(r, handlers.Options{}, logr.Discard()), tt.msg)
			if len(replies) != 1 || replies[0].GetRequestHeaders() == nil {
				t.Fatalf("got %v, want one headers reply", replies)
			}
			checkRouting(t, replies[0], fakeEndpoint, tt.requestID)
			if !slices.Equal(r.calls, []string{"RouteHeaders"}) {
				t.Errorf("router calls %v, want RouteHeaders only", r.calls)
			}
			if m, p := r.seen[0].Method, r.seen[0].Path; m != tt.method || p != "/v1/models" {
				t.Errorf("the router was asked about %s %s, want %s /v1/models", m, p, tt.method)
			}
		})
	}
}

// A request the pipeline answers itself (the model list of a pool of several
// models) gets that answer as Envoy's local reply, a 200 in JSON, in every
// body mode and with an empty body too; it is counted answered, mode none.
func TestAnAnswerOfThePipelineIsALocalReply(t *testing.T) {
	const list = `{"object":"list","data":[{"id":"llama"},{"id":"qwen"}]}`
	get := []envoymsg.Header{{":method", "GET"}, {":path", "/v1/models"}}
	tests := []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
	}{
		{"FULL_DUPLEX, end_of_stream on the headers", []*extprocv3.ProcessingRequest{
			envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, true, get...), fullDuplex, fullDuplex)}},
		{"BUFFERED", []*extprocv3.ProcessingRequest{
			envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, true, get...), buffered, buffered)}},
		{"FULL_DUPLEX, an empty body", []*extprocv3.ProcessingRequest{
			envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, get...), fullDuplex, fullDuplex),
			envoymsg.Body(envoymsg.Request, nil, true)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := metrics.New("kv-nixl")
			replies := drive(t, handlers.NewServer(&fakeRouter{answer: []byte(list)}, handlers.Options{Metrics: m}, logr.Discard()), tt.msgs...)
			if len(replies) != 1 || replies[0].GetImmediateResponse() == nil {
				t.Fatalf("got %v, want one immediate response", replies)
			}
			ir := replies[0].GetImmediateResponse()
			var contentType string
			for _, h := range ir.GetHeaders().GetSetHeaders() {
				if h.GetHeader().GetKey() == "content-type" {
					contentType = string(h.GetHeader().GetRawValue())
				}
			}
			if ir.GetStatus().GetCode() != 200 || string(ir.GetBody()) != list || contentType != "application/json" {
				t.Errorf("answered %d %q %s, want 200 application/json %s", ir.GetStatus().GetCode(), contentType, ir.GetBody(), list)
			}
			answered := map[string]string{"api": api.LabelOf("GET", "/v1/models"), "mode": metrics.ModeNone.String(), "connector": "kv-nixl", "outcome": metrics.OutcomeAnswered}
			if got, _ := m.Sample("pd_extproc_requests_total", answered); got != 1 {
				t.Errorf("%v requests counted %v, want 1", got, answered)
			}
		})
	}
}

// Every refusal is an ImmediateResponse in OpenAI's error shape, and ends the
// stream: nothing after it is answered.
func TestRefusalsAreLocalRepliesThatEndTheStream(t *testing.T) {
	chat := []byte(clientChat)
	first := func(mode filterv3.ProcessingMode_BodySendMode, hs ...envoymsg.Header) *extprocv3.ProcessingRequest {
		return envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, hs...), mode, fullDuplex)
	}
	post := envoymsg.Post(chatPath, len(chat))
	noLength := []envoymsg.Header{{":method", "POST"}, {":path", chatPath}}
	engineBody := `{"object":"error","message":"bad","code":400}`
	tests := []struct {
		name        string
		router      *fakeRouter
		msgs        []*extprocv3.ProcessingRequest
		wantStatus  int
		wantMessage string // substring of error.message
		wantRaw     string // the body as is, when the router's error carries one
		wantBefore  int    // replies before the local reply
		wantCalls   []string
	}{
		{
			name: "STREAMED mode names the supported modes", router: &fakeRouter{},
			msgs:       []*extprocv3.ProcessingRequest{first(filterv3.ProcessingMode_STREAMED, post...), envoymsg.Body(envoymsg.Request, chat, true)},
			wantStatus: 500, wantMessage: "FULL_DUPLEX_STREAMED, BUFFERED or NONE",
		},
		{
			name: "BUFFERED_PARTIAL body cut at Envoy's buffer", router: &fakeRouter{},
			msgs: []*extprocv3.ProcessingRequest{first(filterv3.ProcessingMode_BUFFERED_PARTIAL, post...),
				envoymsg.Body(envoymsg.Request, chat[:20], false), envoymsg.Trailers(envoymsg.Request)},
			wantStatus: 500, wantMessage: "FULL_DUPLEX_STREAMED, BUFFERED or NONE", wantBefore: 1,
		},
		{
			name: "NONE mode with a body that could not be scrubbed", router: &fakeRouter{},
			msgs:       []*extprocv3.ProcessingRequest{first(filterv3.ProcessingMode_NONE, post...)},
			wantStatus: 500, wantMessage: "FULL_DUPLEX_STREAMED or BUFFERED",
		},
		{
			name: "NONE mode, a body of unknown length may follow", router: &fakeRouter{},
			msgs:       []*extprocv3.ProcessingRequest{first(filterv3.ProcessingMode_NONE, noLength...)},
			wantStatus: 500, wantMessage: "FULL_DUPLEX_STREAMED or BUFFERED",
		},
		{
			name: "content-length over the limit is refused before the body", router: &fakeRouter{limit: 100},
			msgs:       []*extprocv3.ProcessingRequest{first(fullDuplex, envoymsg.Post(chatPath, 101)...)},
			wantStatus: 413, wantMessage: "limits.max_body_bytes",
		},
		{
			name: "chunked body growing over the limit", router: &fakeRouter{limit: 100},
			msgs: []*extprocv3.ProcessingRequest{first(fullDuplex, noLength...),
				envoymsg.Body(envoymsg.Request, make([]byte, 60), false), envoymsg.Body(envoymsg.Request, make([]byte, 60), false),
				envoymsg.Body(envoymsg.Request, make([]byte, 1), true)},
			wantStatus: 413, wantMessage: "limits.max_body_bytes",
		},
		{
			name: "BUFFERED body over the limit", router: &fakeRouter{limit: 100},
			msgs:       []*extprocv3.ProcessingRequest{first(buffered, noLength...), envoymsg.Body(envoymsg.Request, make([]byte, 101), true)},
			wantStatus: 413, wantMessage: "limits.max_body_bytes", wantBefore: 1,
		},
		{
			name:       "the router's error, FULL_DUPLEX",
			router:     &fakeRouter{err: &pipeline.Error{Status: 400, Type: "invalid_request_error", Message: `the request has no "model" string`}},
			msgs:       []*extprocv3.ProcessingRequest{first(fullDuplex, post...), envoymsg.Body(envoymsg.Request, chat, true)},
			wantStatus: 400, wantMessage: `no "model"`, wantCalls: []string{"Route"},
		},
		{
			name:       "the router's error, BUFFERED",
			router:     &fakeRouter{err: &pipeline.Error{Status: 502, Type: "upstream_error", Message: "prefill leg failed: 503"}},
			msgs:       []*extprocv3.ProcessingRequest{first(buffered, post...), envoymsg.Body(envoymsg.Request, chat, true)},
			wantStatus: 502, wantMessage: "prefill leg failed", wantBefore: 1, wantCalls: []string{"Route"},
		},
		{
			name:       "a plain error from the router is a 500 that names the request, not the error",
			router:     &fakeRouter{err: errors.New("dial tcp 10.9.9.9:8000: connection refused")},
			msgs:       []*extprocv3.ProcessingRequest{first(fullDuplex, post...), envoymsg.Body(envoymsg.Request, chat, true)},
			wantStatus: 500, wantMessage: "internal error; request id ", wantCalls: []string{"Route"},
		},
		{
			name:   "the router's error routing from headers",
			router: &fakeRouter{err: &pipeline.Error{Status: 503, Type: "service_unavailable", Message: "no healthy decode endpoint"}},
			msgs: []*extprocv3.ProcessingRequest{envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, true, envoymsg.Header{":method", "GET"}, envoymsg.Header{":path", "/v1/models"}), fullDuplex, fullDuplex),
				envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"})},
			wantStatus: 503, wantMessage: "no healthy decode endpoint", wantCalls: []string{"RouteHeaders"},
		},
		{
			name: "an engine's own error body is returned as is",
			router: &fakeRouter{err: &pipeline.Error{Status: 400, Type: "invalid_request_error", Message: "prefill engine rejected the request",
				Raw: []byte(engineBody), ContentType: "application/json"}},
			msgs:       []*extprocv3.ProcessingRequest{first(fullDuplex, post...), envoymsg.Body(envoymsg.Request, chat, true)},
			wantStatus: 400, wantRaw: engineBody, wantCalls: []string{"Route"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := handlers.NewServer(tt.router, handlers.Options{}, logr.Discard())
			// Envoy would send the response next; a stream still open answers it.
			msgs := append(tt.msgs, envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}))
			replies := drive(t, s, msgs...)
			if len(replies) != tt.wantBefore+1 {
				t.Fatalf("got %d replies, want %d then the local reply, then none: %v", len(replies), tt.wantBefore, replies)
			}
			if !slices.Equal(tt.router.calls, tt.wantCalls) {
				t.Errorf("router calls %v, want %v", tt.router.calls, tt.wantCalls)
			}
			if tt.wantRaw != "" {
				ir := replies[len(replies)-1].GetImmediateResponse()
				if int(ir.GetStatus().GetCode()) != tt.wantStatus || string(ir.GetBody()) != tt.wantRaw {
					t.Errorf("local reply %d %s, want %d and the engine's %s", ir.GetStatus().GetCode(), ir.GetBody(), tt.wantStatus, tt.wantRaw)
				}
				return
			}
			checkOpenAIError(t, replies, tt.wantStatus, tt.wantMessage)
		})
	}
}

func TestOverMaxStreamsIsShedWith429(t *testing.T) {
	tests := []struct {
		maxStreams, held int
		want429          bool
	}{
		{maxStreams: 1, held: 1, want429: true},
		{maxStreams: 2, held: 1, want429: false},
		{maxStreams: 2, held: 2, want429: true},
		{maxStreams: 0, held: 3, want429: false}, // no bound
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("max %d, %d held", tt.maxStreams, tt.held), func(t *testing.T) {
			r := &fakeRouter{}
			s := handlers.NewServer(r, handlers.Options{MaxStreams: tt.maxStreams, RetryAfter: 2 * time.Second}, logr.Discard())
			headers := func() *extprocv3.ProcessingRequest {
				return envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), buffered, fullDuplex)
			}
			var held []*handlers.Exchange
			defer func() {
				for _, x := range held {
					x.Close()
				}
			}()
			for range tt.held {
				x := s.Open(t.Context(), newRecorder())
				x.Handle(headers())
				held = append(held, x)
			}

			replies := drive(t, s, headers(), envoymsg.Body(envoymsg.Request, []byte(clientChat), true))
			if !tt.want429 {
				if len(replies) != 2 || replies[1].GetRequestBody() == nil {
					t.Errorf("under the bound: %v, want the request routed", replies)
				}
				return
			}
			checkOpenAIError(t, replies, 429, "limits.max_concurrent_streams")
			if retry, _ := headerValue(replies[0].GetImmediateResponse().GetHeaders(), "retry-after"); retry != "2" {
				t.Errorf("retry-after = %q, want 2", retry)
			}
			if len(r.calls) != 0 {
				t.Errorf("a refused request was routed: %v", r.calls)
			}

			held[0].Close() // one held stream ends: the next is served
			held = held[1:]
			replies = drive(t, s, headers(), envoymsg.Body(envoymsg.Request, []byte(clientChat), true))
			if len(replies) != 2 || replies[1].GetRequestBody() == nil {
				t.Errorf("after a held stream ended: %v, want the request routed", replies)
			}
		})
	}
}

// Envoy sends the request headers once; a repeated headers message is ignored,
// whatever it says.
func TestRepeatedRequestHeadersAreIgnored(t *testing.T) {
	chat := []byte(clientChat)
	headers := func(mode filterv3.ProcessingMode_BodySendMode, eos bool, id string) *extprocv3.ProcessingRequest {
		hs := envoymsg.Post(chatPath, len(chat), envoymsg.Header{"x-request-id", id})
		return envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, eos, hs...), mode, fullDuplex)
	}
	tests := []struct {
		name      string
		msgs      []*extprocv3.ProcessingRequest
		wantCalls []string
		routing   int // the reply carrying the routing
	}{
		{"FULL_DUPLEX", []*extprocv3.ProcessingRequest{headers(fullDuplex, false, "req-1"), headers(fullDuplex, false, "req-2"),
			envoymsg.Body(envoymsg.Request, chat, true)}, []string{"Route"}, 0},
		{"BUFFERED", []*extprocv3.ProcessingRequest{headers(buffered, false, "req-1"), headers(buffered, false, "req-2"),
			envoymsg.Body(envoymsg.Request, chat, true)}, []string{"Route"}, 1},
		{"bodiless", []*extprocv3.ProcessingRequest{headers(fullDuplex, true, "req-1"), headers(fullDuplex, true, "req-2")},
			[]string{"RouteHeaders"}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &fakeRouter{}
			replies := drive(t, handlers.NewServer(r, handlers.Options{}, logr.Discard()), tt.msgs...)
			if len(replies) != len(tt.msgs)-1 {
				t.Fatalf("got %d replies, want %d: the repeated headers are not answered: %v", len(replies), len(tt.msgs)-1, replies)
			}
			checkRouting(t, replies[tt.routing], fakeEndpoint, "req-1")
			if !slices.Equal(r.calls, tt.wantCalls) {
				t.Errorf("router calls %v, want %v", r.calls, tt.wantCalls)
			}
		})
	}
}

// A body message after the body ended is dropped unanswered: Envoy sometimes
// delivers the final chunk twice (envoy#46237).
func TestBodyAfterItsEndIsDropped(t *testing.T) {
	chat := []byte(clientChat)
	headers := func(mode filterv3.ProcessingMode_BodySendMode, eos bool) *extprocv3.ProcessingRequest {
		return envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, eos, envoymsg.Post(chatPath, len(chat))...), mode, fullDuplex)
	}
	last := func() *extprocv3.ProcessingRequest { return envoymsg.Body(envoymsg.Request, chat, true) }
	tests := []struct {
		name      string
		msgs      []*extprocv3.ProcessingRequest
		dropped   int // the message left unanswered
		wantCalls []string
	}{
		{"FULL_DUPLEX final chunk twice", []*extprocv3.ProcessingRequest{headers(fullDuplex, false), last(), last()}, 2, []string{"Route"}},
		{"BUFFERED body twice", []*extprocv3.ProcessingRequest{headers(buffered, false), last(), last()}, 2, []string{"Route"}},
		{"after trailers ended the body", []*extprocv3.ProcessingRequest{headers(fullDuplex, false),
			envoymsg.Body(envoymsg.Request, chat, false), envoymsg.Trailers(envoymsg.Request), last()}, 3, []string{"Route"}},
		{"after headers with end_of_stream", []*extprocv3.ProcessingRequest{headers(fullDuplex, true), last()}, 1, []string{"RouteHeaders"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			without := slices.Delete(slices.Clone(tt.msgs), tt.dropped, tt.dropped+1)
			want := drive(t, handlers.NewServer(&fakeRouter{}, handlers.Options{}, logr.Discard()), without...)
			r := &fakeRouter{}
			replies := drive(t, handlers.NewServer(r, handlers.Options{}, logr.Discard()), tt.msgs...)
			if len(replies) != len(want) {
				t.Errorf("got %d replies, want the %d without the dropped body: %v", len(replies), len(want), replies)
			}
			if !slices.Equal(r.calls, tt.wantCalls) {
				t.Errorf("router calls %v, want %v", r.calls, tt.wantCalls)
			}
			if len(r.seen) > 0 && r.calls[0] == "Route" && string(r.seen[0].Body) != clientChat {
				t.Errorf("routed body %q, want the client's once", r.seen[0].Body)
			}
		})
	}
}

// The response is Envoy's to forward: FULL_DUPLEX chunks are echoed at once
// (SSE tokens must keep streaming), every other message is answered CONTINUE.
func TestResponsePathIsPassedOnUnchanged(t *testing.T) {
	sse := []string{"data: {\"choices\":[{\"delta\":{\"content\":\"tok0\"}}]}\n\n", "data: [DONE]\n\n"}
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{fullDuplex, buffered, filterv3.ProcessingMode_STREAMED, filterv3.ProcessingMode_NONE} {
		t.Run(mode.String(), func(t *testing.T) {
			replies := drive(t, handlers.NewServer(&fakeRouter{}, handlers.Options{}, logr.Discard()),
				envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, true, envoymsg.Header{":method", "GET"}, envoymsg.Header{":path", "/v1/models"}), fullDuplex, mode),
				envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}),
				envoymsg.Body(envoymsg.Response, []byte(sse[0]), false),
				envoymsg.Body(envoymsg.Response, []byte(sse[1]), true),
				envoymsg.Body(envoymsg.Response, []byte(sse[1]), true), // after the end: dropped
				envoymsg.Trailers(envoymsg.Response),
			)
			if len(replies) != 5 {
				t.Fatalf("got %d replies, want 5: %v", len(replies), replies)
			}
			if rh := replies[1].GetResponseHeaders(); rh == nil || rh.GetResponse() != nil {
				t.Errorf("response headers answered %v, want CONTINUE", replies[1])
			}
			if rt := replies[4].GetResponseTrailers(); rt == nil || rt.GetHeaderMutation() != nil {
				t.Errorf("response trailers answered %v, want CONTINUE", replies[4])
			}
			for i, want := range sse {
				rb := replies[2+i].GetResponseBody()
				if rb == nil {
					t.Fatalf("response chunk %d answered %v", i, replies[2+i])
				}
				if mode != fullDuplex {
					if rb.GetResponse() != nil {
						t.Errorf("response chunk %d answered %v, want CONTINUE", i, rb)
					}
					continue
				}
				sr := rb.GetResponse().GetBodyMutation().GetStreamedResponse()
				if string(sr.GetBody()) != want || sr.GetEndOfStream() != (i == 1) {
					t.Errorf("response chunk %d echoed as %q eos=%v", i, sr.GetBody(), sr.GetEndOfStream())
				}
			}
		})
	}
}

// With a rewrite of the usage, the response still streams: each complete
// event goes back at once, an event cut across chunks waits for its end, a
// JSON answer waits for its own; the bytes the client gets are the engine's
// but for cached_tokens. The request's body mode does not matter; the
// response's must be FULL_DUPLEX.
func TestUsageRewriteOnTheResponsePath(t *testing.T) {
	const (
		tok     = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok0\"}}]}\n\n"
		usage   = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"prompt_tokens_details\":{\"cached_tokens\":12}}}\n\n"
		fixedEv = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n"
		done    = "data: [DONE]\n\n"
		answer  = `{"choices":[{"text":"tok0"}],"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":12}},"kv_transfer_params":null}`
		fixed   = `{"choices":[{"text":"tok0"}],"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":8}},"kv_transfer_params":null}`
	)
	long := strings.Replace(answer, "tok0", strings.Repeat("tok ", 20000), 1)
	longFixed := strings.Replace(fixed, "tok0", strings.Repeat("tok ", 20000), 1)
	sse := []envoymsg.Header{{":status", "200"}, {"content-type", "text/event-stream; charset=utf-8"}}
	jsonHeaders := []envoymsg.Header{{":status", "200"}, {"content-type", "application/json"}}
	type reply struct {
		body string
		eos  bool
	}
	tests := []struct {
		name         string
		responseMode filterv3.ProcessingMode_BodySendMode
		headers      []envoymsg.Header
		chunks       []string // the response body; the last has end_of_stream unless trailers end it
		trailers     bool
		want         []reply // the response body replies, in order
		outcome      string
	}{
		{name: "streamed: every event at once, the usage event fixed", responseMode: fullDuplex, headers: sse,
			chunks: []string{tok, tok, usage, done, ""},
			want:   []reply{{tok, false}, {tok, false}, {fixedEv, false}, {done, false}, {"", true}}, outcome: metrics.UsageRewritten},
		{name: "streamed: a cut event waits for its end, and nothing else does", responseMode: fullDuplex, headers: sse,
			chunks: []string{tok + usage[:30], usage[30:] + done},
			want:   []reply{{tok, false}, {fixedEv + done, true}}, outcome: metrics.UsageRewritten},
		{name: "streamed without usage: unchanged", responseMode: fullDuplex, headers: sse,
			chunks: []string{tok, done}, want: []reply{{tok, false}, {done, true}}, outcome: metrics.UsageAbsent},
		{name: "streamed, trailers end it: what is held goes before them", responseMode: fullDuplex, headers: sse, trailers: true,
			chunks: []string{tok + usage[:30], usage[30:]},
			want:   []reply{{tok, false}, {fixedEv, false}}, outcome: metrics.UsageRewritten},
		{name: "non-streamed: held to its end, then whole", responseMode: fullDuplex, headers: jsonHeaders,
			chunks: []string{answer[:20], answer[20:]}, want: []reply{{fixed, true}}, outcome: metrics.UsageRewritten},
		{name: "non-streamed, long: fixed, then cut into replies of at most 62,000 bytes", responseMode: fullDuplex, headers: jsonHeaders,
			chunks: []string{long[:40000], long[40000:]}, want: []reply{{longFixed[:62000], false}, {longFixed[62000:], true}}, outcome: metrics.UsageRewritten},
		{name: "an error answer is echoed as it comes", responseMode: fullDuplex,
			headers: []envoymsg.Header{{":status", "500"}, {"content-type", "application/json"}},
			chunks:  []string{answer[:20], answer[20:]}, want: []reply{{answer[:20], false}, {answer[20:], true}}, outcome: metrics.UsageNotRewritable},
		{name: "response body mode BUFFERED: not rewritten", responseMode: buffered, headers: jsonHeaders,
			chunks: []string{answer}, outcome: metrics.UsageNotFullDuplex},
	}
	for _, requestMode := range []filterv3.ProcessingMode_BodySendMode{fullDuplex, buffered} {
		for _, tt := range tests {
			t.Run(requestMode.String()+"/"+tt.name, func(t *testing.T) {
				m := metrics.New("kv-nixl")
				r := &fakeRouter{rewrite: func() *response.Rewriter {
					return response.New(response.Paths{JSON: api.Chat.Shape.CachedTokens}, []byte("8"), nil, 1<<20)
				}}
				s := handlers.NewServer(r, handlers.Options{Metrics: m}, logr.Discard())
				msgs := []*extprocv3.ProcessingRequest{
					envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), requestMode, tt.responseMode),
					envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
					envoymsg.Headers(envoymsg.Response, false, tt.headers...),
				}
				for i, c := range tt.chunks {
					msgs = append(msgs, envoymsg.Body(envoymsg.Response, []byte(c), !tt.trailers && i == len(tt.chunks)-1))
				}
				if tt.trailers {
					msgs = append(msgs, envoymsg.Trailers(envoymsg.Response))
				}
				replies := drive(t, s, msgs...)

				var got []reply
				for _, rp := range replies {
					if rb := rp.GetResponseBody(); rb != nil {
						if sr := rb.GetResponse().GetBodyMutation().GetStreamedResponse(); sr != nil {
							got = append(got, reply{string(sr.GetBody()), sr.GetEndOfStream()})
						} else if tt.responseMode == fullDuplex {
							t.Errorf("a FULL_DUPLEX response body reply without streamed_response: %v", rp)
						}
					}
				}
				if !slices.Equal(got, tt.want) {
					t.Errorf("response body replies\n  %+v\nwant\n  %+v", got, tt.want)
				}
				if tt.responseMode != fullDuplex && replies[len(replies)-1].GetResponseBody() == nil {
					t.Errorf("the response chunk is not answered CONTINUE: %v", replies[len(replies)-1])
				}
				if tt.trailers && replies[len(replies)-1].GetResponseTrailers() == nil {
					t.Errorf("the last reply is not the trailers reply: %v", replies[len(replies)-1])
				}
				if got := usageCount(t, m, tt.outcome); got != 1 {
					t.Errorf("usage_rewrites_total{outcome=%q} = %v, want 1", tt.outcome, got)
				}
			})
		}
	}
}

// usageCount is usage_rewrites_total{outcome}.
func usageCount(t *testing.T, m *metrics.Metrics, outcome string) float64 {
	t.Helper()
	v, ok := m.Sample("pd_extproc_usage_rewrites_total", map[string]string{"outcome": outcome})
	if !ok {
		t.Fatalf("no series usage_rewrites_total{outcome=%q}", outcome)
	}
	return v
}

// A rewrite that cannot see the response body is a config problem of the
// whole process: said once, counted per answer.
func TestUsageRewriteWithoutFullDuplexResponsesIsLoggedOnce(t *testing.T) {
	var mu sync.Mutex
	warnings := 0
	log := funcr.New(func(_, args string) {
		mu.Lock()
		defer mu.Unlock()
		if strings.Contains(args, "rewrite_usage is on") {
			warnings++
		}
	}, funcr.Options{})
	m := metrics.New("kv-nixl")
	r := &fakeRouter{rewrite: func() *response.Rewriter {
		return response.New(response.Paths{JSON: api.Chat.Shape.CachedTokens}, []byte("8"), nil, 1<<20)
	}}
	s := handlers.NewServer(r, handlers.Options{Metrics: m}, log)
	for range 3 {
		drive(t, s,
			envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), fullDuplex, filterv3.ProcessingMode_NONE),
			envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
			envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, envoymsg.Header{"content-type", "application/json"}))
	}
	if warnings != 1 {
		t.Errorf("%d warnings, want one for the process", warnings)
	}
	if got := usageCount(t, m, metrics.UsageNotFullDuplex); got != 3 {
		t.Errorf("usage_rewrites_total{outcome=not_full_duplex} = %v, want 3", got)
	}
}

// TestSessionHeadersMarkTheRequest: a request naming its session in one of
// the headers Envoy's session hash reads is routed as such
// (pipeline.Request.Session), so that prefix affinity counts its
// conversations apart; an empty value names none. The client's address that
// the shipped configs put on the stream is routed with it
// (pipeline.Request.Client), for the counts per address.
func TestSessionHeadersMarkTheRequest(t *testing.T) {
	tests := []struct {
		name    string
		headers []envoymsg.Header
		client  string // the stream's x-pd-client-address metadata
		want    bool
	}{
		{"none", nil, "", false},
		{"ours", []envoymsg.Header{{"x-session-id", "s1"}}, "", true},
		{"Claude Code's", []envoymsg.Header{{"x-claude-code-session-id", "5f0c"}}, "", true},
		{"Codex's", []envoymsg.Header{{"session-id", "019a"}}, "", true},
		{"Open WebUI's", []envoymsg.Header{{"x-openwebui-chat-id", "c1"}}, "", true},
		{"an empty value", []envoymsg.Header{{"x-session-id", ""}}, "", false},
		{"another header", []envoymsg.Header{{"x-conversation-id", "c1"}}, "", false},
		{"the client's address", nil, "192.0.2.7", false},
		{"a session and the client's address", []envoymsg.Header{{"x-session-id", "s1"}}, "2001:db8::7", true},
		{"the address as a request header", []envoymsg.Header{{handlers.ClientAddressHeader, "192.0.2.8"}}, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &fakeRouter{}
			s := handlers.NewServer(r, handlers.Options{}, logr.Discard())
			ctx := t.Context()
			if tt.client != "" {
				ctx = metadata.NewIncomingContext(ctx, metadata.Pairs(handlers.ClientAddressHeader, tt.client))
			}
			sendChat(t, s.Open(ctx, newRecorder()), tt.headers)
			if len(r.seen) != 1 || r.seen[0].Session != tt.want || r.seen[0].Client != tt.client {
				t.Fatalf("routed %d requests, %+v; want one, Session %v, Client %q", len(r.seen), r.seen, tt.want, tt.client)
			}
		})
	}
}

// TestAdmissionHeadersNameObjectiveAndFlow: the Inference Extension's
// objective and fairness id headers, and llm-d's names for them, reach the
// pipeline (pipeline.Request.Objective, .Fairness); where a request sends
// both names, the Inference Extension's counts, in either order, unless its
// value is empty.
func TestAdmissionHeadersNameObjectiveAndFlow(t *testing.T) {
	tests := []struct {
		name                string
		headers             []envoymsg.Header
		objective, fairness string
	}{
		{"none", nil, "", ""},
		{"the Inference Extension's", []envoymsg.Header{{handlers.ObjectiveHeader, "batch"}, {handlers.FairnessHeader, "tenant-a"}}, "batch", "tenant-a"},
		{"llm-d's", []envoymsg.Header{{handlers.LLMDObjectiveHeader, "batch"}, {handlers.LLMDFairnessHeader, "tenant-b"}}, "batch", "tenant-b"},
		{"both, llm-d's first", []envoymsg.Header{{handlers.LLMDFairnessHeader, "llm-d"}, {handlers.FairnessHeader, "gie"}}, "", "gie"},
		{"both, llm-d's last", []envoymsg.Header{{handlers.FairnessHeader, "gie"}, {handlers.LLMDFairnessHeader, "llm-d"}}, "", "gie"},
		// An empty value names nothing: the other name's counts, in either order.
		{"the Inference Extension's empty, llm-d's first", []envoymsg.Header{{handlers.LLMDObjectiveHeader, "batch"}, {handlers.LLMDFairnessHeader, "llm-d"},
			{handlers.ObjectiveHeader, ""}, {handlers.FairnessHeader, ""}}, "batch", "llm-d"},
		{"the Inference Extension's empty, llm-d's last", []envoymsg.Header{{handlers.ObjectiveHeader, ""}, {handlers.FairnessHeader, ""},
			{handlers.LLMDObjectiveHeader, "batch"}, {handlers.LLMDFairnessHeader, "llm-d"}}, "batch", "llm-d"},
		{"the Inference Extension's twice, the second empty", []envoymsg.Header{{handlers.ObjectiveHeader, "batch"}, {handlers.FairnessHeader, "gie"},
			{handlers.ObjectiveHeader, ""}, {handlers.FairnessHeader, ""}}, "batch", "gie"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &fakeRouter{}
			s := handlers.NewServer(r, handlers.Options{}, logr.Discard())
			sendChat(t, s.Open(t.Context(), newRecorder()), tt.headers)
			if len(r.seen) != 1 {
				t.Fatalf("routed %d requests, want one", len(r.seen))
			}
			if got := r.seen[0]; got.Objective != tt.objective || got.Fairness != tt.fairness {
				t.Errorf("objective %q, fairness %q; want %q, %q", got.Objective, got.Fairness, tt.objective, tt.fairness)
			}
		})
	}
}

// sendChat sends x, a stream in FULL_DUPLEX_STREAMED, a chat request with
// headers besides its request id, and closes it.
func sendChat(t *testing.T, x *handlers.Exchange, headers []envoymsg.Header) {
	t.Helper()
	defer x.Close()
	hs := append([]envoymsg.Header{{"x-request-id", "req-1"}}, headers...)
	msgs := append([]*extprocv3.ProcessingRequest{envoymsg.WithModes(
		envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat), hs...)...), fullDuplex, fullDuplex)},
		envoymsg.Chunks(envoymsg.Request, []byte(clientChat), 1, true)...)
	for i, m := range msgs {
		if done, err := x.Handle(m); done || err != nil {
			t.Fatalf("message %d ended the stream: %v", i, err)
		}
	}
}

// TestAnEmptyBodyIsNoBody: a request whose headers did not end the stream
// but whose body is no bytes (HTTP/1.1 chunked with its terminator alone, an
// empty last HTTP/2 DATA frame) is routed as one without a body: a
// pass-through GET reaches its decode engine, a chat request is told it
// needs a body. Its zero bytes were scanned as JSON, a 400 either way.
func TestAnEmptyBodyIsNoBody(t *testing.T) {
	s := newServer(t, `connector: kv-nixl
pools: {prefill: {endpoints: ["10.0.0.1:8000"]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, handlers.Options{})
	tests := []struct {
		method, path string
		wantStatus   int // 0: routed to the decode endpoint
		wantMessage  string
	}{
		{"GET", "/v1/models", 0, ""},
		{"POST", "/v1/chat/completions", 400, "needs a JSON body"},
	}
	for _, tt := range tests {
		for name, mode := range map[string]filterv3.ProcessingMode_BodySendMode{"FULL_DUPLEX": fullDuplex, "BUFFERED": buffered} {
			t.Run(tt.method+" "+tt.path+", "+name, func(t *testing.T) {
				replies := drive(t, s,
					envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Header{":method", tt.method},
						envoymsg.Header{":path", tt.path}, envoymsg.Header{"transfer-encoding", "chunked"}), mode, fullDuplex),
					envoymsg.Body(envoymsg.Request, nil, true))
				last := replies[len(replies)-1]
				if ir := last.GetImmediateResponse(); ir != nil || tt.wantStatus != 0 {
					if got := int(ir.GetStatus().GetCode()); got != tt.wantStatus || !strings.Contains(string(ir.GetBody()), tt.wantMessage) {
						t.Fatalf("status %d %s, want %d %q", got, ir.GetBody(), tt.wantStatus, tt.wantMessage)
					}
					return
				}
				routing := replies[0] // FULL_DUPLEX: the headers reply, held until the body ended
				if mode == buffered {
					routing = last
				}
				checkRouting(t, routing, "10.1.1.1:8000", "")
			})
		}
	}
}
