package handlers_test

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// decisions is the sum of pd_decisions_total over its reasons.
func decisions(m *metrics.Metrics) (n float64) {
	for _, r := range metrics.Reasons() {
		v, _ := m.Sample("pd_extproc_pd_decisions_total", map[string]string{"reason": r})
		n += v
	}
	return n
}

// sender is where an exchange sends its replies.
type sender interface {
	Send(*extprocv3.ProcessingResponse) error
}

// A decision is counted when Envoy is told it: one whose routing reply broke
// on its way (the client left just then) reached no engine, and its request
// is counted cancelled.
func TestADecisionIsCountedOnlyOnceSent(t *testing.T) {
	tests := []struct {
		name          string
		sink          func() sender
		wantDecisions float64
		wantOutcome   string
	}{
		{"sent", func() sender { return &routedSink{} }, 1, metrics.OutcomeRouted},
		{"never sent", func() sender { return &brokenAtRouting{arrived: func() {}} }, 0, metrics.OutcomeCancelled},
	}
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{fullDuplex, buffered} {
		for _, tt := range tests {
			t.Run(mode.String()+"/"+tt.name, func(t *testing.T) {
				m := metrics.New("kv-nixl")
				p := newPipeline(t, `{connector: kv-nixl, pools: {decode: {endpoints: ["10.1.1.1:8000"]}}}`, pipeline.WithMetrics(m))
				s := handlers.NewServer(p, handlers.Options{Metrics: m}, logr.Discard())
				x := s.Open(t.Context(), tt.sink())
				_ = sendChatIn(x, mode) // a reply that does not go out is the case tested
				x.Close()
				if got := decisions(m); got != tt.wantDecisions {
					t.Errorf("pd_decisions_total = %v, want %v", got, tt.wantDecisions)
				}
				labels := map[string]string{"api": api.NameChat, "mode": metrics.ModeDecodeOnly.String(), "connector": "kv-nixl", "outcome": tt.wantOutcome}
				if got, _ := m.Sample("pd_extproc_requests_total", labels); got != 1 {
					t.Errorf("requests_total%v = %v, want 1", labels, got)
				}
			})
		}
	}
}

// A prefill answer without usage is counted prefill_missing when Envoy is
// told the routing, as the decision is: one whose routing reply broke on its
// way reached no engine, and its usage, as any answer's that never came, is
// unseen.
func TestAMissingPrefillUsageIsCountedOnlyOnceSent(t *testing.T) {
	prefill := enginetest.Start(t, enginetest.JSON(200, `{"id":"x","choices":[{"text":"a"}],"kv_transfer_params":`+nixlParams+`}`))
	tests := []struct {
		name string
		sink func() sender
		want string
	}{
		{"sent", func() sender { return &routedSink{} }, metrics.UsagePrefillMissing},
		{"never sent", func() sender { return &brokenAtRouting{arrived: func() {}} }, metrics.UsageUnseen},
	}
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{fullDuplex, buffered} {
		for _, tt := range tests {
			t.Run(mode.String()+"/"+tt.name, func(t *testing.T) {
				m := metrics.New("kv-nixl")
				p := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pd: {mode: always}
response: {rewrite_usage: true}
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, prefill.Addr()), pipeline.WithMetrics(m))
				x := handlers.NewServer(p, handlers.Options{Metrics: m}, logr.Discard()).Open(t.Context(), tt.sink())
				_ = sendChatIn(x, mode) // a reply that does not go out is the case tested
				x.Close()
				if got := usageRewrites(m); len(got) != 1 || got[tt.want] != 1 {
					t.Errorf("usage_rewrites_total %v, want %s once", got, tt.want)
				}
			})
		}
	}
}

// panickyPropagator panics as it reads a request's trace context, a bug
// before the request's observation has begun.
type panickyPropagator struct{ propagation.TraceContext }

