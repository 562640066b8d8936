package envoyemu

import (
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
)

// What the client (request) or the upstream (response) delivers, and the
// messages to the server it causes. Each message is recorded in the rules as
// it goes.

// Body messages carry the filter's slices without a copy: nothing writes to
// them once sent. Client and upstream reads each land in a fresh chunk, and a
// held body is handed over whole (held = nil), never appended to again.

// sendBuffered sends the held body as one message, answered as a buffered
// body: BUFFERED's and BUFFERED_PARTIAL's, and STREAMED's when the body was
// complete before the headers reply (§2.9). Envoy keeps the data until the
// reply, so a fail-open can re-inject it.
func (d *direction) sendBuffered(end bool) {
	d.buf.inflight, d.buf.inflightEnd = d.buf.held, end
	d.buf.held = nil
	d.expect(d.rules.WholeBody(end))
	d.armForCall()
	d.x.send(envoymsg.Body(d.dir(), d.buf.inflight, end))
}

// sendChunk sends one STREAMED chunk and queues it for its reply (§2.4).
func (d *direction) sendChunk(b []byte, end bool) {
	d.buf.chunks = append(d.buf.chunks, queuedChunk{data: b, end: end})
	d.expect(d.rules.Body(end))
	d.armForCall()
	d.x.send(envoymsg.Body(d.dir(), b, end))
}

func (d *direction) sendTrailersNow() {
	d.buf.trailersPending = false
	d.expect(d.rules.Trailers())
	d.armForCall()
	d.x.send(envoymsg.TrailersOf(d.dir(), d.src.trailers.toProto(nil)))
}

func (d *direction) onHeaders(h *headerMap, end bool) {
	x := d.x
	d.src.headers, d.src.noBody = h, end
	if end {
		d.src.bodyComplete = true
	}
	if x.proc.complete || !d.sendHeaders {
		if !x.proc.complete {
			d.rules.SkipHeaders(end) // FULL_DUPLEX body replies may come with no headers reply
			if d.shouldRemoveContentLength() {
				h.remove("content-length") // §3.5 case 3 (BUFFERED + SKIP) among others
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
		h.remove("content-length")
	}
}

func (d *direction) onData(b []byte, end bool) {
	x := d.x
	if end {
		d.src.bodyComplete = true
	}
	if d.buf.replaced { // §3.1: "Clearing body chunk because CONTINUE_AND_REPLACE"
		if end {
			d.emitData(nil, true)
		}
		return
	}
	if x.proc.complete || d.buf.partialDone || d.src.noBody {
		d.emitData(b, end)
		return
	}
	limit := x.cfg.Limits.BufferLimitBytes
	switch d.bodyMode {
	case extprocfilterv3.ProcessingMode_NONE:
		d.emitData(b, end) // held in out until the headers continue
	case extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		// §2.6: each chunk goes at once, headers reply or not; Envoy drains it
		// and keeps no copy.
		if d.rules.BodyEnded() {
			return
		}
		x.proc.fdBodySeen = true
		d.expect(d.rules.Body(end))
		x.send(envoymsg.Body(d.dir(), b, end))
	case extprocfilterv3.ProcessingMode_BUFFERED:
		d.buf.held = append(d.buf.held, b...)
		if len(d.buf.held) > limit {
			x.bufferOverflow(d)
			return
		}
		if d.rules.State() == rules.Idle && end {
			d.sendBuffered(true)
		}
	case extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL:
		d.buf.held = append(d.buf.held, b...)
		if d.rules.State() == rules.Idle && (end || len(d.buf.held) >= limit) {
			d.sendBuffered(end)
		}
	case extprocfilterv3.ProcessingMode_STREAMED:
		if d.rules.State() == rules.HeadersCallback && !x.cfg.Modes.SendBodyWithoutWaitingForHeaderResponse {
			d.buf.held = append(d.buf.held, b...) // §2.1: held until the headers reply
			return
		}
		d.sendChunk(b, end)
	}
}

func (d *direction) onTrailers(t *headerMap) {
	x := d.x
	d.src.trailers, d.src.bodyComplete = t, true
	if d.buf.replaced || x.proc.complete {
		d.emitTrailers(t)
		return
	}
	if d.fullDuplex() {
		// §2.6: sent at once, even while body replies are pending. The last
		// body chunk went with end_of_stream=false.
		d.sendTrailersNow()
		return
	}
	if d.rules.State() != rules.Idle || len(d.buf.chunks) > 0 {
		d.buf.trailersPending = true // §2.8: held until earlier callbacks finish
		return
	}
	switch {
	case d.buf.partialDone:
	case d.bodyMode == extprocfilterv3.ProcessingMode_BUFFERED,
		d.bodyMode == extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL:
		// §2.3: the buffered body goes now with end_of_stream=false, the
		// trailers after its reply.
		d.buf.trailersPending = true
		d.sendBuffered(false)
		return
	}
	d.trailersStep()
}

// trailersStep sends the trailers to the server (mode SEND) or passes them on.
func (d *direction) trailersStep() {
	d.buf.trailersPending = false
	if d.sendTrailers && !d.x.proc.complete {
		d.sendTrailersNow()
		return
	}
	d.emitTrailers(d.src.trailers)
}

// afterCallback runs once a reply left the direction idle.
func (d *direction) afterCallback() {
	if d.rules.State() == rules.Idle && len(d.buf.chunks) == 0 && d.buf.trailersPending {
		d.trailersStep()
	}
}
