// Package rules is one model of what Envoy's ext_proc filter makes of the
// server's replies (docs/envoy.md §7.3, §10): per direction, what Envoy sent (headers, body
// messages and trailers with their end_of_stream, in the direction's body
// mode) and what it waits for; per reply, whether Envoy acts on it
// (Accepted), drops it without error (Ignored), or rejects it (Spurious:
// status_on_error, or a fail-open under failure_mode_allow); and, once the
// stream ends, what Envoy is still owed. The emulator decides with it which
// replies are spurious; the handlers' fuzz checker judges our server with it.
//
// What it models:
//
//   - FULL_DUPLEX_STREAMED (§2.6): no reply per message and no message timer.
//     The headers reply comes first, then body replies, only as
//     streamed_response, none after the one with end_of_stream (or after the
//     trailers reply, when trailers were sent); the trailers reply after the
//     headers reply.
//   - The other modes (§2.1–§2.5, §2.8): one reply per message, in the order
//     Envoy sent them; a STREAMED chunk's reply is never streamed_response
//     (§3.4); a STREAMED body complete before the headers reply goes as one
//     message, answered as a buffered body (§2.9).
//   - The message timer (§5): each message outside FULL_DUPLEX (re)arms its
//     direction's timer, each accepted reply stops it; override_message_timeout
//     restarts a running timer once per call, within [1ms,
//     max_message_timeout], and is handled alone.
//   - CONTINUE_AND_REPLACE ends the direction's body (§3.1); an ImmediateResponse
//     (§4) or a spurious reply ends the stream, and later replies are late,
//     dropped (§7.2).
//   - The parts of an accepted reply Envoy drops without error (§2.4, §2.11,
//     §3.4, §5) are listed in Verdict.Dropped.
//   - Envoy checks a held Content-Length against the body a BUFFERED reply puts
//     in its place (§3.5): CheckContentLength, for whoever holds the headers.
//   - Which header mutations Envoy takes (§3.2–§3.3): HeaderRules, and the
//     names and values it refuses outright.
//
// Replies are matched in order against the messages sent so far, so a caller
// that sends without waiting for replies (a fuzzer) is judged as if Envoy had
// waited for each. A message Envoy never sends in that state (headers twice, a
// body in NONE mode, a second protocol_config with other modes...) takes its
// direction off the model: its replies are Unjudged from then on. The one
// repeat Envoy does send, a body after the body's end (envoy#46237), is a
// Repeat, which Envoy expects no reply to.
//
// Messages come in two ways: Stream.Sent takes one as it went on the wire (the
// fuzz checker), the Direction methods take what only the sender knows, headers
// passed on unseen (SkipHeaders) and the §2.9 whole body (WholeBody) (the
// emulator). Replies all go through Stream.Reply.
package rules

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// Callback is what a direction waits for: Envoy's
// ProcessorState::CallbackState (§10).
type Callback int

const (
	Idle Callback = iota
	HeadersCallback
	BufferedBodyCallback
	StreamedBodyCallback // a STREAMED chunk's reply, or FULL_DUPLEX body replies
	BufferedPartialBodyCallback
	TrailersCallback
)

func (c Callback) String() string {
	return [...]string{"Idle", "HeadersCallback", "BufferedBodyCallback", "StreamedBodyCallback",
		"BufferedPartialBodyCallback", "TrailersCallback"}[c]
}

// Outcome is what Envoy does with a reply.
type Outcome int

const (
	Accepted Outcome = iota // acted on (some parts may be Dropped)
	Ignored                 // dropped whole, without error
	Spurious                // rejected (§7.3): status_on_error, or fail-open
	Unjudged                // its direction is off the model: Envoy would never be there
)

func (o Outcome) String() string {
	return [...]string{"accepted", "ignored", "spurious", "unjudged"}[o]
}

// Verdict is the model's judgement of one reply.
type Verdict struct {
	Outcome Outcome
	Reason  string   // why it is not Accepted, in Envoy's words where it logs some
	Dropped []string // parts of the message Envoy drops without error
	// Answered is the callback an Accepted reply answered: what the reply
	// means depends on it (a body reply to a BufferedBodyCallback replaces the
	// whole body, to a STREAMED chunk only that chunk).
	Answered Callback
	// Restarted: an Accepted override_message_timeout restarts the message
	// timer of these directions.
	Restarted []*Direction
}