func (panickyPropagator) Extract(context.Context, propagation.TextMapCarrier) context.Context {
	panic("boom")
}

// A panic on the request path (a bug) ends its stream with INTERNAL, which
// Envoy answers 500: the request is counted 5xx, wherever it panicked.
func TestAPanickedRequestIsCounted5xx(t *testing.T) {
	tests := []struct {
		name string
		opts handlers.Options
		body string
	}{
		{"routing", handlers.Options{}, `{"model":"m","prompt":"boom"}`},
		{"reading the headers", handlers.Options{Propagator: panickyPropagator{}}, `{"model":"m","prompt":"hi"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := metrics.New("kv-nixl")
			tt.opts.Metrics = m
			c := startServer(t, handlers.NewServer(panickyRouter{}, tt.opts, logr.Discard()))
			_, err := tryExchange(c, true,
				envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(tt.body))...), fullDuplex, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(tt.body), true))
			if status.Code(err) != codes.Internal {
				t.Fatalf("the stream ended with %v, want INTERNAL", err)
			}
			if got, _ := m.Sample("pd_extproc_panics_total", nil); got != 1 {
				t.Errorf("%v panics counted, want 1", got)
			}
			labels := map[string]string{"api": api.NameChat, "mode": metrics.ModeNone.String(), "connector": "kv-nixl", "outcome": metrics.Outcome5xx}
			if got, _ := m.Sample("pd_extproc_requests_total", labels); got != 1 {
				t.Errorf("requests_total%v = %v, want 1: Envoy answered it 500", labels, got)
			}
		})
	}
}

// headersRouter routes every request from its headers with d, or refuses it
// with err.
type headersRouter struct {
	d   *pipeline.Decision
	err error
}

func (h headersRouter) MaxBodyBytes() int64 { return 1 << 20 }
func (h headersRouter) RouteHeaders(*pipeline.Request) (*pipeline.Decision, error) {
	return h.d, h.err
}
func (h headersRouter) Route(context.Context, *pipeline.Request) (*pipeline.Decision, error) {
	return h.d, h.err
}

// The request's span says the status pd-extproc answered with, its own 200
// included, as OpenTelemetry's HTTP server spans do
// (http.response.status_code whenever one was sent; status Error, with
// error.type the status code, for a 5xx only). A routed request's status is
// the engine's, which this span never sees.
func TestTheRequestSpanSaysTheStatusAnswered(t *testing.T) {
	tests := []struct {
		name       string
		router     headersRouter
		wantStatus string // http.response.status_code, "" for none
		wantCode   otelcodes.Code
		wantType   string // error.type, "" for none
	}{
		{"answered itself", headersRouter{d: &pipeline.Decision{Answer: []byte(`{"object":"list","data":[]}`)}}, "200", otelcodes.Unset, ""},
		{"routed", headersRouter{d: &pipeline.Decision{Endpoints: []string{fakeEndpoint}}}, "", otelcodes.Unset, ""},
		{"refused 404", headersRouter{err: &pipeline.Error{Status: http.StatusNotFound, Message: "no"}}, "404", otelcodes.Unset, ""},
		{"body timeout 408", headersRouter{err: pipeline.BodyTimeout(time.Second)}, "408", otelcodes.Unset, ""},
		{"too large 413", headersRouter{err: pipeline.TooLarge(1)}, "413", otelcodes.Unset, ""},
		{"overloaded 429", headersRouter{err: pipeline.Overloaded(1, time.Second)}, "429", otelcodes.Unset, ""},
		{"bad gateway 502", headersRouter{err: &pipeline.Error{Status: http.StatusBadGateway, Message: "the prefill leg failed"}}, "502", otelcodes.Error, "502"},
		{"refused 503", headersRouter{err: pipeline.BuffersFull(1, time.Second)}, "503", otelcodes.Error, "503"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			exporter := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
			t.Cleanup(func() { tp.Shutdown(context.Background()) })
			s := handlers.NewServer(tt.router, handlers.Options{TracerProvider: tp}, logr.Discard())
			x := s.Open(t.Context(), &routedSink{})
			if _, err := x.Handle(envoymsg.Headers(envoymsg.Request, true, envoymsg.Header{":method", "GET"}, envoymsg.Header{":path", "/v1/models"})); err != nil {
				t.Fatal(err)
			}
			x.Close()
			spans := exporter.GetSpans()
			if len(spans) != 1 {
				t.Fatalf("%d spans, want the request's", len(spans))
			}
			var status, errorType string
			for _, a := range spans[0].Attributes {
				switch a.Key {
				case "http.response.status_code":
					status = a.Value.Emit()
				case "error.type":
					errorType = a.Value.Emit()
				}
			}
			if status != tt.wantStatus || spans[0].Status.Code != tt.wantCode || errorType != tt.wantType {
				t.Errorf("http.response.status_code %q, status %v, error.type %q; want %q, %v, %q",
					status, spans[0].Status.Code, errorType, tt.wantStatus, tt.wantCode, tt.wantType)
			}
		})
	}
}

// usageRewrites is pd_extproc_usage_rewrites_total by outcome, of those not 0.
func usageRewrites(m *metrics.Metrics) map[string]float64 {
	got := map[string]float64{}
	for _, o := range []string{"rewritten", "absent", "prefill_missing", "too_large", "not_rewritable", "not_full_duplex", "unseen", "cancelled"} {
		if v, _ := m.Sample("pd_extproc_usage_rewrites_total", map[string]string{"outcome": o}); v != 0 {
			got[o] = v
		}
	}
	return got
}

// Every P/D answer whose usage is to be rewritten counts once, also when
// its end never reaches pd-extproc: the alert's ratio needs them all.
func TestEveryUsageRewriteCountsAnOutcome(t *testing.T) {
	const usage = `"usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":7}}`
	prefill := enginetest.Start(t, enginetest.JSON(200, `{"id":"x","choices":[{"text":"a"}],"kv_transfer_params":`+nixlParams+`,`+usage+`}`))
	headers := envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, envoymsg.Header{"content-type", "text/event-stream"})
	last := `data: {"id":"x","choices":[],` + usage + "}\n\ndata: [DONE]\n\n"
	tests := []struct {
		name   string
		answer []*extprocv3.ProcessingRequest
		want   string
	}{
		{"answered", []*extprocv3.ProcessingRequest{headers, envoymsg.Body(envoymsg.Response, []byte(last), true)}, "rewritten"},
		{"response headers skipped by Envoy", nil, "unseen"},
		{"client left mid-answer", []*extprocv3.ProcessingRequest{headers, envoymsg.Body(envoymsg.Response, []byte("data: {}\n\n"), false)}, "cancelled"},
		{"client left after the usage", []*extprocv3.ProcessingRequest{headers, envoymsg.Body(envoymsg.Response, []byte(last), false)}, "rewritten"},
		{"headers end an empty answer", []*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Response, true, envoymsg.Header{":status", "200"}, envoymsg.Header{"content-type", "text/event-stream"})}, "absent"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := metrics.New("kv-nixl")
			p := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pd: {mode: always}
response: {rewrite_usage: true}
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, prefill.Addr()), pipeline.WithMetrics(m))
			x := handlers.NewServer(p, handlers.Options{Metrics: m}, logr.Discard()).Open(t.Context(), &routedSink{})
			msgs := append([]*extprocv3.ProcessingRequest{
				envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), fullDuplex, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
			}, tt.answer...)
			for _, msg := range msgs {
				if _, err := x.Handle(msg); err != nil {
					t.Fatal(err)
				}
			}
			x.Close()
			if got := usageRewrites(m); len(got) != 1 || got[tt.want] != 1 {
				t.Errorf("usage_rewrites_total %v, want %s once", got, tt.want)
			}
		})
	}
}
