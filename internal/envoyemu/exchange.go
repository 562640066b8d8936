package envoyemu

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
)

// DetailsHeader carries Envoy's %RESPONSE_CODE_DETAILS% on local replies.
// Emulator-only (real Envoy logs it, it does not send it): it lets tests see
// why a request failed.
const DetailsHeader = "x-emulator-response-code-details"

// exchange is one HTTP request through the emulated Envoy. Everything that
// touches its state runs on one goroutine, the handler's event loop, like an
// Envoy worker thread; other goroutines only post closures to it.
type exchange struct {
	p   *Proxy
	cfg *Config
	w   http.ResponseWriter
	r   *http.Request
	rc  *http.ResponseController
	ctx context.Context

	events   chan func()
	done     chan struct{} // closed when the loop has exited
	finished bool          // the HTTP exchange is over
	abort    bool          // reset the downstream connection instead of ending cleanly

	dec, enc *direction

	// ext_proc stream (§1).
	stream             *grpcStream
	rules              *rules.Stream // what Envoy makes of each reply (§7.3, §10)
	firstSent          bool
	processingComplete bool
	fdBodySeen         bool

	metadata  map[string]*structpb.Struct // the stream's dynamic metadata
	routeMeta map[string]*structpb.Struct // §2.11 snapshot for the LB
	route     *Route                      // cached at decodeHeaders time (§3.6)
	reroute   bool                        // clear_route_cache honoured

	upCancel    context.CancelFunc
	reqBody     *streamBody
	routeTimer  *time.Timer
	routeGen    int
	idleTimer   *time.Timer
	idleGen     int
	clientDone  bool
	respStarted bool
}

func newExchange(p *Proxy, w http.ResponseWriter, r *http.Request, ctx context.Context) *exchange {
	x := &exchange{
		p: p, cfg: &p.cfg, w: w, r: r, rc: http.NewResponseController(w), ctx: ctx,
		events:   make(chan func(), 64),
		done:     make(chan struct{}),
		metadata: map[string]*structpb.Struct{},
	}
	for ns, s := range p.cfg.Metadata.Initial {
		x.metadata[ns] = proto.Clone(s).(*structpb.Struct)
	}
	c := &p.cfg
	x.rules = rules.NewStream(rules.Config{
		RequestMode:                             c.Modes.Request.Body,
		ResponseMode:                            c.Modes.Response.Body,
		SendBodyWithoutWaitingForHeaderResponse: c.Modes.SendBodyWithoutWaitingForHeaderResponse,
		MaxMessageTimeout:                       c.Failure.MaxMessageTimeout,
		DisableImmediateResponse:                c.Mutations.DisableImmediateResponse,
	})
	x.dec = &direction{x: x, sink: &router{x: x}, rules: x.rules.Request,
		sendHeaders:  c.Modes.Request.Headers != extprocfilterv3.ProcessingMode_SKIP,
		bodyMode:     c.Modes.Request.Body,
		sendTrailers: c.Modes.Request.Trailers == extprocfilterv3.ProcessingMode_SEND,
	}
	x.enc = &direction{x: x, response: true, sink: &downstream{x: x}, rules: x.rules.Response,
		sendHeaders:  c.Modes.Response.Headers != extprocfilterv3.ProcessingMode_SKIP,
		bodyMode:     c.Modes.Response.Body,
		sendTrailers: c.Modes.Response.Trailers == extprocfilterv3.ProcessingMode_SEND,
	}
	return x
}

func (x *exchange) logf(format string, args ...any) {
	if x.cfg.Logf != nil {
		x.cfg.Logf("envoy-emulator: "+format, args...)
	}
}

// post runs fn on the event loop; false once the exchange is over.
func (x *exchange) post(fn func()) bool {
	select {
	case x.events <- fn:
		return true
	case <-x.done:
		return false
	}
}

func (x *exchange) limits() mutationLimits {
	return mutationLimits{maxHeadersCount: x.cfg.Limits.MaxHeadersCount, maxHeadersKB: x.cfg.Limits.MaxHeadersKB}
}

