package server

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	otelcodes "go.opentelemetry.io/otel/codes"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
)

const (
	callerTrace  = "4bf92f3577b34da6a3ce929d0e0e4736"
	callerSpan   = "00f067aa0ba902b7"
	callerParent = "00-" + callerTrace + "-" + callerSpan + "-01"
)

func TestRequestSpanJoinsTheCallerAndPropagatesToPrefill(t *testing.T) {
	tests := []struct {
		name        string
		traceparent string // "" when the client sent none
		tracing     bool   // an SDK provider with an in-memory exporter; false: tracing off
	}{
		{name: "caller's trace continued", traceparent: callerParent, tracing: true},
		{name: "new trace when the caller sent none", tracing: true},
		{name: "tracing off still passes the caller's trace on", traceparent: callerParent},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			exporter := tracetest.NewInMemoryExporter()
			opts := Options{}
			if tt.tracing {
				tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
				t.Cleanup(func() { tp.Shutdown(context.Background()) })
				opts.TracerProvider = tp
			}
			prefill := enginetest.Start(t, prefillOK)
			r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
				prefill.Addr(), decodeEP), opts, logr.Discard())
			var extra []hdr
			if tt.traceparent != "" {
				extra = append(extra, hdr{"traceparent", tt.traceparent})
			}
			r.exchange(t, post(chatPath+"?api_key=k", `{"model":"m","prompt":"hi"}`, extra...)...)

			got := prefill.Requests()
			if len(got) != 1 {
				t.Fatalf("prefill engine got %d requests, want 1", len(got))
			}
			sent, err := parseTraceparent(got[0].Header.Get("Traceparent"))
			if err != nil {
				t.Fatalf("prefill request traceparent: %v", err)
			}

			if !tt.tracing {
				if sent.TraceID().String() != callerTrace || sent.SpanID().String() != callerSpan {
					t.Errorf("prefill traceparent = %q, want the caller's %q passed through", got[0].Header.Get("Traceparent"), callerParent)
				}
				return
			}
			spans := map[string]tracetest.SpanStub{}
			for _, s := range exporter.GetSpans() {
				spans[s.Name] = s
			}
			request, ok := spans["extproc.request"]
			if !ok {
				t.Fatalf("no request span among %d ended spans", len(spans))
			}
			leg, ok := spans["prefill"]
			if !ok {
				t.Fatalf("no prefill span among %d ended spans", len(spans))
			}
			traceID := request.SpanContext.TraceID()
			if tt.traceparent != "" && (traceID.String() != callerTrace || request.Parent.SpanID().String() != callerSpan) {
				t.Errorf("request span trace %s parent %s, want the caller's %s/%s", traceID, request.Parent.SpanID(), callerTrace, callerSpan)
			}
			if tt.traceparent == "" && request.Parent.IsValid() {
				t.Errorf("request span has parent %s, want a new root", request.Parent.SpanID())
			}
			if leg.SpanContext.TraceID() != traceID || leg.Parent.SpanID() != request.SpanContext.SpanID() {
				t.Errorf("prefill span %s/%s parent %s, want a child of the request span %s", leg.SpanContext.TraceID(),
					leg.SpanContext.SpanID(), leg.Parent.SpanID(), request.SpanContext.SpanID())
			}
			if leg.SpanKind != trace.SpanKindClient || request.SpanKind != trace.SpanKindServer {
				t.Errorf("span kinds request %v prefill %v, want server and client", request.SpanKind, leg.SpanKind)
			}
			if sent.TraceID() != traceID || sent.SpanID() != leg.SpanContext.SpanID() {
				t.Errorf("prefill engine got traceparent %q, want trace %s with the prefill span %s as parent",
					got[0].Header.Get("Traceparent"), traceID, leg.SpanContext.SpanID())
			}
			for key, want := range map[attribute.Key]string{"pd.mode": "pd", "pd.reason": "long_prompt", "pd.outcome": "routed",
				"pd.decode_endpoint": decodeEP, "pd.prefill_endpoint": prefill.Addr()} {
				if v := attr(request.Attributes, key); v != want {
					t.Errorf("request span %s = %q, want %q", key, v, want)
				}
			}
			// The query may carry a credential: no span records it.
			for _, s := range []tracetest.SpanStub{request, leg} {
				if v := attr(s.Attributes, "url.path"); v != chatPath {
					t.Errorf("%s span url.path = %q, want %q without the query", s.Name, v, chatPath)
				}
			}
		})
	}
}

func attr(attrs []attribute.KeyValue, key attribute.Key) string {
	for _, a := range attrs {
		if a.Key == key {
			return a.Value.Emit()
		}
	}
	return ""
}

