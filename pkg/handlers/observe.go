package handlers

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// maxLoggedBody bounds the body on the request line under --log-prompts.
const maxLoggedBody = 16 << 10

// loggedHeaders are the request headers logged with their value (-v 2);
// every other header is logged as [REDACTED]. An allowlist, because a list
// of secrets is never complete: each API and gateway brings its own key
// header (x-goog-api-key, x-auth-token, ...). What is here describes the
// request, its routing and its trace, and carries no credential or personal
// data (not x-forwarded-for or x-envoy-external-address: client addresses).
var loggedHeaders = map[string]bool{
	":method": true, ":scheme": true, ":authority": true, ":path": true,
	"content-type": true, "content-length": true, "content-encoding": true, "transfer-encoding": true,
	"accept": true, "accept-encoding": true, "user-agent": true, "te": true,
	RequestIDHeader: true, "traceparent": true, "tracestate": true, DestinationHeader: true,
	"x-forwarded-proto": true, "x-envoy-expected-rq-timeout-ms": true, ObjectiveHeader: true, LLMDObjectiveHeader: true,
	FairnessHeader: true, LLMDFairnessHeader: true,
}

// redact returns the value of header key as it may be logged: the path
// without its query (it may carry an api_key), other headers only when
// allowed.
func redact(key, value string) string {
	switch {
	case !loggedHeaders[key]:
		return "[REDACTED]"
	case key == ":path":
		if path, _, query := strings.Cut(value, "?"); query {
			return path + "?[REDACTED]"
		}
	}
	return value
}

// observer is what the observations of every stream share: where requests
// are counted, logged and traced.
type observer struct {
	metrics     *metrics.Metrics
	log         logr.Logger
	tracer      trace.Tracer
	propagator  propagation.TextMapPropagator
	traceFields map[string]bool // headers the propagator reads
	logPrompts  bool
	// notDuplex: the warning that a usage rewrite cannot see the response
	// body has been logged; it is a config problem, said once per process.
	notDuplex sync.Once
	// notFollowed: the warning that the gateway served a request from an
	// endpoint it was not offered (exchange.servedBy), once per process.
	notFollowed sync.Once
}

// observation is what one request's metrics, log line and span are made of.
// It concludes once: routed, rejected or abandoned, whichever comes first.
type observation struct {
	*observer
	req   *pipeline.Request // set by begin
	start time.Time
	// span is the request's from begin until the observation concludes, and
	// nil outside that time.
	span trace.Span
	// leg is the span of a routed request whose concurrent prefill leg may
	// still answer it (watchLeg), which ends it.
	leg  trace.Span
	done bool // concluded
}

// begin starts the observation of r, whose headers hm arrived at start: its
// span, joined to the caller's trace. It returns ctx carrying the span.
func (o *observation) begin(ctx context.Context, r *pipeline.Request, hm *corev3.HeaderMap, start time.Time) context.Context {
	var traceHeaders propagation.MapCarrier
	for _, h := range hm.GetHeaders() {
		if key := h.GetKey(); o.traceFields[key] {
			if traceHeaders == nil {
				traceHeaders = propagation.MapCarrier{}
			}
			traceHeaders[key] = headerValue(h)
		}
	}
	o.req, o.start = r, start
	ctx, o.span = o.tracer.Start(o.propagator.Extract(ctx, traceHeaders), "extproc.request", trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(
			semconv.HTTPRequestMethodKey.String(r.Method),
			semconv.URLPath(r.URLPath()),
			attribute.String("pd.request_id", r.RequestID),
		))
	return ctx
}

// routed ends the observation of a request Envoy has been told to send to d.
func (o *observation) routed(d *pipeline.Decision, body []byte) {
	o.conclude(metrics.OutcomeRouted, nil, d, body)
}

// answered ends the observation of a request pd-extproc answered itself
// (Decision.Answer), routing nothing.
func (o *observation) answered(body []byte) {
	o.conclude(metrics.OutcomeAnswered, nil, nil, body)
}

// rejected ends the observation of a request answered with a local reply;
// cancelled says nobody will see it. No decision is held then: routing failed
// or never ran.
func (o *observation) rejected(e *pipeline.Error, cancelled bool, body []byte) {
	switch {
	case cancelled: // nobody was answered: no status, in the log line or the span
		o.conclude(metrics.OutcomeCancelled, nil, nil, body)
	case e.Status >= 500:
		o.conclude(metrics.Outcome5xx, e, nil, body)
	default:
		o.conclude(metrics.Outcome4xx, e, nil, body)
	}
}

