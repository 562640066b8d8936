package envoyemu

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
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
	ctx context.Context

	events   chan func()
	done     chan struct{} // closed when the loop has exited
	finished bool          // the HTTP exchange is over
	abort    bool          // reset the downstream connection instead of ending cleanly

	down     *downstream // the client: its request, and the response to it
	dec, enc *direction
	rt       *router // the router filter and the upstream request
	proc     extProc
	md       dynamicMetadata
	idle     loopTimer // the HCM stream_idle_timeout
	flags    []string  // the stream's response flags, in the order set
}

// extProc is the filter's side of the ext_proc stream (§1).
type extProc struct {
	stream     *grpcStream
	rules      *rules.Stream // what Envoy makes of each reply (§7.3, §10)
	firstSent  bool
	complete   bool // processing_complete: the server is consulted no more (§7.2)
	fdBodySeen bool // FULL_DUPLEX body data went to the server: no fail-open (§5)
}

// dynamicMetadata is the stream's dynamic metadata (§3.7).
type dynamicMetadata struct {
	stream  map[string]*structpb.Struct
	routing map[string]*structpb.Struct // the §2.11 snapshot the LB consults
}

func newExchange(p *Proxy, w http.ResponseWriter, r *http.Request, ctx context.Context) *exchange {
	c := &p.cfg
	x := &exchange{
		p: p, cfg: c, ctx: ctx,
		events: make(chan func(), 64),
		done:   make(chan struct{}),
		md:     dynamicMetadata{stream: map[string]*structpb.Struct{}},
	}
	for ns, s := range c.Metadata.Initial {
		x.md.stream[ns] = proto.Clone(s).(*structpb.Struct)
	}
	x.down = &downstream{x: x, w: w, r: r, rc: http.NewResponseController(w)}
	x.rt = &router{x: x}
	x.proc.rules = rules.NewStream(rules.Config{
		RequestMode:                             c.Modes.Request.Body,
		ResponseMode:                            c.Modes.Response.Body,
		SendBodyWithoutWaitingForHeaderResponse: c.Modes.SendBodyWithoutWaitingForHeaderResponse,
		MaxMessageTimeout:                       c.Failure.MaxMessageTimeout,
		DisableImmediateResponse:                c.Mutations.DisableImmediateResponse,
	})
	x.dec = newDirection(x, x.rt, x.proc.rules.Request, c.Modes.Request)
	x.enc = newDirection(x, x.down, x.proc.rules.Response, c.Modes.Response)
	return x
}

func newDirection(x *exchange, s sink, r *rules.Direction, m DirectionModes) *direction {
	return &direction{x: x, response: r == x.proc.rules.Response, sink: s, rules: r,
		sendHeaders:  m.Headers != extprocfilterv3.ProcessingMode_SKIP,
		bodyMode:     m.Body,
		sendTrailers: m.Trailers == extprocfilterv3.ProcessingMode_SEND,
	}
}

// setFlag adds a response flag once, after those already set
// (StreamInfoImpl::setResponseFlag in source/common/stream_info/stream_info_impl.h).
func (x *exchange) setFlag(flag string) {
	if flag != "" && !slices.Contains(x.flags, flag) {
		x.flags = append(x.flags, flag)
	}
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

// ask runs fn on the event loop and waits for its answer; false once the
// exchange is over.
func (x *exchange) ask(fn func() bool) bool {
	answer := make(chan bool, 1)
	if !x.post(func() { answer <- fn() }) {
		return false
	}
	select {
	case ok := <-answer:
		return ok
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
	r := x.down.r
	// Envoy reads the request and writes the response independently.
	_ = x.down.rc.EnableFullDuplex()

	h := x.requestHeaders()
	x.rt.route = matchRoute(x.cfg.Routes, r.RequestURI)
	// HTTP/1: no body unless Content-Length > 0 or chunked (§2.1, UNCONFIRMED
	// for Content-Length: 0).
	noBody := r.ContentLength == 0
	if noBody {
		x.down.bodyDone = true
	} else {
		go x.down.readBody()
	}
	x.resetIdle()
	x.dec.onHeaders(h, noBody)
	for !x.finished {
		select {
		case fn := <-x.events:
			fn()
		case <-x.ctx.Done():
			x.logf("downstream gone: %v", context.Cause(x.ctx))
			x.finished, x.abort = true, true // nobody to answer: a half-closed client reads a reset, as from Envoy
		}
	}
}

func (x *exchange) cleanup() {
	close(x.done)
	x.closeStream()
	x.dec.timer.stop()
	x.enc.timer.stop()
	x.idle.stop()
	x.rt.stop(errors.New("exchange finished"))
}

// requestHeaders builds the header map the HCM hands to the filter chain:
// pseudo-headers first (§1.3), then the client's headers less the x-envoy-*
// ones Envoy strips, then what the HCM adds itself (x-forwarded-proto,
// x-envoy-external-address with use_remote_address, x-request-id), as
// mutateRequestHeaders in source/common/http/conn_manager_utility.cc.
func (x *exchange) requestHeaders() *headerMap {
	r := x.down.r
	h := &headerMap{}
	h.add(":authority", r.Host)
	h.add(":path", r.RequestURI)
	h.add(":method", r.Method)
	h.add(":scheme", "http")
	fromHTTPHeader(r.Header, h)
	h.remove("host")
	if r.ContentLength > 0 && !h.has("content-length") {
		h.add("content-length", strconv.FormatInt(r.ContentLength, 10))
	}
	ch := x.cfg.ClientHeaders
	if ch.UseRemoteAddress && !ch.SkipXFFAppend {
		appendXFF(h, r.RemoteAddr)
	}
	cleanExternal(h, x.cfg.Mutations.HeaderPrefix, ch.UseRemoteAddress)
	if ch.UseRemoteAddress || !h.has("x-forwarded-proto") {
		// With no trusted hop (the only case emulated) Envoy overwrites it.
		h.set("x-forwarded-proto", "http")
	}
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil && ch.UseRemoteAddress {
		// An edge request: the peer is the client Envoy names.
		h.set(strings.ToLower(x.cfg.Mutations.HeaderPrefix)+"-external-address", ip)
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
