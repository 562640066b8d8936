package envoyemu

import (
	"errors"
	"fmt"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
)

// sink is what sits after the filter in a direction: the router for the
// request, the downstream connection for the response.
type sink interface {
	headers(h *headerMap, endStream bool)
	data(b []byte, endStream bool)
	trailers(t *headerMap)
}

type queuedChunk struct {
	data []byte
	end  bool
}

// errSpurious marks a reply Envoy rejects with FailedPrecondition (§7.3):
// status_on_error, or fail-open when failure_mode_allow applies.
var errSpurious = errors.New("spurious message")

func spurious(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errSpurious, fmt.Sprintf(format, args...))
}

// direction is one half of the ext_proc filter: the decoder (request) or the
// encoder (response) state machine (§1.7: they share the gRPC stream but keep
// separate states).
type direction struct {
	x        *exchange
	response bool
	sink     sink
	// rules is what Envoy sent in this direction and what it waits for (the
	// callback state of §10): it decides which replies are spurious (§7.3).
	rules *rules.Direction

	// Effective modes; CONTINUE_AND_REPLACE changes them (§3.1).
	sendHeaders  bool
	bodyMode     extprocfilterv3.ProcessingMode_BodySendMode
	sendTrailers bool

	// What the source (client or upstream) delivered so far.
	headers      *headerMap
	noBody       bool // headers carried end_of_stream (§2.1)
	bodyComplete bool // the source body is over (end_of_stream data or trailers)
	trailers     *headerMap

	// Body held inside the filter.
	held        []byte        // not yet sent to the server nor passed on
	inflight    []byte        // BUFFERED / BUFFERED_PARTIAL body sent, awaiting its reply
	inflightEnd bool          // end_of_stream of that message
	chunks      []queuedChunk // STREAMED: sent, awaiting their reply (FIFO, §2.4)
	partialDone bool          // BUFFERED_PARTIAL answered: the rest passes through (§2.5)
	replaced    bool          // CONTINUE_AND_REPLACE: later source body is dropped (§3.1)

	trailersPending bool // received, waiting for earlier callbacks (§2.8)

	// Output side: everything waits until the headers continue.
	headersContinued bool
	out              []byte
	outEnd           bool
	outTrailers      *headerMap
	ended            bool

	// Message timer (§5); whether an override may restart it is the rules'.
	timer    *time.Timer
	timerGen int
}

func (d *direction) name() string {
	if d.response {
		return "response"
	}
	return "request"
}

func (d *direction) fullDuplex() bool { return isFullDuplex(d.bodyMode) }

func (d *direction) dir() envoymsg.Direction { return envoymsg.Direction(d.response) }

// expect logs a message the rules say Envoy would not send: an emulator bug.
func (d *direction) expect(f rules.Fit) {
	if f != rules.Expected {
		d.x.logf("%s: a message Envoy would not send (%v): %s", d.name(), f, d.rules.Off())
	}
}

// shouldRemoveContentLength is ProcessorState::shouldRemoveContentLength (§3.5).
func (d *direction) shouldRemoveContentLength() bool {
	if d.x.cfg.Mutations.AllowContentLengthHeader {
		return false
	}
	switch d.bodyMode {
	case extprocfilterv3.ProcessingMode_STREAMED,
		extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL:
		return true
	case extprocfilterv3.ProcessingMode_BUFFERED:
		return !d.sendHeaders
	}
	return false
}

// ---- timer (§5) ----

// armForCall (re)arms the timer for a message that needs a reply. It is
// never armed in a FULL_DUPLEX direction, headers message included (§5).
func (d *direction) armForCall() {
	if !d.fullDuplex() {
		d.armTimer(d.x.cfg.Failure.MessageTimeout)
	}
}

func (d *direction) armTimer(dur time.Duration) {
	d.stopTimer()
	gen := d.timerGen
	x := d.x
	d.timer = time.AfterFunc(dur, func() { x.post(func() { d.onTimer(gen) }) })
}

func (d *direction) stopTimer() {
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	d.timerGen++
}

func (d *direction) onTimer(gen int) {
	if gen != d.timerGen || d.timer == nil {
		return // stale: stopped or re-armed since
	}
	d.timer = nil
	d.x.onMessageTimeout(d)
}

// restartTimer applies an override_message_timeout the rules accepted for
// this direction (§5).
func (d *direction) restartTimer(dur time.Duration) {
	if d.timer != nil {
		d.armTimer(dur)
	}
}

// ---- output ----

