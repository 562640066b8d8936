package handlers_test

// Process over a real gRPC connection with the real pipeline: what only the
// stream itself shows (its loop, its end, streams at once, cancellation).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// The loop reads each message, has it answered, and ends the stream when Envoy
// half-closes it or when a local reply has ended the exchange; each stream's
// end gives its slot under MaxStreams back.
func TestStreamLoop(t *testing.T) {
	chat := []byte(clientChat)
	request := []*extprocv3.ProcessingRequest{
		envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(chat))...), fullDuplex, fullDuplex),
	}
	request = append(request, envoymsg.Chunks(envoymsg.Request, chat, 3, true)...)
	response := append([]*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"})},
		envoymsg.Chunks(envoymsg.Response, []byte("data: [DONE]\n\n"), 2, false)...)
	response = append(response, envoymsg.Trailers(envoymsg.Response))
	tests := []struct {
		name      string
		msgs      []*extprocv3.ProcessingRequest
		halfClose bool
		streams   int // one after another, with MaxStreams 1
		want      []string
	}{
		{
			name: "a request and its response, then Envoy's half-close", msgs: append(request, response...), halfClose: true, streams: 1,
			want: []string{"request_headers", "request_body", "response_headers", "response_body", "response_body", "response_trailers"},
		},
		{
			name: "a local reply ends the stream without a half-close", halfClose: false, streams: 1,
			msgs: []*extprocv3.ProcessingRequest{envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(chat))...),
				filterv3.ProcessingMode_STREAMED, fullDuplex)},
			want: []string{"immediate_response 500"},
		},
		{
			name: "each stream's end gives its slot back", msgs: request, halfClose: true, streams: 3,
			want: []string{"request_headers", "request_body"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := startServer(t, newServer(t, `{connector: kv-nixl, pools: {decode: {endpoints: ["10.1.1.1:8000"]}}}`, handlers.Options{MaxStreams: 1}))
			for i := range tt.streams {
				replies, err := tryExchange(c, tt.halfClose, tt.msgs...)
				if err != nil {
					t.Fatalf("stream %d: %v", i, err)
				}
				var kinds []string
				for _, r := range replies {
					kinds = append(kinds, kindOf(r))
				}
				if strings.Join(kinds, " ") != strings.Join(tt.want, " ") {
					t.Errorf("stream %d replies %v, want %v", i, kinds, tt.want)
				}
			}
		})
	}
}

// kindOf names a reply by what it answers: its response field's name, and
// a local reply's status.
func kindOf(r *extprocv3.ProcessingResponse) string {
	m := r.ProtoReflect()
	f := m.WhichOneof(m.Descriptor().Oneofs().ByName("response"))
	switch {
	case f == nil:
		return fmt.Sprint(r)
	case r.GetImmediateResponse() != nil:
		return fmt.Sprint("immediate_response ", int(r.GetImmediateResponse().GetStatus().GetCode()))
	}
	return string(f.Name())
}

