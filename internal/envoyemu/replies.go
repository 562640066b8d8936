package envoyemu

import (
	"fmt"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
)

// The reply handlers run once the rules accepted the reply (exchange.onMessage):
// they apply it to the headers and body the filter holds and pass them on.

func (d *direction) applyHeaders(m *extprocv3.HeaderMutation, replacing bool) error {
	if m == nil {
		return nil
	}
	rejected, err := applyHeaderMutation(m, d.src.headers, d.x.p.headers, d.x.limits(), mutationOptions{
		dropContentLength: d.shouldRemoveContentLength(),
		replacing:         replacing,
	})
	if rejected > 0 {
		d.x.logf("%s: %d header mutation(s) rejected by mutation rules", d.name(), rejected)
	}
	return err
}

func (d *direction) onHeadersResponse(hr *extprocv3.HeadersResponse) error {
	d.timer.stop()
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
	if d.src.noBody {
		d.continueHeaders()
		return nil
	}
	complete, whole := d.src.bodyComplete, d.src.trailers == nil
	switch d.bodyMode {
	case extprocfilterv3.ProcessingMode_NONE:
		d.continueHeaders()
		d.afterCallback()
	case extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if !complete {
			d.continueHeaders()
		}
		// Otherwise held until the end_of_stream body reply (§2.6).
	case extprocfilterv3.ProcessingMode_BUFFERED:
		if complete {
			// §2.3 step 3 / §2.9: the headers stay held until the body reply.
			d.sendBuffered(whole)
		}
	case extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL:
		switch {
		case complete:
			d.sendBuffered(whole)
		case len(d.buf.held) >= d.x.cfg.Limits.BufferLimitBytes:
			d.sendBuffered(false)
		}
	case extprocfilterv3.ProcessingMode_STREAMED:
		switch {
		case d.x.cfg.Modes.SendBodyWithoutWaitingForHeaderResponse:
			d.continueHeaders()
			d.afterCallback()
		case complete:
			// §2.9: the whole body arrived before the headers reply: one
			// message, answered as a buffered body, headers held.
			d.sendBuffered(whole)
		default:
			d.continueHeaders()
			if len(d.buf.held) > 0 {
				b := d.buf.held
				d.buf.held = nil
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
	d.buf.replaced = true
	d.buf.held = nil
	src := &d.src
	nb, ok := rules.Replacement(bm)
	if !ok {
		d.continueHeaders()
		if src.bodyComplete && !src.noBody {
			d.emitData(nil, src.trailers == nil)
		}
	} else {
		src.headers.remove("content-length")
		hadNoBody := src.noBody
		src.noBody = false
		d.continueHeaders()
		d.emitData(nb, hadNoBody || (src.bodyComplete && src.trailers == nil))
	}
	if src.trailers != nil {
		d.emitTrailers(src.trailers)
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
	c := d.buf.chunks[0]
	d.buf.chunks = d.buf.chunks[1:]
	if nb, ok := rules.Replacement(cr.GetBodyMutation()); ok {
		c.data = nb // replaces or clears only this chunk
	}
	d.timer.stop() // re-armed by the next chunk sent (§5)
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
	if d.src.trailers != nil {
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
	d.timer.stop()
	held := !d.out.headersContinued
	// Header mutations apply only while the headers are still held (§2.3).
	if held {
		if err := d.applyHeaders(cr.GetHeaderMutation(), false); err != nil {
			return err
		}
		d.x.maybeClearRouteCache(d, cr)
	}
	body := d.buf.inflight
	d.buf.inflight = nil
	if buffered && held {
		cl, _ := d.src.headers.get("content-length")
		if err := rules.CheckContentLength(cl, cr.GetBodyMutation()); err != nil {
			return fmt.Errorf("%w: %v", errMutation, err)
		}
	}
	// body / clear_body replace the buffer; streamed_response is a no-op here
	// (§3.4).
	if nb, ok := rules.Replacement(cr.GetBodyMutation()); ok {
		body = nb
	}
	if !buffered {
		d.buf.partialDone = true // §2.5: the rest passes through unseen
	}
	d.continueHeaders()
	end := d.buf.inflightEnd
	rest := d.buf.held
	d.buf.held = nil
	last := d.src.bodyComplete && d.src.trailers == nil
	if len(rest) > 0 || (last && !end) {
		d.emitData(body, false)
		d.emitData(rest, last)
	} else {
		d.emitData(body, end)
	}
	d.afterCallback()
	return nil
}

func (d *direction) onTrailersResponse(tr *extprocv3.TrailersResponse) error {
	d.timer.stop()
	rejected, err := applyHeaderMutation(tr.GetHeaderMutation(), d.src.trailers, d.x.p.headers, d.x.limits(), mutationOptions{})
	if err != nil {
		return err
	}
	if rejected > 0 {
		d.x.logf("%s: %d trailer mutation(s) rejected", d.name(), rejected)
	}
	d.continueHeaders()
	d.emitTrailers(d.src.trailers)
	return nil
}

// clearAsyncState is the fail-open / clean-close path (§5, §7.2): stop
// waiting, re-inject what Envoy still holds, continue unmodified. FULL_DUPLEX
// data already handed to the server is lost.
func (d *direction) clearAsyncState() {
	d.timer.stop()
	if d.src.headers == nil {
		return
	}
	var data []byte
	for _, c := range d.buf.chunks {
		data = append(data, c.data...)
	}
	data = append(data, d.buf.inflight...)
	data = append(data, d.buf.held...)
	d.buf.chunks, d.buf.inflight, d.buf.held = nil, nil, nil
	d.continueHeaders()
	end := d.src.bodyComplete && d.src.trailers == nil && !d.src.noBody
	if len(data) > 0 || end {
		d.emitData(data, end)
	}
	if d.src.bodyComplete && d.src.trailers != nil {
		d.emitTrailers(d.src.trailers)
	}
}