// continueHeaders hands the headers to the sink (the routing point of §2.11
// for the request), then whatever body was produced while they were held.
func (d *direction) continueHeaders() {
	if d.headersContinued || d.headers == nil || d.x.finished {
		return
	}
	d.headersContinued = true
	if d.noBody {
		d.ended = true
		d.sink.headers(d.headers, true)
		return
	}
	d.sink.headers(d.headers, false)
	out, end, tr := d.out, d.outEnd, d.outTrailers
	d.out, d.outEnd, d.outTrailers = nil, false, nil
	if len(out) > 0 || end {
		d.emitData(out, end)
	}
	if tr != nil {
		d.emitTrailers(tr)
	}
}

func (d *direction) emitData(b []byte, end bool) {
	if d.ended || d.x.finished {
		return
	}
	if !d.headersContinued {
		d.out = append(d.out, b...)
		d.outEnd = d.outEnd || end
		return
	}
	if len(b) == 0 && !end {
		return
	}
	if end {
		d.ended = true
	}
	d.sink.data(b, end)
}

func (d *direction) emitTrailers(t *headerMap) {
	if d.ended || d.x.finished {
		return
	}
	if !d.headersContinued {
		d.outTrailers = t
		return
	}
	d.ended = true
	d.sink.trailers(t)
}

// ---- messages to the server ----

// Body messages carry the filter's slices without a copy: nothing writes to
// them once sent. Client and upstream reads each land in a fresh chunk, and a
// held body is handed over whole (held = nil), never appended to again.

// sendBuffered sends the held body as one message, answered as a buffered
// body: BUFFERED's and BUFFERED_PARTIAL's, and STREAMED's when the body was
// complete before the headers reply (§2.9). Envoy keeps the data until the
// reply, so a fail-open can re-inject it.
func (d *direction) sendBuffered(end bool) {
	d.inflight, d.inflightEnd = d.held, end
	d.held = nil
	d.expect(d.rules.WholeBody(end))
	d.armForCall()
	d.x.send(envoymsg.Body(d.dir(), d.inflight, end))
}

// sendChunk sends one STREAMED chunk and queues it for its reply (§2.4).
func (d *direction) sendChunk(b []byte, end bool) {
	d.chunks = append(d.chunks, queuedChunk{data: b, end: end})
	d.expect(d.rules.Body(end))
	d.armForCall()
	d.x.send(envoymsg.Body(d.dir(), b, end))
}

func (d *direction) sendTrailersNow() {
	d.trailersPending = false
	d.expect(d.rules.Trailers())
	d.armForCall()
	d.x.send(envoymsg.TrailersOf(d.dir(), d.trailers.toProto(nil)))
}

// ---- source events ----

func (d *direction) onHeaders(h *headerMap, end bool) {
	x := d.x
	d.headers, d.noBody = h, end
	if end {
		d.bodyComplete = true
	}
	if x.processingComplete || !d.sendHeaders {
		if !x.processingComplete {
			d.rules.SkipHeaders(end) // FULL_DUPLEX body replies may come with no headers reply
			if d.shouldRemoveContentLength() {
				d.headers.remove("content-length") // §3.5 case 3 (BUFFERED + SKIP) among others
			}
		}
		if !d.response {
			x.snapshotRouting()
		}
		d.continueHeaders()
		return
	}
	d.expect(d.rules.Headers(end))
	d.armForCall()
	x.send(envoymsg.HeadersOf(d.dir(), h.toProto(x.forwardAllowed), end))
	// §3.5: removed right after the headers message is sent, before any reply.
	if d.shouldRemoveContentLength() {
		d.headers.remove("content-length")
	}
}

func (d *direction) onData(b []byte, end bool) {
	x := d.x
	if end {
		d.bodyComplete = true
	}
	if d.replaced { // §3.1: "Clearing body chunk because CONTINUE_AND_REPLACE"
		if end {
			d.emitData(nil, true)
		}
		return
	}
	if x.processingComplete || d.partialDone || d.noBody {
		d.emitData(b, end)
		return
	}
	switch d.bodyMode {
	case extprocfilterv3.ProcessingMode_NONE:
		d.emitData(b, end) // held in out until the headers continue
	case extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		// §2.6: each chunk goes at once, headers reply or not; Envoy drains it
		// and keeps no copy.
		if d.rules.BodyEnded() {
			return
		}
		x.fdBodySeen = true
		d.expect(d.rules.Body(end))
		x.send(envoymsg.Body(d.dir(), b, end))
	case extprocfilterv3.ProcessingMode_BUFFERED:
		d.held = append(d.held, b...)
		if len(d.held) > x.cfg.Limits.BufferLimitBytes {
			x.bufferOverflow(d)
			return
		}
		if d.rules.State() == rules.Idle && end {
			d.sendBuffered(true)
		}
	case extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL:
		d.held = append(d.held, b...)
		if d.rules.State() == rules.Idle && (end || len(d.held) >= x.cfg.Limits.BufferLimitBytes) {
			d.sendBuffered(end)
		}
	case extprocfilterv3.ProcessingMode_STREAMED:
		if d.rules.State() == rules.HeadersCallback && !x.cfg.Modes.SendBodyWithoutWaitingForHeaderResponse {
			d.held = append(d.held, b...) // §2.1: held until the headers reply
			return
		}
		d.sendChunk(b, end)
	}
}

