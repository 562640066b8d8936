package rules

import (
	"fmt"
	"slices"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// Direction is one half of the filter, the decoder (request) or the encoder
// (response): what Envoy sent in it and what it waits for.
type Direction struct {
	response bool
	mode     filterv3.ProcessingMode_BodySendMode
	off      string // why the direction left the model
	sent     record
	replaced bool // CONTINUE_AND_REPLACE: the body is over for the server (§3.1)

	// Outside FULL_DUPLEX every message awaits its one reply, in order: at
	// most one call at a time, but for STREAMED chunks (§2.4).
	calls []Callback
	fd    duplexWait
	timer timerState
}

// record is what Envoy sent in a direction.
type record struct {
	headers     bool // sent, or passed on unseen (header mode SKIP)
	headersSent bool
	headersEOS  bool
	bodies      int // body messages
	bodyEOS     bool
	trailers    bool
}

// duplexWait is what a FULL_DUPLEX direction waits for (§2.6).
type duplexWait struct {
	headers  bool // the headers reply
	open     bool // body replies are welcome (StreamedBodyCallback)
	ended    bool // the end_of_stream body reply, or the trailers reply, came
	trailers bool // the trailers reply
}

// timerState is the direction's message timer (§5).
type timerState struct {
	running    bool
	overridden bool // override_message_timeout used on the running call
}

// Name is "request" or "response".
func (d *Direction) Name() string {
	if d.response {
		return "response"
	}
	return "request"
}

// Mode is the body mode the rules apply; CONTINUE_AND_REPLACE makes it NONE.
func (d *Direction) Mode() filterv3.ProcessingMode_BodySendMode { return d.mode }

// Off says why the direction left the model ("" while it is modelled).
func (d *Direction) Off() string { return d.off }

// HeadersSent: the headers message went to the server.
func (d *Direction) HeadersSent() bool { return d.sent.headersSent }

// HeadersEOS: the headers carried end_of_stream; no body follows (§2.1).
func (d *Direction) HeadersEOS() bool { return d.sent.headersEOS }

// BodyEnded: Envoy sent the body's end, end_of_stream on a body message or
// the trailers.
func (d *Direction) BodyEnded() bool { return d.sent.bodyEOS || d.sent.trailers }

func (d *Direction) fullDuplex() bool { return d.mode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED }

// State is the callback the next reply of this direction answers.
func (d *Direction) State() Callback {
	switch {
	case !d.fullDuplex() && len(d.calls) > 0:
		return d.calls[0]
	case d.fd.headers:
		return HeadersCallback
	case d.fd.open:
		return StreamedBodyCallback
	case d.fd.trailers:
		return TrailersCallback
	}
	return Idle
}

// Settled: Envoy waits for nothing in this direction, and in FULL_DUPLEX has
// the body's end from the server or sends no body.
func (d *Direction) Settled() bool {
	return d.State() == Idle && !d.fd.trailers && (!d.fullDuplex() || d.fd.ended || d.sent.headersEOS)
}

func (d *Direction) leave(why string) {
	if d.off == "" {
		d.off = why
	}
}

// call queues a message that awaits its own reply and (re)arms the timer.
func (d *Direction) call(c Callback) {
	d.calls = append(d.calls, c)
	d.timer = timerState{running: true}
}

// ---- messages ----

// Headers records a headers message; eos: no body follows.
func (d *Direction) Headers(eos bool) Fit {
	if d.off != "" {
		return Unexpected
	}
	if d.sent.headers {
		d.leave("headers sent twice")
		return Unexpected
	}
	d.sent.headers, d.sent.headersSent, d.sent.headersEOS = true, true, eos
	if d.fullDuplex() {
		d.fd.headers = true // no timer in FULL_DUPLEX, headers message included (§5)
	} else {
		d.call(HeadersCallback)
	}
	return Expected
}

// SkipHeaders records headers passed on unseen (header mode SKIP): in
// FULL_DUPLEX, body replies may then come with no headers reply, once a
// chunk went (Body).
func (d *Direction) SkipHeaders(eos bool) {
	d.sent.headers, d.sent.headersEOS = true, eos
}

// Body records a body message as the direction's mode sends it: a STREAMED or
// FULL_DUPLEX chunk, or the one BUFFERED / BUFFERED_PARTIAL message.
func (d *Direction) Body(eos bool) Fit {
	if d.mode == filterv3.ProcessingMode_STREAMED {
		return d.body(eos, StreamedBodyCallback)
	}
	return d.WholeBody(eos)
}

// WholeBody records a body held until now and sent as one message, answered
// as a buffered body: Body in the buffered modes, and the §2.9 case of
// STREAMED, a body complete before the headers reply.
func (d *Direction) WholeBody(eos bool) Fit {
	if d.mode == filterv3.ProcessingMode_BUFFERED_PARTIAL {
		return d.body(eos, BufferedPartialBodyCallback)
	}
	return d.body(eos, BufferedBodyCallback)
}

func (d *Direction) body(eos bool, c Callback) Fit {
	if d.off != "" {
		return Unexpected
	}
	if d.sent.bodyEOS {
		return Repeat // envoy#46237
	}
	if !d.sent.headers || d.sent.headersEOS || d.sent.trailers || !sendsBody(d.mode) || (d.buffered() && d.sent.bodies > 0) {
		d.leave(fmt.Sprintf("a body Envoy would not send (mode %s)", d.mode))
		return Unexpected
	}
	d.sent.bodies++
	d.sent.bodyEOS = eos
	switch {
	case !d.fullDuplex():
		d.call(c)
	case !d.fd.headers && !d.fd.ended:
		// A chunk sent once the headers reply came (or headers were skipped)
		// opens the direction to body replies (handleDataStreamedModeBase);
		// one sent while it is due leaves it HeadersCallback.
		d.fd.open = true
	}
	return Expected
}

// buffered reports whether the mode sends the body as one message.
func (d *Direction) buffered() bool {
	return d.mode == filterv3.ProcessingMode_BUFFERED || d.mode == filterv3.ProcessingMode_BUFFERED_PARTIAL
}

func sendsBody(m filterv3.ProcessingMode_BodySendMode) bool {
	switch m {
	case filterv3.ProcessingMode_STREAMED, filterv3.ProcessingMode_BUFFERED,
		filterv3.ProcessingMode_BUFFERED_PARTIAL, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return true
	}
	return false
}

// Trailers records a trailers message. In the buffered modes they follow the
// one body message, sent without end_of_stream (§2.3).
func (d *Direction) Trailers() Fit {
	if d.off != "" {
		return Unexpected
	}
	if !d.sent.headers || d.sent.headersEOS || d.sent.bodyEOS || d.sent.trailers || d.replaced || (d.buffered() && d.sent.bodies != 1) {
		d.leave("trailers Envoy would not send")
		return Unexpected
	}
	d.sent.trailers = true
	if d.fullDuplex() {
		d.fd.trailers = true // sent at once, even while body replies are due (§2.6)
	} else {
		d.call(TrailersCallback)
	}
	return Expected
}

// ---- replies ----

// answer takes the reply to the oldest call off the queue; any reply stops
// the timer, re-armed by the next message sent (§5).
func (d *Direction) answer() {
	if !d.fullDuplex() {
		d.calls = d.calls[1:]
	}
	d.timer = timerState{}
}

func (d *Direction) unjudged(v Verdict) Verdict {
	v.Outcome, v.Reason = Unjudged, d.Name()+" is off the model: "+d.off
	return v
}

func (d *Direction) headersReply(cr *extprocv3.CommonResponse) Verdict {
	var v Verdict
	replacing := cr.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE
	if cr.GetBodyMutation() != nil && !replacing {
		v.Dropped = append(v.Dropped, "a body_mutation in a headers reply without CONTINUE_AND_REPLACE (§3.4)")
	}
	if d.off != "" {
		return d.unjudged(v)
	}
	if st := d.State(); st != HeadersCallback {
		return v.reject("%s headers response received in state %s", d.Name(), st)
	}
	if d.fullDuplex() {
		d.fd.headers = false
		// getCallbackStateAfterHeaderResp: body replies only once a chunk
		// went (bodyReceived); else Idle, or TrailersCallback (fd.trailers).
		d.fd.open = d.sent.bodies > 0
	}
	d.answer()
	if replacing {
		d.replace()
	}
	return v.accept(HeadersCallback)
}

// replace is CONTINUE_AND_REPLACE (§3.1): no more body messages for this
// direction, so no more body replies; a trailers reply already due stays due.
func (d *Direction) replace() {
	trailersDue := d.fd.trailers
	d.replaced = true
	d.mode = filterv3.ProcessingMode_NONE
	d.fd = duplexWait{}
	d.calls = slices.DeleteFunc(d.calls, func(c Callback) bool { return c == StreamedBodyCallback })
	if trailersDue {
		d.calls = append(d.calls, TrailersCallback)
	}
}

func (d *Direction) bodyReply(cr *extprocv3.CommonResponse) Verdict {
	var v Verdict
	if d.off != "" {
		return d.unjudged(v)
	}
	st := d.State()
	if st == HeadersCallback {
		// §2.6 rule 1 in FULL_DUPLEX (ServerSendOutOfOrderResponseDuplexStreamed).
		return v.reject("%s body response received before the headers response", d.Name())
	}
	sr := cr.GetBodyMutation().GetStreamedResponse()
	if d.fullDuplex() {
		switch {
		case st != StreamedBodyCallback || d.fd.ended:
			return v.reject("%s body response received in state %s after end_of_stream=%v", d.Name(), st, d.fd.ended)
		case sr == nil:
			// §2.6 rule 3: an empty CommonResponse too (GIE #3035).
			return v.reject("Normal body mutation response is received while body_mode_ is FULL_DUPLEX_STREAMED")
		}
		if cr.GetHeaderMutation() != nil {
			v.Dropped = append(v.Dropped, "a header_mutation in a FULL_DUPLEX body reply, which comes too late (§2.11)")
		}
		if sr.GetEndOfStream() {
			d.fd.ended = true
			d.fd.open = d.sent.trailers // the trailers reply is still due (§2.6 rule 6)
		}
		return v.accept(StreamedBodyCallback)
	}
	switch st {
	case BufferedBodyCallback, BufferedPartialBodyCallback:
		if sr != nil {
			v.Dropped = append(v.Dropped, "a streamed_response in a buffered body reply, a no-op (§3.4)")
		}
	case StreamedBodyCallback:
		if sr != nil {
			return v.reject("streamed_response received while body_mode_ is STREAMED") // §3.4
		}
		if cr.GetHeaderMutation() != nil {
			v.Dropped = append(v.Dropped, "a header_mutation in a STREAMED body reply: the headers already went on (§2.4)")
		}
	default:
		return v.reject("%s body response received while no body call is pending (state %s)", d.Name(), st)
	}
	d.answer()
	return v.accept(st)
}

func (d *Direction) trailersReply() Verdict {
	var v Verdict
	if d.off != "" {
		return d.unjudged(v)
	}
	if d.fullDuplex() {
		if !d.fd.trailers || d.fd.headers {
			return v.reject("%s trailers response received while not waiting for it", d.Name())
		}
		d.fd = duplexWait{ended: true}
		return v.accept(TrailersCallback)
	}
	if d.State() != TrailersCallback {
		return v.reject("%s trailers response received while not waiting for it", d.Name())
	}
	d.answer()
	return v.accept(TrailersCallback)
}

// owed is what the direction still waits for, for a stream that ends now. In
// FULL_DUPLEX the server may hold the headers reply until the body is in, so
// it is owed only once Envoy sent the direction's end.
func (d *Direction) owed() string {
	if d.off != "" {
		return ""
	}
	if !d.fullDuplex() {
		if n := len(d.calls); n > 0 {
			return fmt.Sprintf("%s: %d message(s) never answered (mode %s): Envoy would wait until its message timeout", d.Name(), n, d.mode)
		}
		return ""
	}
	switch {
	case d.fd.headers && (d.sent.headersEOS || d.BodyEnded()):
		return d.Name() + ": the headers reply never came"
	case d.sent.bodyEOS && !d.fd.ended:
		return d.Name() + ": the body ended but no end_of_stream reply came: Envoy would wait forever (FULL_DUPLEX has no message timer)"
	case d.fd.trailers:
		return d.Name() + ": the trailers reply never came"
	}
	return ""
}