// parseTraceparent reads a W3C traceparent header with the standard propagator.
func parseTraceparent(h string) (trace.SpanContext, error) {
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{"traceparent": h})
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return sc, fmt.Errorf("%q is not a valid traceparent", h)
	}
	return sc, nil
}

func TestTracingIsOffUnlessConfigured(t *testing.T) {
	ratio := 0.5
	tests := []struct {
		name string
		cfg  config.Tracing
		env  map[string]string
		want bool // an SDK provider, exporting
	}{
		{name: "nothing set", want: false},
		{name: "config endpoint", cfg: config.Tracing{OTLPEndpoint: "http://127.0.0.1:4317", SampleRatio: &ratio}, want: true},
		{name: "standard environment variable", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, want: true},
		{name: "traces-only environment variable", env: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, want: true},
		{name: "SDK disabled wins", cfg: config.Tracing{OTLPEndpoint: "http://127.0.0.1:4317"},
			env: map[string]string{"OTEL_SDK_DISABLED": "true"}, want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, k := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"} {
				t.Setenv(k, tt.env[k])
			}
			tp, shutdown, err := newTracerProvider(context.Background(), tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer shutdown(context.Background())
			_, sdk := tp.(*sdktrace.TracerProvider)
			_, off := tp.(noop.TracerProvider)
			if sdk != tt.want || off == tt.want || TracingEnabled(tt.cfg) != tt.want {
				t.Errorf("provider %T, TracingEnabled %v; want tracing on = %v", tp, TracingEnabled(tt.cfg), tt.want)
			}
		})
	}
}

// TestAClientGoneDuringPrefillIsNoErrorAnswer: a request whose client
// (Envoy) leaves while its prefill leg runs was answered nothing: its span
// and its log line say cancelled, with no HTTP status and no error. They
// said 503, and the reason prefill_failed, though no engine failed.
func TestAClientGoneDuringPrefillIsNoErrorAnswer(t *testing.T) {
	exporter := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	logs := &logLines{}
	release := make(chan struct{})
	defer close(release)
	prefill := enginetest.Start(t, blocked(release, prefillOK))
	r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
		prefill.Addr(), decodeEP), Options{TracerProvider: tp}, funcr.NewJSON(logs.add, funcr.Options{}))
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := r.ext.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range post(chatPath, `{"model":"m","prompt":"hi"}`) {
		if err := stream.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	prefill.Await(t)
	cancel() // the client gives up
	var request *tracetest.SpanStub
	for deadline := time.Now().Add(5 * time.Second); request == nil; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the request's span never ended")
		}
		for _, s := range exporter.GetSpans() {
			if s.Name == "extproc.request" {
				request = &s
			}
		}
	}
	if status := attr(request.Attributes, "http.response.status_code"); request.Status.Code == otelcodes.Error || status != "" ||
		attr(request.Attributes, "pd.outcome") != "cancelled" || attr(request.Attributes, "pd.reason") == "prefill_failed" {
		t.Errorf("span: outcome %s, reason %s, status %v, http.response.status_code %q; want cancelled, no failure, no status",
			attr(request.Attributes, "pd.outcome"), attr(request.Attributes, "pd.reason"), request.Status.Code, status)
	}
	for _, l := range logs.all(t) {
		if _, ok := l["status"]; l["msg"] == "request" && (ok || l["reason"] == "prefill_failed") {
			t.Errorf("request line %v: the client was told nothing, and no engine failed", l)
		}
	}
}

// TestAPrefillSpanCarriesTheEnginesStatus: a kv-sglang prefill engine that
// answers 200 and then an error event failed, and its span says so, with
// the HTTP status the engine sent, 200, not the 500 of the event.
func TestAPrefillSpanCarriesTheEnginesStatus(t *testing.T) {
	exporter := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	prefill := enginetest.Start(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"error\": {\"message\": \"x\", \"code\": 500}}\n\ndata: [DONE]\n\n")
	})
	r := start(t, fmt.Sprintf("connector: kv-sglang\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
		prefill.Addr(), decodeEP), Options{TracerProvider: tp}, logr.Discard())
	r.exchange(t, post(chatPath, `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`)...)
	r.pipeline.Wait()
	spans := 0
	for _, s := range exporter.GetSpans() {
		if s.Name != "prefill" {
			continue
		}
		spans++
		if code := attr(s.Attributes, "http.response.status_code"); code != "200" || s.Status.Code != otelcodes.Error {
			t.Errorf("prefill span: status code %q, span status %v; want 200 and an error", code, s.Status.Code)
		}
	}
	if spans != 1 {
		t.Fatalf("%d prefill spans, want 1", spans)
	}
}