// run drives the exchange to its end.
func (x *exchange) run() {
	defer x.cleanup()
	// Envoy reads the request and writes the response independently.
	_ = x.rc.EnableFullDuplex()

	h := x.requestHeaders()
	x.route = matchRoute(x.cfg.Routes, x.r.RequestURI)
	// HTTP/1: no body unless Content-Length > 0 or chunked (§2.1, UNCONFIRMED
	// for Content-Length: 0).
	noBody := x.r.ContentLength == 0
	if noBody {
		x.clientDone = true
	} else {
		go x.readClientBody()
	}
	x.resetIdle()
	x.dec.onHeaders(h, noBody)
	for !x.finished {
		select {
		case fn := <-x.events:
			fn()
		case <-x.ctx.Done():
			x.logf("downstream gone: %v", context.Cause(x.ctx))
			x.finished = true
		}
	}
}

func (x *exchange) cleanup() {
	close(x.done)
	x.closeStream()
	x.dec.stopTimer()
	x.enc.stopTimer()
	x.stopRouteTimer()
	if x.idleTimer != nil {
		x.idleTimer.Stop()
	}
	if x.reqBody != nil {
		x.reqBody.abort(errors.New("exchange finished"))
	}
	if x.upCancel != nil {
		x.upCancel()
	}
}

// requestHeaders builds the header map the HCM hands to the filter chain:
// pseudo-headers first (§1.3), then the client's headers, then what the HCM
// adds itself (x-forwarded-proto, x-request-id).
func (x *exchange) requestHeaders() *headerMap {
	h := &headerMap{}
	h.add(":authority", x.r.Host)
	h.add(":path", x.r.RequestURI)
	h.add(":method", x.r.Method)
	h.add(":scheme", "http")
	fromHTTPHeader(x.r.Header, h)
	h.remove("host")
	if x.r.ContentLength > 0 && !h.has("content-length") {
		h.add("content-length", strconv.FormatInt(x.r.ContentLength, 10))
	}
	if !h.has("x-forwarded-proto") {
		h.add("x-forwarded-proto", "http")
	}
	if !h.has("x-request-id") {
		h.add("x-request-id", newUUID())
	}
	return h
}

func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// readClientBody turns the request body into data events, one per read (one
// request_body message per chunk in FULL_DUPLEX). A Content-Length body's
// last read carries the end of stream; a chunked body ends with an empty
// end-of-stream chunk or with trailers, as in Envoy's HTTP/1 codec.
func (x *exchange) readClientBody() {
	buf := make([]byte, 64<<10)
	for {
		n, err := x.r.Body.Read(buf)
		eof := errors.Is(err, io.EOF)
		var trailers *headerMap
		if eof && len(x.r.Trailer) > 0 {
			trailers = &headerMap{}
			fromHTTPHeader(x.r.Trailer, trailers)
			if len(trailers.entries) == 0 {
				trailers = nil
			}
		}
		if n > 0 || (eof && trailers == nil) {
			chunk := append([]byte(nil), buf[:n]...)
			end := eof && trailers == nil
			if !x.post(func() { x.onClientData(chunk, end) }) {
				return
			}
		}
		if trailers != nil {
			x.post(func() { x.onClientTrailers(trailers) })
		}
		if eof {
			return
		}
		if err != nil {
			x.post(func() {
				x.logf("downstream reset while sending the body: %v", err)
				x.finished = true
			})
			return
		}
	}
}

func (x *exchange) onClientData(b []byte, end bool) {
	x.resetIdle()
	if end {
		x.clientBodyDone()
	}
	x.dec.onData(b, end)
}

func (x *exchange) onClientTrailers(t *headerMap) {
	x.resetIdle()
	x.clientBodyDone()
	x.dec.onTrailers(t)
}

func (x *exchange) clientBodyDone() {
	x.clientDone = true
	if h := x.p.hooks.clientBodyDone; h != nil {
		h()
	}
}

// ---- ext_proc stream ----

// send queues a message on the stream, opening it lazily (§1.1). The first
// message carries protocol_config (§1.2), every message the forwarded
// metadata (§1.4).
func (x *exchange) send(req *extprocv3.ProcessingRequest) {
	if x.processingComplete || x.finished {
		return
	}
	if !x.firstSent {
		x.firstSent = true
		req.ProtocolConfig = &extprocv3.ProtocolConfiguration{
			RequestBodyMode:                         x.cfg.Modes.Request.Body,
			ResponseBodyMode:                        x.cfg.Modes.Response.Body,
			SendBodyWithoutWaitingForHeaderResponse: x.cfg.Modes.SendBodyWithoutWaitingForHeaderResponse,
		}
	}
	if len(x.cfg.Metadata.ForwardingNamespaces) > 0 {
		req.MetadataContext = x.metadataContext()
	}
	if x.stream == nil {
		x.stream = openStream(x)
	}
	x.stream.push(req)
}