func (d *direction) onTrailers(t *headerMap) {
	x := d.x
	d.trailers, d.bodyComplete = t, true
	if d.replaced || x.processingComplete {
		d.emitTrailers(t)
		return
	}
	if d.fullDuplex() {
		// §2.6: sent at once, even while body replies are pending. The last
		// body chunk went with end_of_stream=false.
		d.sendTrailersNow()
		return
	}
	if d.rules.State() != rules.Idle || len(d.chunks) > 0 {
		d.trailersPending = true // §2.8: held until earlier callbacks finish
		return
	}
	switch {
	case d.partialDone:
	case d.bodyMode == extprocfilterv3.ProcessingMode_BUFFERED:
		// §2.3: the buffered body goes now with end_of_stream=false, the
		// trailers after its reply.
		d.trailersPending = true
		d.sendBuffered(false)
		return
	case d.bodyMode == extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL:
		d.trailersPending = true
		d.sendBuffered(false)
		return
	}
	d.trailersStep()
}

// trailersStep sends the trailers to the server (mode SEND) or passes them on.
func (d *direction) trailersStep() {
	d.trailersPending = false
	if d.sendTrailers && !d.x.processingComplete {
		d.sendTrailersNow()
		return
	}
	d.emitTrailers(d.trailers)
}

// afterCallback runs once a reply left the direction idle.
func (d *direction) afterCallback() {
	if d.rules.State() == rules.Idle && len(d.chunks) == 0 && d.trailersPending {
		d.trailersStep()
	}
}

// ---- replies ----

func (d *direction) applyHeaders(m *extprocv3.HeaderMutation, replacing bool) error {
	if m == nil {
		return nil
	}
	rejected, err := applyHeaderMutation(m, d.headers, d.x.p.rules, d.x.limits(), mutationOptions{
		dropContentLength: d.shouldRemoveContentLength(),
		replacing:         replacing,
	})
	if rejected > 0 {
		d.x.logf("%s: %d header mutation(s) rejected by mutation rules", d.name(), rejected)
	}
	return err
}

// The reply handlers run once the rules accepted the reply.

func (d *direction) onHeadersResponse(hr *extprocv3.HeadersResponse) error {
	d.stopTimer()
	cr := hr.GetResponse()
	replacing := cr.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE
	if err := d.applyHeaders(cr.GetHeaderMutation(), replacing); err != nil {
		return err
	}
	d.x.maybeClearRouteCache(d, cr)
	if replacing {
		d.continueAndReplace(cr.GetBodyMutation())
		return nil
	}
	if !d.response && d.fullDuplex() {
		// §2.11: in FULL_DUPLEX the LB sees what the headers reply set, even
		// when the headers stay held until the last body reply.
		d.x.snapshotRouting()
	}
	if d.noBody {
		d.continueHeaders()
		return nil
	}
	x := d.x
	switch d.bodyMode {
	case extprocfilterv3.ProcessingMode_NONE:
		d.continueHeaders()
		d.afterCallback()
	case extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if !d.bodyComplete {
			d.continueHeaders()
		}
		// Otherwise held until the end_of_stream body reply (§2.6).
	case extprocfilterv3.ProcessingMode_BUFFERED:
		if d.bodyComplete {
			// §2.3 step 3 / §2.9: the headers stay held until the body reply.
			d.sendBuffered(d.trailers == nil)
		}
	case extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL:
		switch {
		case d.bodyComplete:
			d.sendBuffered(d.trailers == nil)
		case len(d.held) >= x.cfg.Limits.BufferLimitBytes:
			d.sendBuffered(false)
		}
	case extprocfilterv3.ProcessingMode_STREAMED:
		switch {
		case x.cfg.Modes.SendBodyWithoutWaitingForHeaderResponse:
			d.continueHeaders()
			d.afterCallback()
		case d.bodyComplete:
			// §2.9: the whole body arrived before the headers reply: one
			// message, answered as a buffered body, headers held.
			d.sendBuffered(d.trailers == nil)
		default:
			d.continueHeaders()
			if len(d.held) > 0 {
				b := d.held
				d.held = nil
				d.sendChunk(b, false)
			}
		}
	}
	return nil
}

