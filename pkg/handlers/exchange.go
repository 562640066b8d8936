package handlers

import (
	"context"
	"fmt"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// Supported request body modes, named in the error for the others. NONE serves
// only requests without a body.
const (
	supportedModes = "FULL_DUPLEX_STREAMED, BUFFERED or NONE"
	scrubbingModes = "FULL_DUPLEX_STREAMED or BUFFERED"
)

// sink takes a stream's replies, in order: the gRPC stream in production.
// Only the stream's goroutine sends, except for the BUFFERED timer in route,
// which sends while that goroutine waits for it.
type sink interface {
	Send(*extprocv3.ProcessingResponse) error
}

// exchange is the protocol state of one Process stream: one HTTP request and
// its response.
type exchange struct {
	router Router
	opts   *Options
	out    sink
	ctx    context.Context // the stream's, carrying the request span once headers are in

	protocol *extprocv3.ProtocolConfiguration // the last one Envoy sent: the body modes

	headersSeen   bool
	lim           holding // the stream's slot and its request's deadline
	requestDone   bool    // the request body has been handled: later chunks are dropped (envoy#46237)
	responseDone  bool
	req           pipeline.Request
	contentLength int64 // -1 when the client sent none
	decision      *pipeline.Decision

	body bodyCollector
	obs  observation // its logger is the exchange's too
}

func (x *exchange) requestMode() filterv3.ProcessingMode_BodySendMode {
	return x.protocol.GetRequestBodyMode()
}

func (x *exchange) responseMode() filterv3.ProcessingMode_BodySendMode {
	return x.protocol.GetResponseBodyMode()
}

// handle answers one message. done means the stream is finished for us.
func (x *exchange) handle(req *extprocv3.ProcessingRequest) (done bool, err error) {
	if !x.lim.over { // the request's deadline may fire meanwhile
		x.lim.mu.Lock()
		defer x.unlock()
	}
	switch {
	case x.lim.expired:
		return true, nil // answered 408 already
	case !x.lim.started:
		x.start()
	}
	if pc := req.GetProtocolConfig(); pc != nil {
		x.protocol = pc
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
		x.onResponseHeaders(m.ResponseHeaders.GetHeaders())
		return false, x.out.Send(continueReply("response_headers"))
	case *extprocv3.ProcessingRequest_ResponseBody:
		return false, x.onResponseBody(m.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return false, x.onResponseTrailers()
	}
	return false, nil
}

func (x *exchange) onRequestHeaders(h *extprocv3.HttpHeaders) (bool, error) {
	if x.headersSeen {
		x.obs.log.V(1).Info("ignoring repeated request headers", "requestID", x.req.RequestID)
		return false, nil
	}
	x.headersSeen = true
	start := time.Now()
	x.readHeaders(h.GetHeaders())
	x.ctx = x.obs.begin(x.ctx, &x.req, h.GetHeaders(), start)
	if !x.lim.slot {
		x.opts.Metrics.LimitRefused(metrics.LimitStreams)
		return x.fail(pipeline.Overloaded(x.opts.MaxStreams, x.opts.RetryAfter))
	}

	if x.requestMode() == filterv3.ProcessingMode_NONE && !h.GetEndOfStream() && x.contentLength != 0 {
		// The body would reach the engine unseen, with any kv_transfer_params or
		// bootstrap fields the client put in it (docs/architecture.md, Security rules): refuse, do not route.
		return x.fail(pipeline.Misconfigured("ext_proc request_body_mode NONE cannot check a request body for fields " +
			"that steer the engines; configure " + scrubbingModes))
	}
	if h.GetEndOfStream() || x.requestMode() == filterv3.ProcessingMode_NONE {
		// No body will follow: route from the headers.
		x.requestDone = true
		d, err := x.router.RouteHeaders(&x.req)
		if err != nil {
			return x.fail(err)
		}
		x.decision = d
		if err := x.out.Send(headersReply(d, x.req.RequestID)); err != nil {
			return false, err
		}
		x.routed()
		return false, nil
	}
	if limit := x.router.MaxBodyBytes(); x.contentLength > limit {
		return x.fail(pipeline.TooLarge(limit))
	}
	switch x.requestMode() {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return false, nil // the headers reply carries the routing: hold it until the body is in
	case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
		// Envoy holds the body until the headers are answered, then sends it whole;
		// the body reply can still set headers, so routing waits for it.
		return false, x.out.Send(headersReply(nil, ""))
	default:
		return x.fail(pipeline.Misconfigured(fmt.Sprintf(
			"ext_proc request_body_mode %s is not supported: routing depends on the body; configure %s", x.requestMode(), supportedModes)))
	}
}

func (x *exchange) onRequestBody(b *extprocv3.HttpBody) (bool, error) {
	if x.requestDone || !x.headersSeen {
		x.obs.log.V(1).Info("dropping request body after its end", "requestID", x.req.RequestID, "bytes", len(b.GetBody()))
		return false, nil
	}
	// Only FULL_DUPLEX cuts a body into several messages, and a first one with
	// end_of_stream is the whole body there too.
	whole := b.GetEndOfStream() || x.requestMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	if !x.body.add(b.GetBody(), whole, x.contentLength) {
		x.opts.Metrics.LimitRefused(metrics.LimitBuffered)
		return x.fail(pipeline.BuffersFull(x.opts.MaxBufferedBytes, x.opts.RetryAfter))
	}
	if limit := x.router.MaxBodyBytes(); int64(len(x.body.bytes())) > limit {
		return x.fail(pipeline.TooLarge(limit))
	}
	switch x.requestMode() {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if !b.GetEndOfStream() {
			x.req.Arrived(x.body.bytes()) // validate while the rest is on its way
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

func (x *exchange) onRequestTrailers() (bool, error) {
	if x.requestMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED && x.headersSeen && !x.requestDone {
		// Trailers end a FULL_DUPLEX body whose last chunk had no end_of_stream.
		return x.finishDuplex(true)
	}
	return false, x.out.Send(continueReply("request_trailers"))
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
	if err := x.out.Send(headersReply(d, x.req.RequestID)); err != nil {
		return false, err
	}
	cut := d.Body.Chunks(maxStreamedChunk)
	for i, c := range cut {
		if err := x.out.Send(streamedChunk(true, c, !trailers && i == len(cut)-1)); err != nil {
			return false, err
		}
	}
	x.routed()
	if trailers {
		return false, x.out.Send(continueReply("request_trailers"))
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
	if b := d.Body.Bytes(); !untouched(b, x.body.bytes()) {
		rewritten = b
	}
	if err := x.out.Send(bufferedBodyReply(d, x.req.RequestID, rewritten, x.contentLength >= 0)); err != nil {
		return false, err
	}
	x.routed()
	return false, nil
}

// routed concludes a request whose routing reply, and every chunk of its new
// body, has been sent: its observation (the log line may show the body),
// then what only routing read goes. The stream may last as long as the
// generation, and the response path reads only the decision's endpoint and
// rewrite and the request's id. gRPC copied each reply as it was sent
// (bodies.go), so the body goes back now, to the budget and, unless a prefill
// leg was sent from it, to the pool, as at the stream's end.
func (x *exchange) routed() {
	x.obs.routed(x.decision, x.body.bytes())
	x.decision.Sent()
	x.req.Routed()
	x.body.release(x.req.BodyHeld())
}

// untouched reports whether out is in itself (the same bytes, not a copy): the
// pipeline returns the body it was given when it has nothing to change.
func untouched(out, in []byte) bool {
	return len(out) == len(in) && (len(in) == 0 || &out[0] == &in[0])
}

// route runs the pipeline on the whole body. With keepAlive, Envoy's message
// timer is running, and a slow route (a prefill leg) extends it once.
func (x *exchange) route(keepAlive bool) (*pipeline.Decision, error) {
	x.req.Body, x.req.Keep = x.body.bytes(), &x.body
	x.opts.Metrics.RequestBody(len(x.req.Body))
	if keepAlive && x.opts.OverrideAfter > 0 {
		sent := make(chan struct{})
		timer := time.AfterFunc(x.opts.OverrideAfter, func() {
			defer close(sent)
			if err := x.out.Send(overrideReply(x.opts.OverrideTimeout)); err != nil {
				x.obs.log.V(1).Info("sending override_message_timeout failed", "requestID", x.req.RequestID, "error", err.Error())
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
	if x.responseMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return x.out.Send(continueReply("response_body"))
	}
	if x.rewriting() {
		return x.passResponse(b.GetBody(), b.GetEndOfStream(), b.GetEndOfStream())
	}
	// Echo at once: SSE tokens must keep streaming to the client.
	return x.out.Send(streamedChunk(false, b.GetBody(), b.GetEndOfStream()))
}

// onResponseTrailers answers the response's trailers. In FULL_DUPLEX they end
// the body, so what a rewrite still holds goes before their reply.
func (x *exchange) onResponseTrailers() error {
	if x.rewriting() && !x.responseDone && x.responseMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		x.responseDone = true
		if err := x.passResponse(nil, true, false); err != nil {
			return err
		}
	}
	return x.out.Send(continueReply("response_trailers"))
}

// passResponse gives the rewrite a response chunk (last: the body ends with
// it, or with the trailers that came) and sends what it lets through as
// FULL_DUPLEX replies, the last with end_of_stream when eos. While it holds a
// partial event there is nothing to send, and Envoy needs no reply per chunk
// (docs/envoy.md §2.6); the reply that ends the body is always sent, empty or
// not.
func (x *exchange) passResponse(chunk []byte, last, eos bool) error {
	out := x.decision.Rewrite.Body(chunk, last)
	chunks := [][]byte(out) // almost always the chunk itself, one piece
	if len(out) > 1 || out.Len() > maxStreamedChunk {
		chunks = out.Chunks(maxStreamedChunk) // a fixed event or answer, joined; a long answer, cut
	}
	sent := false
	for i, c := range chunks {
		if end := eos && i == len(chunks)-1; len(c) > 0 || end {
			if err := x.out.Send(streamedChunk(false, c, end)); err != nil {
				return err
			}
			sent = true
		}
	}
	if eos && !sent {
		return x.out.Send(streamedChunk(false, nil, true))
	}
	return nil
}

// rewriting reports whether the decision rewrites the response (the
// pipeline's Decision.Rewrite).
func (x *exchange) rewriting() bool { return x.decision != nil && x.decision.Rewrite != nil }

// fail ends the exchange with a local reply from Envoy to the client.
func (x *exchange) fail(err error) (bool, error) {
	x.requestDone = true
	e := pipeline.AsError(err, x.req.RequestID)
	x.obs.rejected(e, x.ctx.Err() != nil, x.body.bytes())
	return true, x.out.Send(immediate(e))
}

// end closes the exchange when its stream ends, however it ends: the
// observation first (it may log the body), then what the request held goes
// back.
func (x *exchange) end() {
	x.lim.mu.Lock() // the request's deadline must not fire now
	defer x.lim.mu.Unlock()
	x.lim.stop()
	x.lim.letGo()
	x.obs.abandon(x.decision, x.body.bytes())
	if x.rewriting() {
		x.opts.Metrics.UsageRewrite(x.decision.Rewrite.Outcome())
	}
	x.body.release(x.req.BodyHeld())
	x.decision.Release()
}