// closeStream resets the gRPC stream: Envoy's default close is a reset, so
// the server sees codes.Canceled (§1 "How the stream ends").
func (x *exchange) closeStream() {
	if x.stream != nil {
		x.stream.close()
	}
}

func (x *exchange) onStreamEnd(err error) {
	if x.finished || x.processingComplete || x.stream == nil || x.stream.closed {
		return
	}
	if errors.Is(err, io.EOF) {
		// §7.2: a clean close means "continue without me", both directions.
		x.logf("ext_proc server closed the stream with OK")
		x.completeProcessing()
		return
	}
	st := status.Convert(err)
	if x.failureModeAllow() {
		x.logf("ext_proc stream error %v: failure_mode_allow, continuing", st)
		x.completeProcessing()
		return
	}
	x.localReply(x.cfg.Failure.StatusOnError, "", fmt.Sprintf("ext_proc_error_gRPC_error_%d{%s}", st.Code(), st.Message()))
}

// failureModeAllow is Filter::failureModeAllow: never once FULL_DUPLEX body
// data went to the server (§5).
func (x *exchange) failureModeAllow() bool {
	return x.cfg.Failure.FailureModeAllow && !x.fdBodySeen
}

// completeProcessing stops consulting the server and lets both directions
// continue unmodified.
func (x *exchange) completeProcessing() {
	x.processingComplete = true
	x.rules.Close("processing completed")
	x.closeStream()
	x.dec.clearAsyncState()
	x.enc.clearAsyncState()
}

// onMessage is Filter::onReceiveMessage: the rules judge each reply against
// its direction's state (§1.7, §7.3), then the direction applies it.
func (x *exchange) onMessage(resp *extprocv3.ProcessingResponse) {
	if x.finished || x.processingComplete {
		return // §7.2: late replies are dropped
	}
	v := x.rules.Reply(resp)
	if ot := resp.GetOverrideMessageTimeout(); ot != nil {
		// §5: handled alone; every other field of the message is ignored.
		x.onOverrideTimeout(ot.AsDuration(), v)
		return
	}
	switch resp.GetResponse().(type) {
	case nil, *extprocv3.ProcessingResponse_StreamedImmediateResponse:
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		if v.Outcome == rules.Accepted {
			x.applyMetadata(resp)
		}
	default:
		// Envoy takes a reply's dynamic metadata before it judges the reply.
		x.applyMetadata(resp)
	}
	switch v.Outcome {
	case rules.Accepted:
	case rules.Spurious:
		x.onProcessingError(spurious("%s", v.Reason))
		return
	default:
		x.logf("reply %s: %s", v.Outcome, v.Reason)
		return
	}
	for _, part := range v.Dropped {
		x.logf("ignored: %s", part)
	}
	var err error
	switch r := resp.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		err = x.dec.onHeadersResponse(r.RequestHeaders)
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		err = x.enc.onHeadersResponse(r.ResponseHeaders)
	case *extprocv3.ProcessingResponse_RequestBody:
		err = x.dec.onBodyResponse(r.RequestBody, v.Answered)
	case *extprocv3.ProcessingResponse_ResponseBody:
		err = x.enc.onBodyResponse(r.ResponseBody, v.Answered)
	case *extprocv3.ProcessingResponse_RequestTrailers:
		err = x.dec.onTrailersResponse(r.RequestTrailers)
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		err = x.enc.onTrailersResponse(r.ResponseTrailers)
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		x.immediateResponse(r.ImmediateResponse)
		return
	}
	if err != nil {
		x.onProcessingError(err)
		return
	}
	x.maybeCloseStream()
}

