package handlers_test

import (
	"context"
	"net/http"
	"sync"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	otelcodes "go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// A request whose concurrent prefill leg fails is answered with the leg's
// error out of turn, while the decode engine has not answered: before its
// response headers, or after the 2xx headers of an event stream that has
// sent no event (Envoy then resets the stream and the decode request).
// Once the decode engine's answer has begun, it is left alone. After the
// call-back nothing more is sent, and the stream is done at its next message.
// The request's span ends with the leg, and says the call-back's 5xx.
func TestAFailedLegCallsTheRequestBack(t *testing.T) {
	sse := envoymsg.Header{"content-type", "text/event-stream"}
	jsonType := envoymsg.Header{"content-type", "application/json"}
	for _, tt := range []struct {
		name       string
		answer     []*extprocv3.ProcessingRequest // of the decode engine, before the leg fails
		ended      bool                           // the stream ends before the leg fails
		calledBack bool
	}{
		{"before the decode engine answers", nil, false, true},
		{"after the stream ended", nil, true, false},
		{"after an event stream's 200, before its first event", []*extprocv3.ProcessingRequest{
			envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, sse)}, false, true},
		{"after an event stream's first event", []*extprocv3.ProcessingRequest{
			envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, sse),
			envoymsg.Body(envoymsg.Response, []byte("data: {}\n\n"), false)}, false, false},
		{"after a whole answer's 200", []*extprocv3.ProcessingRequest{
			envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, jsonType)}, false, false},
		{"after an event stream's 500", []*extprocv3.ProcessingRequest{
			envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "500"}, sse)}, false, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			before := goleak.IgnoreCurrent()
			failed := make(chan *pipeline.Error, 1)
			exporter := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
			t.Cleanup(func() { tp.Shutdown(context.Background()) })
			s := handlers.NewServer(&fakeRouter{legFailed: failed}, handlers.Options{TracerProvider: tp}, logr.Discard())
			rec := newRecorder()
			x := s.Open(t.Context(), rec)
			end := sync.OnceFunc(x.Close) // as the stream ends
			defer end()
			msgs := append([]*extprocv3.ProcessingRequest{
				envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), fullDuplex, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
			}, tt.answer...)
			for _, m := range msgs {
				if done, err := x.Handle(m); done || err != nil {
					t.Fatalf("Handle: done %v, err %v", done, err)
				}
			}
			if tt.ended {
				end()
			}
			sent := len(rec.all())
			failed <- &pipeline.Error{Status: http.StatusBadGateway, Type: "upstream_error", Message: "prefill leg failed"}
			close(failed)
			goleak.VerifyNone(t, before) // the leg's watcher has acted
			checkCallBackSpan(t, exporter.GetSpans(), tt.calledBack)
			replies := rec.all()
			if got := len(replies) - sent; got != map[bool]int{true: 1, false: 0}[tt.calledBack] {
				t.Fatalf("%d replies after the leg failed, want one only if called back: %v", got, replies[sent:])
			}
			if !tt.calledBack {
				return
			}
			checkOpenAIError(t, replies, http.StatusBadGateway, "prefill leg failed")
			done, err := x.Handle(envoymsg.Body(envoymsg.Response, []byte("data: {}\n\n"), false))
			if !done || err != nil || len(rec.all()) != len(replies) {
				t.Errorf("a message after the call-back: done %v, err %v, %d more replies; want done and none", done, err, len(rec.all())-len(replies))
			}
		})
	}
}

// checkCallBackSpan checks the request's span, ended: the call-back's 502
// when there was one, no status otherwise.
func checkCallBackSpan(t *testing.T, spans tracetest.SpanStubs, calledBack bool) {
	t.Helper()
	if len(spans) != 1 {
		t.Fatalf("%d spans ended, want the request's", len(spans))
	}
	want := map[string]string{"http.response.status_code": "", "error.type": "", "pd.outcome": "routed"}
	wantCode := otelcodes.Unset
	if calledBack {
		want["http.response.status_code"], want["error.type"], wantCode = "502", "502", otelcodes.Error
	}
	for key, value := range want {
		got := ""
		for _, a := range spans[0].Attributes {
			if string(a.Key) == key {
				got = a.Value.Emit()
			}
		}
		if got != value {
			t.Errorf("span %s = %q, want %q", key, got, value)
		}
	}
	if spans[0].Status.Code != wantCode {
		t.Errorf("span status %v, want %v", spans[0].Status.Code, wantCode)
	}
}