// panicked ends the observation of a request whose handling panicked (p):
// Envoy answers it 500, so it is counted 5xx even when it panicked before
// its observation began (r is then what was read of it).
func (o *observation) panicked(r *pipeline.Request, p any, body []byte) {
	if o.req == nil {
		o.req, o.start = r, time.Now()
	}
	o.rejected(pipeline.AsError(fmt.Errorf("panic: %v", p), r.RequestID), false, body)
}

// abandon ends the observation of a stream that closed before its request was
// routed or rejected.
func (o *observation) abandon(d *pipeline.Decision, body []byte) {
	o.conclude(metrics.OutcomeCancelled, nil, d, body)
}

// conclude counts the request, ends its span and writes its one info line:
// decision, endpoints, timings, outcome, and the local reply e when there is
// one. It acts once, and only on a request begun.
func (o *observation) conclude(outcome string, e *pipeline.Error, d *pipeline.Decision, body []byte) {
	if o.req == nil || o.done {
		return
	}
	o.done = true
	rep := o.req.Report
	api := pipeline.APIOf(o.req)
	// The prefill leg is the engine's time and the hold the engines' lack of
	// room, not ours; what is left is parsing, waiting for the body, and
	// talking to Envoy.
	processing := max(time.Since(o.start)-rep.PrefillTime-rep.HeldTime, 0)
	o.metrics.ObserveRequest(metrics.Request{API: api, Mode: rep.Mode, Reason: rep.Reason, Outcome: outcome,
		UsageMissing: rep.UsageMissing, Processing: processing})

	fields := []any{"requestID", o.req.RequestID, "api", api, "mode", rep.Mode.String(), "reason", rep.Reason.String(), "outcome", outcome,
		"processing", processing, "prefill", rep.Prefill, "prefillTime", rep.PrefillTime}
	if rep.HeldTime > time.Millisecond {
		fields = append(fields, "heldTime", rep.HeldTime)
	}
	if d != nil {
		fields = append(fields, "decode", destination(d))
	}
	if e != nil {
		fields = append(fields, "status", e.Status, "error", e.Message)
		if e.Detail != "" {
			fields = append(fields, "detail", e.Detail)
		}
	}
	if body != nil {
		fields = append(fields, "bodyBytes", len(body))
		if o.logPrompts {
			fields = append(fields, "body", truncate(body, maxLoggedBody))
		}
	}
	if o.span != nil { // nil when begin panicked
		o.endSpan(api, outcome, e, d)
		o.span = nil
	}
	o.log.Info("request", fields...)
}

// endSpan ends the request's span with the decision and outcome, or leaves
// it to the watch of a concurrent prefill leg (leg); with tracing off the
// span records nothing and the attributes are not built.
func (o *observation) endSpan(api, outcome string, e *pipeline.Error, d *pipeline.Decision) {
	if outcome == metrics.OutcomeRouted && d != nil && d.LegFailed != nil {
		o.leg = o.span
	} else {
		defer o.span.End()
	}
	if !o.span.IsRecording() {
		return
	}
	rep := o.req.Report
	attrs := []attribute.KeyValue{
		attribute.String("pd.api", api), attribute.String("pd.mode", rep.Mode.String()),
		attribute.String("pd.reason", rep.Reason.String()), attribute.String("pd.outcome", outcome),
	}
	if rep.Prefill != "" {
		attrs = append(attrs, attribute.String("pd.prefill_endpoint", rep.Prefill))
	}
	if d != nil {
		attrs = append(attrs, attribute.String("pd.decode_endpoint", destination(d)))
	}
	o.span.SetAttributes(attrs...)
	switch {
	case e != nil:
		answeredWith(o.span, e.Status, e.Message)
	case outcome == metrics.OutcomeAnswered:
		answeredWith(o.span, http.StatusOK, "") // answerItself
	}
}

// answeredWith writes on span the status pd-extproc answered with, its own
// 200 included; only a 5xx makes the span's status Error, with error.type the
// code (https://github.com/open-telemetry/semantic-conventions/blob/v1.45.0/docs/http/http-spans.md).
func answeredWith(span trace.Span, status int, message string) {
	span.SetAttributes(semconv.HTTPResponseStatusCode(status))
	if status >= 500 {
		span.SetAttributes(semconv.ErrorTypeKey.String(strconv.Itoa(status)))
		span.SetStatus(codes.Error, message)
	}
}

// truncate returns at most n bytes of b as a string, cut on a rune boundary.
func truncate(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	for n > 0 && !utf8.RuneStart(b[n]) {
		n--
	}
	return string(b[:n]) + "…[truncated]"
}
