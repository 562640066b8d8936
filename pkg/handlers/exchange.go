package handlers

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// Supported request body modes, named in the error for the others. NONE serves
// only requests without a body.
const (
	supportedModes = "FULL_DUPLEX_STREAMED, BUFFERED or NONE"
	scrubbingModes = "FULL_DUPLEX_STREAMED or BUFFERED"
)

// exchange is the state of one Process stream: one HTTP request and its response.
type exchange struct {
	*Server
	stream extprocv3.ExternalProcessor_ProcessServer
	ctx    context.Context // the stream's, carrying the request span once headers are in

	requestMode, responseMode filterv3.ProcessingMode_BodySendMode

	headersSeen   bool
	req           pipeline.Request
	contentLength int64 // -1 when the client sent none
	body          []byte
	pooled        bool // body is a buffer from takeBuffer
	overloaded    bool // over Options.MaxStreams: refuse with 429
	requestDone   bool // the request body has been handled: later chunks are dropped (envoy#46237)
	responseDone  bool
	decision      *pipeline.Decision

	// Observability of the request path: see observe.go.
	start        time.Time // first message
	method       string
	traceHeaders propagation.MapCarrier
	span         trace.Span
	concluded    bool // counted and logged
}

// handle answers one message. done means the stream is finished for us.
func (x *exchange) handle(req *extprocv3.ProcessingRequest) (done bool, err error) {
	if pc := req.GetProtocolConfig(); pc != nil {
		x.requestMode, x.responseMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
	}
	switch m := req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		x.req.Subset = subsetHint(req.GetMetadataContext())
		return x.onRequestHeaders(m.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return x.onRequestBody(m.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return x.onRequestTrailers()
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		x.observeStatus(m.ResponseHeaders.GetHeaders())
		return false, x.send(continueReply("response_headers"))
	case *extprocv3.ProcessingRequest_ResponseBody:
		return false, x.onResponseBody(m.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return false, x.send(continueReply("response_trailers"))
	}
	return false, nil
}

func (x *exchange) onRequestHeaders(h *extprocv3.HttpHeaders) (bool, error) {
	if x.headersSeen {
		x.log.V(1).Info("ignoring repeated request headers", "requestID", x.req.RequestID)
		return false, nil
	}
	x.headersSeen = true
	x.start = time.Now()
	x.readHeaders(h.GetHeaders())
	x.begin()
	if x.overloaded {
		return x.fail(pipeline.Overloaded(x.opts.MaxStreams, x.opts.RetryAfter))
	}

	if x.requestMode == filterv3.ProcessingMode_NONE && !h.GetEndOfStream() && x.contentLength != 0 {
		// The body would reach the engine unseen, with any kv_transfer_params or
		// bootstrap fields the client put in it (DESIGN §5): refuse, do not route.
		return x.fail(pipeline.Misconfigured("ext_proc request_body_mode NONE cannot check a request body for fields " +
			"that steer the engines; configure " + scrubbingModes))
	}
	if h.GetEndOfStream() || x.requestMode == filterv3.ProcessingMode_NONE {
		// No body will follow: route from the headers.
		x.requestDone = true
		d, err := x.router.RouteHeaders(&x.req)
		if err != nil {
			return x.fail(err)
		}
		x.decision = d
		if err := x.send(headersReply(d, x.req.RequestID)); err != nil {
			return false, err
		}
		x.routed()
		return false, nil
	}
	if limit := x.router.MaxBodyBytes(); x.contentLength > limit {
		return x.fail(pipeline.TooLarge(limit))
	}
	switch x.requestMode {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return false, nil // the headers reply carries the routing: hold it until the body is in
	case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
		// Envoy holds the body until the headers are answered, then sends it whole;
		// the body reply can still set headers, so routing waits for it.
		return false, x.send(headersReply(nil, ""))
	default:
		return x.fail(pipeline.Misconfigured(fmt.Sprintf(
			"ext_proc request_body_mode %s is not supported: routing depends on the body; configure %s", x.requestMode, supportedModes)))
	}
}

func (x *exchange) onRequestBody(b *extprocv3.HttpBody) (bool, error) {
	if x.requestDone || !x.headersSeen {
		x.log.V(1).Info("dropping request body after its end", "requestID", x.req.RequestID, "bytes", len(b.GetBody()))
		return false, nil
	}
	x.appendBody(b)
	if limit := x.router.MaxBodyBytes(); int64(len(x.body)) > limit {
		return x.fail(pipeline.TooLarge(limit))
	}
	switch x.requestMode {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if !b.GetEndOfStream() {
			x.req.Arrived(x.body) // validate while the rest is on its way
			return false, nil
		}
		return x.finishDuplex(false)
	case filterv3.ProcessingMode_BUFFERED_PARTIAL:
		if !b.GetEndOfStream() {
			return x.fail(pipeline.Misconfigured("the request body exceeded Envoy's buffer in BUFFERED_PARTIAL mode, " +
				"so it cannot be rewritten; configure " + supportedModes))
		}
	}
	// BUFFERED sends the whole body in one message, end_of_stream false only when
	// trailers follow; either way the body is complete.
	return x.finishBuffered()
}

// appendBody collects the body without copying it more than once: a body that
// comes whole (BUFFERED, or a small FULL_DUPLEX body) is used as gRPC decoded
// it; a chunked one goes into a pooled buffer sized once from Content-Length,
// which the limit was checked against, so it never regrows (bodies.go).
func (x *exchange) appendBody(b *extprocv3.HttpBody) {
	chunk := b.GetBody()
	switch {
	case x.body == nil && (b.GetEndOfStream() || x.requestMode != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED):
		x.body = chunk
	case x.body == nil && x.contentLength > 0:
		x.body = takeBuffer(int(max(x.contentLength, int64(len(chunk)))))
		x.pooled = true
		fallthrough
	default:
		x.body = append(x.body, chunk...)
	}
}

// releaseBody gives a pooled body buffer back once the stream is over, unless
// a prefill leg may still be reading it.
func (x *exchange) releaseBody() {
	if x.pooled && !x.req.BodyHeld() {
		giveBack(x.body)
	}
}

func (x *exchange) onRequestTrailers() (bool, error) {
	if x.requestMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED && x.headersSeen && !x.requestDone {
		// Trailers end a FULL_DUPLEX body whose last chunk had no end_of_stream.
		return x.finishDuplex(true)
	}
	return false, x.send(continueReply("request_trailers"))
}

// finishDuplex routes a complete FULL_DUPLEX request: the held headers reply with
// the routing, then the new body as streamed chunks, then (with trailers) the
// trailers reply.
func (x *exchange) finishDuplex(trailers bool) (bool, error) {
	x.requestDone = true
	d, err := x.route(false)
	if err != nil {
		return x.fail(err)
	}
	x.decision = d
	if err := x.send(headersReply(d, x.req.RequestID)); err != nil {
		return false, err
	}
	cut := d.Body.Chunks(maxStreamedChunk)
	for i, c := range cut {
		if err := x.send(streamedChunk(true, c, !trailers && i == len(cut)-1)); err != nil {
			return false, err
		}
	}
	x.routed()
	if trailers {
		return false, x.send(continueReply("request_trailers"))
	}
	return false, nil
}

// finishBuffered routes a complete BUFFERED request in the body reply.
func (x *exchange) finishBuffered() (bool, error) {
	x.requestDone = true
	d, err := x.route(true)
	if err != nil {
		return x.fail(err)
	}
	x.decision = d
	// Envoy keeps the body it buffered unless the reply replaces it: a body the
	// pipeline passed on untouched is not sent back.
	var rewritten []byte
	if b := d.Body.Bytes(); !untouched(b, x.body) {
		rewritten = b
	}
	if err := x.send(bufferedBodyReply(d, x.req.RequestID, rewritten, x.contentLength >= 0)); err != nil {
		return false, err
	}
	x.routed()
	return false, nil
}

// untouched reports whether out is in itself (the same bytes, not a copy): the
// pipeline returns the body it was given when it has nothing to change.
func untouched(out, in []byte) bool {
	return len(out) == len(in) && (len(in) == 0 || &out[0] == &in[0])
}

// route runs the pipeline on the whole body. With keepAlive, Envoy's message
// timer is running, and a slow route (a prefill leg) extends it once.
func (x *exchange) route(keepAlive bool) (*pipeline.Decision, error) {
	x.req.Body = x.body
	x.opts.Metrics.RequestBody(len(x.body))
	if keepAlive && x.opts.OverrideAfter > 0 {
		sent := make(chan struct{})
		timer := time.AfterFunc(x.opts.OverrideAfter, func() {
			defer close(sent)
			if err := x.send(overrideReply(x.opts.OverrideTimeout)); err != nil {
				x.log.V(1).Info("sending override_message_timeout failed", "requestID", x.req.RequestID, "error", err.Error())
			}
		})
		defer func() {
			if !timer.Stop() {
				<-sent // the override is being sent: the stream is ours again after it
			}
		}()
	}
	return x.router.Route(x.ctx, &x.req)
}

func (x *exchange) onResponseBody(b *extprocv3.HttpBody) error {
	if x.responseDone {
		return nil
	}
	x.responseDone = b.GetEndOfStream()
	if x.responseMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		// Echo at once: SSE tokens must keep streaming to the client.
		return x.send(streamedChunk(false, b.GetBody(), b.GetEndOfStream()))
	}
	return x.send(continueReply("response_body"))
}

// fail ends the exchange with a local reply from Envoy to the client.
func (x *exchange) fail(err error) (bool, error) {
	x.requestDone = true
	e := pipeline.AsError(err)
	x.rejected(e)
	return true, x.send(immediate(e))
}

func (x *exchange) send(r *extprocv3.ProcessingResponse) error { return x.stream.Send(r) }

// readHeaders takes what routing needs. Envoy sends values in raw_value; value is
// read only as a fallback for Envoys with the raw_value guard off.
func (x *exchange) readHeaders(hm *corev3.HeaderMap) {
	x.contentLength = -1
	var logged map[string]string // protocol-detail logging only
	if x.log.V(2).Enabled() {
		logged = make(map[string]string, len(hm.GetHeaders()))
	}
	for _, h := range hm.GetHeaders() {
		key := h.GetKey()
		if logged != nil {
			logged[key] = redact(key, headerValue(h))
		}
		if x.traceFields[key] {
			if x.traceHeaders == nil {
				x.traceHeaders = propagation.MapCarrier{}
			}
			x.traceHeaders[key] = headerValue(h)
		}
		switch key {
		case ":method":
			x.method = headerValue(h)
		case ":path":
			x.req.Path = headerValue(h)
		case RequestIDHeader:
			x.req.RequestID = headerValue(h)
		case "content-length":
			if n, err := strconv.ParseInt(headerValue(h), 10, 64); err == nil && n >= 0 {
				x.contentLength = n
			}
		case "authorization":
			x.req.Forward = http.Header{"Authorization": {headerValue(h)}}
		}
	}
	if x.req.RequestID == "" {
		x.req.RequestID = uuid.NewString()
	}
	if logged != nil {
		x.log.V(2).Info("request headers", "requestID", x.req.RequestID, "headers", logged)
	}
}

// headerValue is a header's value: Envoy sends it in raw_value, and value only
// when its raw_value guard is off.
func headerValue(h *corev3.HeaderValue) string {
	if raw := h.GetRawValue(); len(raw) > 0 {
		return string(raw)
	}
	return h.GetValue()
}

// subsetHint reads the endpoint-picker subset hint Envoy may forward in the
// envoy.lb.subset_hint metadata namespace; nil when there is none.
func subsetHint(md *corev3.Metadata) any {
	ns, ok := md.GetFilterMetadata()[SubsetHintNamespace]
	if !ok {
		return nil
	}
	v, ok := ns.GetFields()[SubsetHintKey]
	if !ok {
		return nil
	}
	return v.AsInterface()
}

// observeStatus tells scheduling how the decode engine answered, so that an
// endpoint answering 5xx is ejected.
func (x *exchange) observeStatus(hm *corev3.HeaderMap) {
	for _, h := range hm.GetHeaders() {
		if h.GetKey() == ":status" {
			if status, err := strconv.Atoi(headerValue(h)); err == nil {
				x.decision.Observe(status)
			}
			return
		}
	}
}
