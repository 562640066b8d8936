package handlers

import (
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// maxLoggedBody bounds the body on the request line under --log-prompts.
const maxLoggedBody = 16 << 10

// secretHeaders are never logged with their value.
var secretHeaders = map[string]bool{
	"authorization": true, "proxy-authorization": true, "cookie": true, "set-cookie": true,
	"x-api-key": true, "api-key": true,
}

// redact returns the value of header key as it may be logged.
func redact(key, value string) string {
	if secretHeaders[key] {
		return "[REDACTED]"
	}
	return value
}

// begin starts the request's observation once its headers are read: its span,
// joined to the caller's trace.
func (x *exchange) begin() {
	ctx := x.opts.Propagator.Extract(x.ctx, x.traceHeaders)
	x.ctx, x.span = x.tracer.Start(ctx, "extproc.request", trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(
			semconv.HTTPRequestMethodKey.String(x.method),
			semconv.URLPath(x.req.Path),
			attribute.String("pd.request_id", x.req.RequestID),
		))
}

// routed ends the observation of a request Envoy has been told where to send.
func (x *exchange) routed() { x.conclude(metrics.OutcomeRouted, 0, "") }

// rejected ends the observation of a request answered with a local reply.
func (x *exchange) rejected(e *pipeline.Error) {
	outcome := metrics.Outcome4xx
	switch {
	case x.ctx.Err() != nil:
		outcome = metrics.OutcomeCancelled // nobody will see the reply
	case e.Status >= 500:
		outcome = metrics.Outcome5xx
	}
	x.conclude(outcome, e.Status, e.Message)
}

// abandon ends the observation of a stream that closed before its request was
// routed or rejected.
func (x *exchange) abandon() {
	x.conclude(metrics.OutcomeCancelled, 0, "the stream ended before the request was complete")
}

// conclude counts the request, ends its span and writes its one info line:
// decision, endpoints, timings, outcome. It acts once per stream.
func (x *exchange) conclude(outcome string, status int, reason string) {
	if !x.headersSeen || x.concluded {
		return
	}
	x.concluded = true
	rep := x.req.Report
	api := pipeline.APIOf(x.req.Path)
	// The prefill leg is the engine's time, not ours; what is left is parsing,
	// waiting for the body, and talking to Envoy.
	processing := max(time.Since(x.start)-rep.PrefillTime, 0)
	x.opts.Metrics.ObserveRequest(metrics.Request{API: api, Mode: rep.Mode, Outcome: outcome, Processing: processing})

	kv := []any{"requestID", x.req.RequestID, "api", api, "mode", modeOrNone(rep.Mode), "reason", rep.Reason, "outcome", outcome,
		"processing", processing, "prefill", rep.Prefill, "prefillTime", rep.PrefillTime}
	if x.decision != nil {
		kv = append(kv, "decode", x.decision.Endpoint)
	}
	if status != 0 {
		kv = append(kv, "status", status, "error", reason)
	}
	if x.body != nil {
		kv = append(kv, "bodyBytes", len(x.body))
		if x.opts.LogPrompts {
			kv = append(kv, "body", truncate(x.body, maxLoggedBody))
		}
	}
	x.endSpan(api, outcome, status, reason)
	x.log.Info("request", kv...)
}

// endSpan ends the request's span with the decision and outcome; with tracing
// off the span records nothing and the attributes are not built.
func (x *exchange) endSpan(api, outcome string, status int, reason string) {
	defer x.span.End()
	if !x.span.IsRecording() {
		return
	}
	rep := x.req.Report
	attrs := []attribute.KeyValue{
		attribute.String("pd.api", api), attribute.String("pd.mode", modeOrNone(rep.Mode)),
		attribute.String("pd.reason", rep.Reason), attribute.String("pd.outcome", outcome),
	}
	if rep.Prefill != "" {
		attrs = append(attrs, attribute.String("pd.prefill_endpoint", rep.Prefill))
	}
	if x.decision != nil {
		attrs = append(attrs, attribute.String("pd.decode_endpoint", x.decision.Endpoint))
	}
	if status != 0 {
		attrs = append(attrs, semconv.HTTPResponseStatusCode(status))
	}
	x.span.SetAttributes(attrs...)
	if status >= 500 {
		x.span.SetStatus(codes.Error, reason)
	}
}

func modeOrNone(mode string) string {
	if mode == "" {
		return metrics.ModeNone
	}
	return mode
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
