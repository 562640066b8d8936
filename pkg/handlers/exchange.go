package handlers

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/pkg/api"
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
// Only replies calls it: for exchange.send, and once out of turn for
// callBack (watchLeg).
type sink interface {
	Send(*extprocv3.ProcessingResponse) error
}

// exchange is the protocol state of one Process stream: one HTTP request and
// its response.
type exchange struct {
	router Router
	opts   *Options
	out    *replies
	ctx    context.Context // the stream's, carrying the request span once headers are in

	// mu serialises the exchange while its request is incomplete: the
	// stream's goroutine holds it while it handles a message, but for the
	// time the pipeline routes; the two timers (the BUFFERED override, which
	// sends while the pipeline routes, and the body deadline) take it to act.
	// Every send then is under it. Once the request is done, its deadline
	// is stopped (lim.stopped) and the stream's goroutine goes on without
	// it.
	mu sync.Mutex

	protocol *extprocv3.ProtocolConfiguration // the last one Envoy sent: the body modes

	headersSeen   bool
	lim           holding     // the stream's slot and its request's deadline
	requestDone   bool        // the request body has been handled: later chunks are dropped (envoy#46237)
	answer        answerState // the response path's (answers.go)
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
	if x.lim.stopped { // no timer is left: the response path takes no lock
		return x.send(x.phase(req))
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.lim.expired {
		return true, nil // answered 408 already
	}
	r := x.phase(req)
	if x.requestDone {
		x.lim.stop() // the request is complete, or answered: its deadline goes
	}
	return x.send(r)
}

// send sends r in order, then concludes a routed request. A routing that
// could not be sent whole lets its concurrent prefill leg go: no decode leg
// will pair with it. Under mu while the request is incomplete.
func (x *exchange) send(r reply) (done bool, err error) {
	for m := range r.messages {
		if err := x.out.Send(m); err != nil {
			if r.routed {
				x.decision.Unsent()
			}
			return false, err
		}
	}
	if r.routed {
		x.routed()
	}
	return r.done || x.out.over(), nil
}

// phase is the reply to one message.
func (x *exchange) phase(req *extprocv3.ProcessingRequest) reply {
	if !x.lim.started {
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
		x.servedBy(servedEndpoint(req.GetMetadataContext()))
		x.onResponseHeaders(m.ResponseHeaders.GetHeaders(), m.ResponseHeaders.GetEndOfStream())
		return answer(continueResponseHeaders())
	case *extprocv3.ProcessingRequest_ResponseBody:
		return x.onResponseBody(m.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return x.onResponseTrailers()
	}
	return reply{}
}

// headersSkipped answers a request whose body or trailers come first: Envoy
// sends them so only under request_header_mode SKIP, and forwards the
// request unrouted, with any destination header the client set.
var headersSkipped = pipeline.Misconfigured("ext_proc request_header_mode SKIP is not supported: routing reads the request headers; configure request_header_mode: SEND")

func (x *exchange) onRequestHeaders(h *extprocv3.HttpHeaders) reply {
	if x.headersSeen {
		x.obs.log.V(1).Info("ignoring repeated request headers", "requestID", x.req.RequestID)
		return reply{}
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
		if d.Answer != nil {
			return x.answerItself(d)
		}
		x.decision = d
		return reply{msg: headersReply(d, x.req.RequestID), routed: true}
	}
	if limit := x.router.MaxBodyBytes(); x.contentLength > limit {
		return x.fail(pipeline.TooLarge(limit))
	}
	switch x.requestMode() {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return reply{} // the headers reply carries the routing: hold it until the body is in
	case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
		// Envoy holds the body until the headers are answered, then sends it whole;
		// the body reply can still set headers, so routing waits for it.
		return answer(bufferedHeadersReply())
	default:
		return x.fail(pipeline.Misconfigured(fmt.Sprintf(
			"ext_proc request_body_mode %s is not supported: routing depends on the body; configure %s", x.requestMode(), supportedModes)))
	}
}

func (x *exchange) onRequestBody(b *extprocv3.HttpBody) reply {
	if !x.headersSeen && !x.requestDone {
		return x.fail(headersSkipped)
	}
	if x.requestDone {
		x.obs.log.V(1).Info("dropping request body after its end", "requestID", x.req.RequestID, "bytes", len(b.GetBody()))
		return reply{}
	}
	x.body.seen = true
	// Only FULL_DUPLEX cuts a body into several messages, and a first one with
	// end_of_stream is the whole body there too.
	whole := b.GetEndOfStream() || x.requestMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	// A body over the limit is refused as such (413) before it asks the
	// budget for memory: a 503 would have the client retry it in vain.
	limit := x.router.MaxBodyBytes()
	if int64(len(x.body.bytes()))+int64(len(b.GetBody())) > limit {
		return x.fail(pipeline.TooLarge(limit))
	}
	if !x.body.add(b.GetBody(), whole, x.contentLength, limit) {
		x.opts.Metrics.LimitRefused(metrics.LimitBuffered)
		return x.fail(pipeline.BuffersFull(x.opts.MaxBufferedBytes, x.opts.RetryAfter))
	}
	switch x.requestMode() {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if !b.GetEndOfStream() {
			x.req.Arrived(x.body.bytes()) // validate while the rest is on its way
			return reply{}
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

func (x *exchange) onRequestTrailers() reply {
	if !x.headersSeen && !x.requestDone {
		return x.fail(headersSkipped)
	}
	if x.requestDone {
		return answer(continueRequestTrailers())
	}
	switch x.requestMode() {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		// Trailers end a FULL_DUPLEX body whose last chunk had no end_of_stream.
		return x.finishDuplex(true)
	case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
		// Trailers before any body (HTTP/2 HEADERS, then trailers): Envoy sends
		// no body message, and once the trailers are answered it passes on the
		// headers, answered without the routing. Refuse rather than let them
		// reach the router unrouted.
		x.requestDone = true
		return x.fail(pipeline.TrailersWithoutBody())
	}
	return answer(continueRequestTrailers())
}

// finishDuplex routes a complete FULL_DUPLEX request: the held headers reply with
// the routing, then the new body as streamed chunks, then (with trailers) the
// trailers reply.
func (x *exchange) finishDuplex(trailers bool) reply {
	x.requestDone = true
	d, err := x.route(false)
	if err != nil {
		return x.fail(err)
	}
	if d.Answer != nil {
		return x.answerItself(d)
	}
	x.decision = d
	r := reply{msg: headersReply(d, x.req.RequestID), request: true, eos: !trailers, routed: true}
	if x.body.seen { // else Envoy awaits no body reply, and takes one for a spurious message
		r.chunks = d.Body.Chunks(maxStreamedChunk)
	}
	if trailers {
		r.last = continueRequestTrailers()
	}
	return r
}

// finishBuffered routes a complete BUFFERED request in the body reply.
func (x *exchange) finishBuffered() reply {
	x.requestDone = true
	d, err := x.route(true)
	if err != nil {
		return x.fail(err)
	}
	if d.Answer != nil {
		return x.answerItself(d)
	}
	x.decision = d
	// Envoy keeps the body it buffered unless the reply replaces it: a body the
	// pipeline passed on untouched is not sent back.
	var rewritten []byte
	if b := d.Body.Bytes(); !untouched(b, x.body.bytes()) {
		rewritten = b
	}
	return reply{msg: bufferedBodyReply(d, x.req.RequestID, rewritten, x.contentLength >= 0), routed: true}
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
	if x.decision.LegFailed != nil {
		x.watchLeg(x.decision.LegFailed)
	}
}

// untouched reports whether out is in itself (the same bytes, not a copy): the
// pipeline returns the body it was given when it has nothing to change.
func untouched(out, in []byte) bool {
	return len(out) == len(in) && (len(in) == 0 || &out[0] == &in[0])
}

// route runs the pipeline on the whole body, without mu: the pipeline may
// take as long as a prefill leg. With keepAlive, Envoy's message timer is
// running, and a slow route extends it once: the override is sent from its
// timer, under mu, while the pipeline routes.
func (x *exchange) route(keepAlive bool) (*pipeline.Decision, error) {
	x.req.Body, x.req.Keep = x.body.bytes(), &x.body
	if len(x.req.Body) == 0 {
		// A body of no bytes (a chunked request of its terminator alone, an
		// empty last DATA frame) is no body.
		return x.router.RouteHeaders(&x.req)
	}
	x.opts.Metrics.RequestBody(len(x.req.Body))
	x.mu.Unlock()
	defer x.mu.Lock()
	if keepAlive && x.opts.OverrideAfter > 0 {
		sent := make(chan struct{})
		timer := time.AfterFunc(x.opts.OverrideAfter, func() {
			defer close(sent)
			x.mu.Lock()
			defer x.mu.Unlock()
			if _, err := x.send(answer(overrideReply(x.opts.OverrideTimeout))); err != nil {
				x.obs.log.V(1).Info("sending override_message_timeout failed", "requestID", x.req.RequestID, "error", err.Error())
			}
		})
		defer func() {
			if !timer.Stop() {
				<-sent // the override goes before the reply that routes
			}
		}()
	}
	return x.router.Route(x.ctx, &x.req)
}

// answerItself answers the client with d.Answer, a 200 that routes
// nothing (the model list of a decode pool of several models).
func (x *exchange) answerItself(d *pipeline.Decision) reply {
	x.requestDone = true
	x.obs.answered(x.body.bytes())
	return reply{msg: localReply(http.StatusOK, d.Answer, "application/json", 0), done: true}
}

// fail ends the exchange with a local reply from Envoy to the client.
func (x *exchange) fail(err error) reply {
	x.requestDone = true
	e := pipeline.AsError(err, x.req.RequestID)
	x.obs.rejected(e, x.ctx.Err() != nil, x.body.bytes())
	return reply{msg: immediate(e, api.AnthropicErrorsAt(x.req.Path)), done: true}
}

// end closes the exchange when its stream ends, however it ends: the
// observation first (it may log the body), then what the request held goes
// back.
func (x *exchange) end() {
	x.mu.Lock() // the request's deadline must not fire now, nor after (requestDone)
	defer x.mu.Unlock()
	x.out.close() // nor a call-back (watchLeg)
	x.requestDone = true
	x.lim.stop()
	x.obs.abandon(x.decision, x.body.bytes())
	if x.rewriting() {
		x.opts.Metrics.UsageRewrite(x.decision.Rewrite.Outcome())
	}
	if x.decision.StreamFailed() {
		x.opts.Metrics.StreamError(x.req.Report.Mode)
		x.obs.log.Info("the decode engine failed the request after its 200: an error event (or SGLang's abort chunk) before the first token (in P/D, mostly a KV pull that failed)",
			"requestID", x.req.RequestID, "mode", x.req.Report.Mode.String(), "decode", x.req.Report.Decode, "prefill", x.req.Report.Prefill)
	}
	x.letGo()
}

// letGo gives back what the request holds, each once: its slot of
// limits.max_concurrent_streams, its answer's and its body's bytes of the
// buffer budget (the body's buffer to the pool unless a prefill leg was sent
// from it), and its decode endpoint's slot. At the stream's end, or at a
// body deadline that refused it (before any routing). Under mu.
func (x *exchange) letGo() {
	x.lim.letGo()
	x.body.budget.give(x.answer.held)
	x.answer.held = 0
	x.body.release(x.req.BodyHeld())
	x.decision.Release()
}