func (v Verdict) reject(format string, args ...any) Verdict {
	v.Outcome, v.Reason = Spurious, fmt.Sprintf(format, args...)
	return v
}

func (v Verdict) accept(answered Callback) Verdict {
	v.Outcome, v.Answered = Accepted, answered
	return v
}

// Fit is how a message Envoy sends fits the model.
type Fit int

const (
	Expected   Fit = iota // Envoy sends this here; its reply rules apply
	Repeat                // the body's end again (envoy#46237): Envoy expects no reply to it
	Unexpected            // Envoy never sends this here: the direction leaves the model
)

func (f Fit) String() string {
	return [...]string{"expected", "repeat", "unexpected"}[f]
}

// Config is what the rules need of the filter's configuration.
type Config struct {
	RequestMode, ResponseMode               filterv3.ProcessingMode_BodySendMode
	SendBodyWithoutWaitingForHeaderResponse bool
	// MaxMessageTimeout bounds override_message_timeout; 0 disables it, as in
	// Envoy (§5).
	MaxMessageTimeout        time.Duration
	DisableImmediateResponse bool // §4: an ImmediateResponse is then spurious
}

// Stream is Envoy's view of one ext_proc stream: its two directions, which
// share the gRPC stream but keep separate states (§1.7).
type Stream struct {
	Request, Response *Direction

	cfg      Config
	messages int
	over     string // why Envoy consults the server no more
}

// NewStream starts a stream with nothing sent yet.
func NewStream(cfg Config) *Stream {
	return &Stream{
		Request:  &Direction{mode: cfg.RequestMode},
		Response: &Direction{response: true, mode: cfg.ResponseMode},
		cfg:      cfg,
	}
}

// Over says why Envoy consults the server no more ("" while it does): an
// ImmediateResponse, a spurious reply, or Close.
func (s *Stream) Over() string { return s.over }

// Close ends processing (§7.2: a fail-open, a local reply, a clean close):
// Envoy waits for nothing more, and every later reply is late.
func (s *Stream) Close(why string) {
	if s.over != "" {
		return
	}
	s.over = why
	for _, d := range s.directions() {
		d.calls, d.fd, d.timer = nil, duplexWait{}, timerState{}
	}
}

func (s *Stream) directions() [2]*Direction { return [2]*Direction{s.Request, s.Response} }

// Sent records one message as Envoy sent it and says how it fits: Envoy sends
// protocol_config on the first message only (§1.2), so a later one naming
// other modes takes both directions off the model.
func (s *Stream) Sent(m *extprocv3.ProcessingRequest) Fit {
	s.messages++
	if pc := m.GetProtocolConfig(); pc != nil && s.messages > 1 &&
		(pc.GetRequestBodyMode() != s.cfg.RequestMode || pc.GetResponseBodyMode() != s.cfg.ResponseMode ||
			pc.GetSendBodyWithoutWaitingForHeaderResponse() != s.cfg.SendBodyWithoutWaitingForHeaderResponse) {
		s.Request.leave("a later protocol_config changed the modes")
		s.Response.leave("a later protocol_config changed the modes")
	}
	switch r := m.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return s.Request.Headers(r.RequestHeaders.GetEndOfStream())
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return s.Response.Headers(r.ResponseHeaders.GetEndOfStream())
	case *extprocv3.ProcessingRequest_RequestBody:
		return s.Request.Body(r.RequestBody.GetEndOfStream())
	case *extprocv3.ProcessingRequest_ResponseBody:
		return s.Response.Body(r.ResponseBody.GetEndOfStream())
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return s.Request.Trailers()
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return s.Response.Trailers()
	}
	return Unexpected // no oneof: it concerns neither direction
}

// Reply judges one reply and, when Envoy acts on it, moves the model on.
func (s *Stream) Reply(r *extprocv3.ProcessingResponse) Verdict {
	if s.over != "" {
		return Verdict{Outcome: Ignored, Reason: "a late reply, after " + s.over + " (§7.2)"}
	}
	var v Verdict
	if ot := r.GetOverrideMessageTimeout(); ot != nil {
		v = s.override(ot.AsDuration(), r.GetResponse())
	} else {
		v = s.reply(r)
	}
	if v.Outcome == Spurious {
		s.Close("a spurious reply")
	}
	return v
}