// continueAndReplace is §3.1: optional body replacement, Content-Length
// removed, no more body or trailer messages for this direction.
func (d *direction) continueAndReplace(bm *extprocv3.BodyMutation) {
	d.bodyMode = extprocfilterv3.ProcessingMode_NONE
	d.sendTrailers = false
	d.replaced = true
	d.held = nil
	nb, ok := rules.Replacement(bm)
	if !ok {
		d.continueHeaders()
		if d.bodyComplete && !d.noBody {
			d.emitData(nil, d.trailers == nil)
		}
	} else {
		d.headers.remove("content-length")
		hadNoBody := d.noBody
		d.noBody = false
		d.continueHeaders()
		d.emitData(nb, hadNoBody || (d.bodyComplete && d.trailers == nil))
	}
	if d.trailers != nil {
		d.emitTrailers(d.trailers)
	}
}

// onBodyResponse handles a body reply to the callback it answered.
func (d *direction) onBodyResponse(br *extprocv3.BodyResponse, answered rules.Callback) error {
	cr := br.GetResponse()
	switch {
	case d.fullDuplex():
		return d.onFullDuplexBody(cr)
	case answered == rules.BufferedBodyCallback:
		return d.onBufferedBody(cr, true)
	case answered == rules.BufferedPartialBodyCallback:
		return d.onBufferedBody(cr, false)
	}
	// A STREAMED chunk; its header mutations come too late (§2.4).
	c := d.chunks[0]
	d.chunks = d.chunks[1:]
	if nb, ok := rules.Replacement(cr.GetBodyMutation()); ok {
		c.data = nb // replaces or clears only this chunk
	}
	d.stopTimer() // re-armed by the next chunk sent (§5)
	d.emitData(c.data, c.end)
	d.afterCallback()
	return nil
}

func (d *direction) onFullDuplexBody(cr *extprocv3.CommonResponse) error {
	sr := cr.GetBodyMutation().GetStreamedResponse()
	// Header mutations in FULL_DUPLEX body replies come too late (§2.11).
	if !sr.GetEndOfStream() {
		d.emitData(sr.GetBody(), false)
		return nil
	}
	if d.trailers != nil {
		// Trailers follow with their own reply (§2.6 rule 6).
		d.emitData(sr.GetBody(), false)
		return nil
	}
	d.emitData(sr.GetBody(), true)
	d.continueHeaders()
	return nil
}

// onBufferedBody handles BufferedBodyCallback (BUFFERED and the §2.9 case)
// and BufferedPartialBodyCallback.
func (d *direction) onBufferedBody(cr *extprocv3.CommonResponse, buffered bool) error {
	d.stopTimer()
	// Header mutations apply only while the headers are still held (§2.3).
	if !d.headersContinued {
		if err := d.applyHeaders(cr.GetHeaderMutation(), false); err != nil {
			return err
		}
		d.x.maybeClearRouteCache(d, cr)
	}
	body := d.inflight
	d.inflight = nil
	// body / clear_body replace the buffer; streamed_response is a no-op here
	// (§3.4).
	if nb, ok := rules.Replacement(cr.GetBodyMutation()); ok {
		if buffered && !d.headersContinued {
			cl, _ := d.headers.get("content-length")
			if err := rules.CheckContentLength(cl, len(nb)); err != nil {
				return fmt.Errorf("%w: %v", errMutation, err)
			}
		}
		body = nb
	}
	if !buffered {
		d.partialDone = true // §2.5: the rest passes through unseen
	}
	d.continueHeaders()
	end := d.inflightEnd
	rest := d.held
	d.held = nil
	if len(rest) > 0 || (d.bodyComplete && !end && d.trailers == nil) {
		d.emitData(body, false)
		d.emitData(rest, d.bodyComplete && d.trailers == nil)
	} else {
		d.emitData(body, end)
	}
	d.afterCallback()
	return nil
}

func (d *direction) onTrailersResponse(tr *extprocv3.TrailersResponse) error {
	d.stopTimer()
	rejected, err := applyHeaderMutation(tr.GetHeaderMutation(), d.trailers, d.x.p.rules, d.x.limits(), mutationOptions{})
	if err != nil {
		return err
	}
	if rejected > 0 {
		d.x.logf("%s: %d trailer mutation(s) rejected", d.name(), rejected)
	}
	d.continueHeaders()
	d.emitTrailers(d.trailers)
	return nil
}

// clearAsyncState is the fail-open / clean-close path (§5, §7.2): stop
// waiting, re-inject what Envoy still holds, continue unmodified. FULL_DUPLEX
// data already handed to the server is lost.
func (d *direction) clearAsyncState() {
	d.stopTimer()
	if d.headers == nil {
		return
	}
	var data []byte
	for _, c := range d.chunks {
		data = append(data, c.data...)
	}
	data = append(data, d.inflight...)
	data = append(data, d.held...)
	d.chunks, d.inflight, d.held = nil, nil, nil
	d.continueHeaders()
	end := d.bodyComplete && d.trailers == nil && !d.noBody
	if len(data) > 0 || end {
		d.emitData(data, end)
	}
	if d.bodyComplete && d.trailers != nil {
		d.emitTrailers(d.trailers)
	}
}