// onProcessingError applies the §5 failure table: spurious replies honour
// failure_mode_allow, invalid mutations never do.
func (x *exchange) onProcessingError(err error) {
	x.logf("ext_proc error: %v", err)
	if errors.Is(err, errSpurious) && x.failureModeAllow() {
		x.completeProcessing()
		return
	}
	x.localReply(x.cfg.Failure.StatusOnError, "", err.Error())
}

// onOverrideTimeout restarts the timers the rules say the override applies
// to (§5).
func (x *exchange) onOverrideTimeout(dur time.Duration, v rules.Verdict) {
	for _, part := range v.Dropped {
		x.logf("ignored: %s", part)
	}
	if v.Outcome != rules.Accepted {
		x.logf("%s", v.Reason)
		return
	}
	for _, d := range v.Restarted {
		if d == x.dec.rules {
			x.dec.restartTimer(dur)
		} else {
			x.enc.restartTimer(dur)
		}
	}
}

func (x *exchange) onMessageTimeout(d *direction) {
	if x.finished || x.processingComplete {
		return
	}
	if x.failureModeAllow() {
		x.logf("%s message timeout: failure_mode_allow, continuing", d.name())
		x.completeProcessing()
		return
	}
	// §5: 504, hard-coded (not status_on_error) since envoy#34856.
	x.localReply(http.StatusGatewayTimeout, "", "ext_proc_error_per-message_timeout_exceeded")
}

// maybeCloseStream mimics ext_proc_stream_close_optimization (§1): once the
// request side is done and the response side will never send, the stream is
// reset early.
func (x *exchange) maybeCloseStream() {
	enc := x.enc
	encSilent := !enc.sendHeaders && enc.bodyMode == extprocfilterv3.ProcessingMode_NONE && !enc.sendTrailers
	dec := x.dec
	decDone := dec.ended && dec.rules.Settled() && len(dec.chunks) == 0
	if encSilent && decDone {
		x.closeStream()
	}
}

// applyMetadata keeps dynamic_metadata only for receiving namespaces (§3.7),
// merged per key into the stream's metadata.
func (x *exchange) applyMetadata(resp *extprocv3.ProcessingResponse) {
	for ns, v := range resp.GetDynamicMetadata().GetFields() {
		if !slices.Contains(x.cfg.Metadata.ReceivingNamespaces, ns) {
			x.logf("dynamic_metadata namespace %q dropped: not in receiving_namespaces", ns)
			continue
		}
		s := v.GetStructValue()
		if s == nil {
			x.logf("dynamic_metadata namespace %q dropped: not a Struct", ns)
			continue
		}
		cur := x.metadata[ns]
		if cur == nil {
			cur = &structpb.Struct{Fields: map[string]*structpb.Value{}}
			x.metadata[ns] = cur
		}
		for k, fv := range s.GetFields() {
			cur.Fields[k] = proto.Clone(fv).(*structpb.Value)
		}
	}
}

// snapshotRouting freezes the metadata the LB will consult (§2.11).
func (x *exchange) snapshotRouting() {
	x.routeMeta = map[string]*structpb.Struct{}
	for ns, s := range x.metadata {
		x.routeMeta[ns] = proto.Clone(s).(*structpb.Struct)
	}
}

// maybeClearRouteCache: honoured only on the request path and only with a
// header mutation in the same reply (§3.6).
func (x *exchange) maybeClearRouteCache(d *direction, cr *extprocv3.CommonResponse) {
	if d.response || cr.GetHeaderMutation() == nil || x.cfg.Mutations.DisableClearRouteCache {
		return
	}
	switch x.cfg.Mutations.RouteCacheAction {
	case extprocfilterv3.ExternalProcessor_CLEAR:
		x.reroute = true
	case extprocfilterv3.ExternalProcessor_DEFAULT:
		if cr.GetClearRouteCache() {
			x.reroute = true
		}
	}
}

func (x *exchange) metadataContext() *corev3.Metadata {
	return buildMetadataContext(x.cfg.Metadata.ForwardingNamespaces, x.metadata)
}

func (x *exchange) forwardAllowed(key string) bool {
	return headerForwardingAllowed(x.cfg.ForwardRules, key)
}

// ---- local replies ----