func (s *Stream) reply(r *extprocv3.ProcessingResponse) Verdict {
	switch x := r.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		return s.Request.headersReply(x.RequestHeaders.GetResponse())
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		return s.Response.headersReply(x.ResponseHeaders.GetResponse())
	case *extprocv3.ProcessingResponse_RequestBody:
		return s.Request.bodyReply(x.RequestBody.GetResponse())
	case *extprocv3.ProcessingResponse_ResponseBody:
		return s.Response.bodyReply(x.ResponseBody.GetResponse())
	case *extprocv3.ProcessingResponse_RequestTrailers:
		return s.Request.trailersReply()
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		return s.Response.trailersReply()
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		if s.cfg.DisableImmediateResponse {
			return Verdict{}.reject("immediate response received while disable_immediate_response is set")
		}
		s.Close("an ImmediateResponse (§4)")
		return Verdict{}.accept(Idle)
	case *extprocv3.ProcessingResponse_StreamedImmediateResponse:
		// Newer than the filter version modelled (§4): an unknown oneof there.
		return Verdict{}.reject("unhandled message: streamed_immediate_response is not modelled")
	}
	return Verdict{}.reject("unhandled message: no response oneof set")
}

// override is §5: handled alone, whatever else the message carries; honoured
// within [1ms, max_message_timeout], by each direction whose timer runs and
// was not overridden since its call started.
func (s *Stream) override(dur time.Duration, rest any) Verdict {
	var v Verdict
	if rest != nil {
		v.Dropped = append(v.Dropped, fmt.Sprintf("the %T next to override_message_timeout, which is handled alone (§5)", rest))
	}
	if dur < time.Millisecond || dur > s.cfg.MaxMessageTimeout {
		v.Outcome, v.Reason = Ignored, fmt.Sprintf("override_message_timeout %v ignored (max_message_timeout %v)", dur, s.cfg.MaxMessageTimeout)
		return v
	}
	offTimed := false
	for _, d := range s.directions() {
		switch {
		case d.off != "":
			offTimed = offTimed || !d.fullDuplex()
		case d.timer.running && !d.timer.overridden:
			d.timer.overridden = true
			v.Restarted = append(v.Restarted, d)
		}
	}
	switch {
	case len(v.Restarted) > 0:
		v.Outcome = Accepted
	case offTimed:
		v.Outcome, v.Reason = Unjudged, "override_message_timeout while a timed direction is off the model"
	default:
		v.Outcome, v.Reason = Ignored, fmt.Sprintf("override_message_timeout %v ignored: no running timer or already overridden", dur)
	}
	return v
}

// Owed lists what Envoy still waits for, for a stream that ends now.
func (s *Stream) Owed() []string {
	if s.over != "" {
		return nil
	}
	var out []string
	for _, d := range s.directions() {
		if why := d.owed(); why != "" {
			out = append(out, why)
		}
	}
	return out
}

// Replacement is what a body_mutation makes of a buffered body or of one
// STREAMED chunk (§3.4): body or clear_body replace it; ok is false when the
// mutation changes nothing (none, or streamed_response, which is only
// FULL_DUPLEX's).
func Replacement(bm *extprocv3.BodyMutation) (body []byte, ok bool) {
	switch m := bm.GetMutation().(type) {
	case *extprocv3.BodyMutation_Body:
		return m.Body, true
	case *extprocv3.BodyMutation_ClearBody:
		if m.ClearBody {
			return nil, true
		}
	}
	return nil, false
}

// CheckContentLength is ProcessorState::validateContentLength (§3.5). When a
// reply to a BufferedBodyCallback carries a body_mutation while Envoy still
// holds the headers, their Content-Length (first value, as the reply's own
// header mutation left it) must be the size of the mutation's body field, or
// Envoy answers status_on_error even under failure_mode_allow: a mutation
// that changes nothing (streamed_response, clear_body false) counts as an
// empty body, as clear_body does. No mutation, no value, or one that is not
// a number, is not checked.
func CheckContentLength(value string, bm *extprocv3.BodyMutation) error {
	if bm == nil {
		return nil
	}
	cl, err := strconv.ParseUint(value, 10, 64)
	if err != nil || cl == uint64(len(bm.GetBody())) {
		return nil
	}
	return errors.New("mismatch between content length and the length of the mutated body")
}