// Chunked FULL_DUPLEX bodies are collected in buffers that later streams reuse
// (bodies.go): streams at once, of sizes in one buffer class, must each get
// back exactly their own body. Over gRPC, since a buffer may be reused once
// gRPC has copied the replies sent from it.
func TestEachStreamGetsBackItsOwnCollectedBody(t *testing.T) {
	c := startServer(t, newServer(t, `{connector: kv-nixl, pools: {decode: {endpoints: ["10.1.1.1:8000"]}}}`, handlers.Options{}))
	const streams, rounds = 8, 10
	errs := make(chan error, streams)
	for w := range streams {
		go func() {
			errs <- func() error {
				for r := range rounds {
					// 200,000 to 230,000 bytes: one 224 KiB or 256 KiB class.
					body := `{"model":"m","prompt":"` + strings.Repeat(string(rune('a'+w)), 200_000+w*3000+r*97) + `"}`
					msgs := append([]*extprocv3.ProcessingRequest{envoymsg.WithModes(
						envoymsg.Headers(envoymsg.Request, false, envoymsg.Post("/v1/completions", len(body))...), fullDuplex, fullDuplex)},
						envoymsg.Chunks(envoymsg.Request, []byte(body), 5, true)...)
					replies, err := tryExchange(c, true, msgs...)
					if err != nil {
						return err
					}
					if got := joinStreamed(replies[1:]); got != body {
						return fmt.Errorf("stream %d round %d got back %d bytes starting %.40q, want its own %d", w, r, len(got), got, len(body))
					}
				}
				return nil
			}()
		}()
	}
	for range streams {
		if err := <-errs; err != nil {
			t.Error(err)
		}
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
	return enginetest.Receive(t, b.ended, "the prefill request neither completed nor was cancelled")
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
			c := startServer(t, newServer(t, fmt.Sprintf(`connector: %s
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, tt.connector, prefill.Addr()), handlers.Options{}))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			s, err := c.Process(ctx)
			if err != nil {
				t.Fatal(err)
			}
			s.Send(envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), fullDuplex, fullDuplex))
			s.Send(envoymsg.Body(envoymsg.Request, []byte(clientChat), true))
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

// A panic while handling one stream (a bug) ends that stream with INTERNAL,
// which Envoy answers with a 500, and is counted; the stream held open beside
// it goes on, and later streams are served.
func TestAPanicEndsOnlyItsStream(t *testing.T) {
	m := metrics.New("kv-nixl")
	c := startServer(t, handlers.NewServer(panickyRouter{}, handlers.Options{Metrics: m}, logr.Discard()))
	request := func(content string) []*extprocv3.ProcessingRequest {
		b := []byte(`{"model":"m","messages":[{"role":"user","content":"` + content + `"}]}`)
		return []*extprocv3.ProcessingRequest{
			envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(b))...), fullDuplex, fullDuplex),
			envoymsg.Body(envoymsg.Request, b, true),
		}
	}
	held, err := c.Process(t.Context()) // a stream open beside the panic, as a generation would be
	if err != nil {
		t.Fatal(err)
	}
	if err := held.Send(request("hello")[0]); err != nil { // its headers: the reply waits for the body
		t.Fatal(err)
	}
	if _, err := tryExchange(c, true, request("boom")...); status.Code(err) != codes.Internal {
		t.Fatalf("the panicking stream ended with %v, want INTERNAL", err)
	}
	if err := held.Send(request("hello")[1]); err != nil {
		t.Fatal(err)
	}
	for {
		r, err := held.Recv()
		if err != nil {
			t.Fatalf("the stream held beside it: %v", err)
		}
		if r.GetRequestBody() != nil {
			break
		}
	}
	if _, err := tryExchange(c, true, request("hello again")...); err != nil {
		t.Errorf("a later stream: %v", err)
	}
	if got, _ := m.Sample("pd_extproc_panics_total", nil); got != 1 {
		t.Errorf("%v panics counted, want 1", got)
	}
	served := map[string]string{"api": api.NameChat, "mode": metrics.ModeNone.String(), "connector": "kv-nixl", "outcome": metrics.Outcome5xx}
	if got, _ := m.Sample("pd_extproc_requests_total", served); got != 1 {
		t.Errorf("%v requests counted %v, want the panicking one, which Envoy answers 500", got, served)
	}
}

// panickyRouter panics on a body that says boom, as a bug would, and
// passes any other to fakeEndpoint.
type panickyRouter struct{}

func (panickyRouter) MaxBodyBytes() int64 { return 1 << 20 }
func (panickyRouter) RouteHeaders(*pipeline.Request) (*pipeline.Decision, error) {
	return &pipeline.Decision{Endpoints: []string{fakeEndpoint}}, nil
}
func (panickyRouter) Route(_ context.Context, r *pipeline.Request) (*pipeline.Decision, error) {
	if bytes.Contains(r.Body, []byte("boom")) {
		panic("boom")
	}
	return &pipeline.Decision{Endpoints: []string{fakeEndpoint}, Body: body.Spliced{r.Body}}, nil
}

// brokenAtRouting is a stream that breaks as the routing reply is sent (the
// client left, and Envoy reset the stream, just then): every earlier reply
// goes out, that one and any later fail. It breaks once the engine has the
// leg (arrived): a leg cut short as it is written may never reach it.
type brokenAtRouting struct {
	broken  bool
	arrived func()
}

func (b *brokenAtRouting) Send(m *extprocv3.ProcessingResponse) error {
	if !b.broken && metadataDestination(m) != "" {
		b.arrived()
		b.broken = true
	}
	if b.broken {
		return errors.New("the stream was reset")
	}
	return nil
}

// A concurrent prefill leg (kv-sglang, kv-mooncake) outlives its stream
// because a decode leg will pair with it; when the routing reply that
// would send that decode leg never reached Envoy, none will, and the leg is
// cut short at once. Before, it held its prefill engine and a slot of
// prefill.max_background until prefill.timeout.
func TestAConcurrentLegWhoseRoutingNeverWentOutEnds(t *testing.T) {
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{fullDuplex, buffered} {
		t.Run(mode.String(), func(t *testing.T) {
			prefill := newBlockingEngine(t, prefillOK)
			s := newServer(t, fmt.Sprintf(`connector: kv-sglang
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {timeout: 20s}`, prefill.Addr()), handlers.Options{}) // past the 10 s the test waits for the leg to end
			x := s.Open(t.Context(), &brokenAtRouting{arrived: func() { prefill.Await(t) }})
			err := sendChatIn(x, mode)
			x.Close()
			if err == nil {
				t.Fatal("the routing reply went out: the test shows nothing")
			}
			if err := prefill.outcome(t); !errors.Is(err, context.Canceled) {
				t.Errorf("the prefill leg ended with %v, want cancelled", err)
			}
		})
	}
}