// immediateResponse is §4: status <200 becomes 200, headers through the
// filter's mutation rules (a failing mutation is only logged), body as given,
// the stream closed and later messages ignored.
func (x *exchange) immediateResponse(ir *extprocv3.ImmediateResponse) {
	code := int(ir.GetStatus().GetCode())
	if code < 200 {
		code = 200
	}
	if code > 999 {
		code = 500
	}
	h := &headerMap{}
	if len(ir.GetBody()) > 0 {
		h.set("content-type", "text/plain")
	}
	if _, err := applyHeaderMutation(ir.GetHeaders(), h, x.p.rules, x.limits(), mutationOptions{}); err != nil {
		x.logf("immediate response header mutation failed: %v", err)
	}
	h.remove("content-length")
	details := strings.Map(func(r rune) rune {
		if unicode.IsSpace(r) {
			return '_'
		}
		return r
	}, ir.GetDetails())
	x.sendLocalReply(code, ir.GetBody(), h, details)
}

func (x *exchange) localReply(code int, body, details string) {
	var h *headerMap
	if body != "" {
		h = &headerMap{}
		h.set("content-type", "text/plain")
	}
	x.sendLocalReply(code, []byte(body), h, details)
}

// sendLocalReply ends the exchange with an Envoy-generated response, or a
// reset when the response already started downstream (§4). Local replies do
// not go through ext_proc (§9 skip_ext_proc_on_local_reply).
func (x *exchange) sendLocalReply(code int, body []byte, h *headerMap, details string) {
	if x.finished {
		return
	}
	x.logf("local reply %d (%s)", code, details)
	x.processingComplete = true
	x.closeStream()
	x.dec.stopTimer()
	x.enc.stopTimer()
	if x.upCancel != nil {
		x.upCancel()
	}
	x.finished = true
	if x.respStarted {
		x.abort = true
		return
	}
	hdr := x.w.Header()
	for k := range hdr {
		delete(hdr, k)
	}
	if h != nil {
		h.toHTTPHeader(hdr)
	}
	if _, ok := hdr["Content-Type"]; !ok {
		hdr["Content-Type"] = nil // no sniffing: Envoy sends none for an empty body
	}
	hdr.Set("Content-Length", strconv.Itoa(len(body)))
	if details != "" {
		hdr.Set(DetailsHeader, details)
	}
	x.respStarted = true
	x.w.WriteHeader(code)
	_, _ = x.w.Write(body)
}

// bufferOverflow: a BUFFERED body over the buffer limit is a 413 on the
// request path, a 500 (or reset) on the response path (§2.3).
func (x *exchange) bufferOverflow(d *direction) {
	if d.response {
		x.localReply(http.StatusInternalServerError, "Internal Server Error", "response_payload_too_large")
		return
	}
	x.localReply(http.StatusRequestEntityTooLarge, "Payload Too Large", "request_payload_too_large")
}

// ---- timers of the connection manager and router ----

// resetIdle re-arms the HCM stream_idle_timeout on stream activity.
func (x *exchange) resetIdle() {
	if x.cfg.Limits.StreamIdleTimeout <= 0 {
		return
	}
	if x.idleTimer != nil {
		x.idleTimer.Stop()
	}
	x.idleGen++
	gen := x.idleGen
	x.idleTimer = time.AfterFunc(x.cfg.Limits.StreamIdleTimeout, func() {
		x.post(func() {
			if gen != x.idleGen || x.finished {
				return
			}
			// 504 once the request is complete (the FULL_DUPLEX test of §5),
			// 408 while the client is still sending.
			code := http.StatusRequestTimeout
			if x.clientDone {
				code = http.StatusGatewayTimeout
			}
			x.localReply(code, "stream timeout", "stream_idle_timeout")
		})
	})
}

func (x *exchange) stopRouteTimer() {
	if x.routeTimer != nil {
		x.routeTimer.Stop()
		x.routeTimer = nil
	}
	x.routeGen++
}

// startRouteTimer arms the route timeout once the whole request reached the
// router (§5); 0 disables it.
func (x *exchange) startRouteTimer(d time.Duration) {
	if d <= 0 {
		return
	}
	x.stopRouteTimer()
	gen := x.routeGen
	x.routeTimer = time.AfterFunc(d, func() {
		x.post(func() {
			if gen != x.routeGen || x.finished {
				return
			}
			x.localReply(http.StatusGatewayTimeout, "upstream request timeout", "upstream_response_timeout")
		})
	})
}
