package rules

import (
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
)

const (
	req  = envoymsg.Request
	resp = envoymsg.Response
)

// step is one event of a sequence: Envoy sends msg (and the model says fit),
// or the server sends reply (and the model says want, with why in its Reason
// or in one of its Dropped parts).
type step struct {
	msg   *extprocv3.ProcessingRequest
	fit   Fit
	reply *extprocv3.ProcessingResponse
	want  Outcome
	why   string
}

func send(m *extprocv3.ProcessingRequest) step { return step{msg: m} }

func sendFit(m *extprocv3.ProcessingRequest, f Fit) step { return step{msg: m, fit: f} }

func answer(r *extprocv3.ProcessingResponse, want Outcome, why string) step {
	return step{reply: r, want: want, why: why}
}

func ok(r *extprocv3.ProcessingResponse) step { return answer(r, Accepted, "") }

func headersReply(d envoymsg.Direction, cr *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	hr := &extprocv3.HeadersResponse{Response: cr}
	if d == resp {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: hr}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: hr}}
}

func bodyReply(d envoymsg.Direction, cr *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: cr}
	if d == resp {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
}

func trailersReply(d envoymsg.Direction) *extprocv3.ProcessingResponse {
	if d == resp {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
}

func streamed(b string, eos bool) *extprocv3.CommonResponse {
	return &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: []byte(b), EndOfStream: eos},
	}}}
}

func newBody(b string) *extprocv3.CommonResponse {
	return &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte(b)}}}
}

func withHeader(cr *extprocv3.CommonResponse) *extprocv3.CommonResponse {
	cr.HeaderMutation = &extprocv3.HeaderMutation{RemoveHeaders: []string{"x-a"}}
	return cr
}

func replace(cr *extprocv3.CommonResponse) *extprocv3.CommonResponse {
	cr.Status = extprocv3.CommonResponse_CONTINUE_AND_REPLACE
	return cr
}

func override(d time.Duration) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(d)}
}

func immediate() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{}}}
}

func TestReplySequences(t *testing.T) {
	const (
		fd       = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
		buffered = filterv3.ProcessingMode_BUFFERED
		partial  = filterv3.ProcessingMode_BUFFERED_PARTIAL
		streamd  = filterv3.ProcessingMode_STREAMED
		none     = filterv3.ProcessingMode_NONE
	)
	hdrs := func(d envoymsg.Direction, eos bool) *extprocv3.ProcessingRequest { return envoymsg.Headers(d, eos) }
	body := func(d envoymsg.Direction, eos bool) *extprocv3.ProcessingRequest {
		return envoymsg.Body(d, []byte("b"), eos)
	}
	empty := &extprocv3.CommonResponse{}
	tests := []struct {
		name       string
		reqMode    filterv3.ProcessingMode_BodySendMode
		respMode   filterv3.ProcessingMode_BodySendMode
		noOverride bool // max_message_timeout 0
		noImmed    bool // disable_immediate_response
		steps      []step
		owed       []string
	}{
		{name: "FULL_DUPLEX: headers reply, then streamed body replies", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, false)), send(body(req, true)),
			ok(headersReply(req, empty)), ok(bodyReply(req, streamed("x", false))), ok(bodyReply(req, streamed("y", true))),
		}},
		{name: "FULL_DUPLEX: a body reply before the headers reply", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, true)),
			answer(bodyReply(req, streamed("x", true)), Spurious, "before the headers response"),
			answer(headersReply(req, empty), Ignored, "a late reply"),
		}},
		{name: "FULL_DUPLEX: a body mutation that is not streamed_response", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, true)), ok(headersReply(req, empty)),
			answer(bodyReply(req, newBody("x")), Spurious, "Normal body mutation response"),
		}},
		{name: "FULL_DUPLEX: an empty CommonResponse body reply", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, true)), ok(headersReply(req, empty)),
			answer(bodyReply(req, empty), Spurious, "Normal body mutation response"),
		}},
		{name: "FULL_DUPLEX: a body reply after end_of_stream", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, true)), ok(headersReply(req, empty)),
			ok(bodyReply(req, streamed("x", true))),
			answer(bodyReply(req, streamed("y", true)), Spurious, "end_of_stream=true"),
		}},
		{name: "FULL_DUPLEX: headers answered twice", reqMode: fd, steps: []step{
			send(hdrs(req, false)), ok(headersReply(req, empty)),
			answer(headersReply(req, empty), Spurious, "request headers response received in state Idle"),
		}},
		{name: "FULL_DUPLEX: a body reply to headers that ended the stream", reqMode: fd, steps: []step{
			send(hdrs(req, true)), ok(headersReply(req, empty)),
			answer(bodyReply(req, streamed("", true)), Spurious, "in state Idle"),
		}},
		{name: "FULL_DUPLEX: trailers, and their reply after the body's end", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, false)), send(envoymsg.Trailers(req)),
			ok(headersReply(req, empty)), ok(bodyReply(req, streamed("x", true))), ok(trailersReply(req)),
			answer(bodyReply(req, streamed("y", false)), Spurious, "in state Idle"),
		}},
		// getCallbackStateAfterHeaderResp: a headers reply before any body
		// chunk leaves the direction Idle (trailers due: TrailersCallback);
		// the next chunk sent opens it to body replies.
		{name: "FULL_DUPLEX: a body reply when trailers came and no body", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(envoymsg.Trailers(req)), ok(headersReply(req, empty)),
			answer(bodyReply(req, streamed("", true)), Spurious, "in state TrailersCallback"),
		}},
		{name: "FULL_DUPLEX: a body reply before the first chunk was sent", reqMode: fd, steps: []step{
			send(hdrs(req, false)), ok(headersReply(req, empty)),
			answer(bodyReply(req, streamed("x", false)), Spurious, "in state Idle"),
		}},
		{name: "FULL_DUPLEX: the first chunk after the headers reply opens body replies", reqMode: fd, steps: []step{
			send(hdrs(req, false)), ok(headersReply(req, empty)), send(body(req, true)),
			ok(bodyReply(req, streamed("x", true))),
		}},
		{name: "FULL_DUPLEX: the trailers reply before the headers reply", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(envoymsg.Trailers(req)),
			answer(trailersReply(req), Spurious, "trailers response received while not waiting for it"),
		}},
		{name: "FULL_DUPLEX: a trailers reply with no trailers sent", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, true)), ok(headersReply(req, empty)),
			answer(trailersReply(req), Spurious, "trailers response received while not waiting for it"),
		}},
		{name: "FULL_DUPLEX: a header mutation in a body reply is dropped", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, true)), ok(headersReply(req, empty)),
			answer(bodyReply(req, withHeader(streamed("x", true))), Accepted, "too late (§2.11)"),
		}},
		{name: "FULL_DUPLEX: the body's end twice is envoy#46237's repeat", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, true)), sendFit(body(req, true), Repeat),
		}, owed: []string{"request: the headers reply never came"}},
		{name: "FULL_DUPLEX: owed at the end", reqMode: fd, respMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, true)), ok(headersReply(req, empty)),
			send(hdrs(resp, true)),
		}, owed: []string{"request: the body ended but no end_of_stream reply came", "response: the headers reply never came"}},
		{name: "FULL_DUPLEX: a headers reply is not owed while the body is still coming", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, false)),
		}},
		{name: "BUFFERED: one reply per message, in order", reqMode: buffered, respMode: buffered, steps: []step{
			send(hdrs(req, false)), ok(headersReply(req, empty)), send(body(req, true)), ok(bodyReply(req, newBody("n"))),
			send(hdrs(resp, false)), ok(headersReply(resp, empty)), send(body(resp, true)), ok(bodyReply(resp, nil)),
			answer(bodyReply(resp, nil), Spurious, "response body response received while no body call is pending (state Idle)"),
		}},
		{name: "BUFFERED: messages sent ahead are answered in order", reqMode: buffered, steps: []step{
			send(hdrs(req, false)), send(body(req, false)), send(envoymsg.Trailers(req)),
			answer(bodyReply(req, nil), Spurious, "before the headers response"),
		}},
		{name: "BUFFERED: trailers after the body reply", reqMode: buffered, steps: []step{
			send(hdrs(req, false)), send(body(req, false)), send(envoymsg.Trailers(req)),
			ok(headersReply(req, empty)), ok(bodyReply(req, nil)), ok(trailersReply(req)),
		}},
		{name: "BUFFERED: a streamed_response is a no-op", reqMode: buffered, steps: []step{
			send(hdrs(req, false)), ok(headersReply(req, empty)), send(body(req, true)),
			answer(bodyReply(req, streamed("x", true)), Accepted, "no-op (§3.4)"),
		}},
		{name: "BUFFERED: a second body message leaves the model", reqMode: buffered, steps: []step{
			send(hdrs(req, false)), send(body(req, false)), sendFit(body(req, true), Unexpected),
			answer(bodyReply(req, nil), Unjudged, "a body Envoy would not send"),
		}},
		{name: "BUFFERED: owed at the end", reqMode: buffered, steps: []step{
			send(hdrs(req, false)), ok(headersReply(req, empty)), send(body(req, true)),
		}, owed: []string{"request: 1 message(s) never answered"}},
		{name: "BUFFERED_PARTIAL: one message, one reply", reqMode: partial, steps: []step{
			send(hdrs(req, false)), ok(headersReply(req, empty)), send(body(req, false)), ok(bodyReply(req, newBody("n"))),
			sendFit(body(req, true), Unexpected),
		}},
		{name: "STREAMED: one reply per chunk; streamed_response is spurious", reqMode: streamd, steps: []step{
			send(hdrs(req, false)), ok(headersReply(req, empty)), send(body(req, false)), send(body(req, true)),
			answer(bodyReply(req, withHeader(newBody("x"))), Accepted, "the headers already went on (§2.4)"),
			answer(bodyReply(req, streamed("y", true)), Spurious, "streamed_response received while body_mode_ is STREAMED"),
		}},
		{name: "NONE: a body message leaves the model", reqMode: none, steps: []step{
			send(hdrs(req, false)), sendFit(body(req, true), Unexpected),
			answer(headersReply(req, empty), Unjudged, "request is off the model"),
		}},
		{name: "trailers before the headers leave the model", reqMode: fd, steps: []step{
			send(hdrs(req, false)), sendFit(envoymsg.Trailers(resp), Unexpected),
			answer(trailersReply(resp), Unjudged, "trailers Envoy would not send"),
			ok(headersReply(req, empty)),
		}},
		{name: "NONE: trailers after the headers", reqMode: none, steps: []step{
			send(hdrs(req, false)), send(envoymsg.Trailers(req)), ok(headersReply(req, empty)), ok(trailersReply(req)),
		}},
		{name: "CONTINUE_AND_REPLACE ends the body", reqMode: buffered, steps: []step{
			send(hdrs(req, false)), ok(headersReply(req, replace(newBody("n")))),
			sendFit(body(req, true), Unexpected),
		}},
		{name: "CONTINUE_AND_REPLACE: no body reply is due", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(body(req, false)), ok(headersReply(req, replace(newBody("n")))),
			answer(bodyReply(req, streamed("x", true)), Spurious, "no body call is pending"),
		}},
		{name: "a body mutation in a CONTINUE headers reply is dropped", reqMode: buffered, steps: []step{
			send(hdrs(req, false)), answer(headersReply(req, newBody("n")), Accepted, "without CONTINUE_AND_REPLACE (§3.4)"),
		}},
		{name: "headers twice leave the model", reqMode: fd, steps: []step{
			send(hdrs(req, false)), sendFit(hdrs(req, false), Unexpected),
			answer(bodyReply(req, nil), Unjudged, "headers sent twice"),
		}},
		{name: "a later protocol_config with other modes leaves the model", reqMode: fd, steps: []step{
			send(hdrs(req, false)), sendFit(envoymsg.WithModes(body(req, false), buffered, fd), Unexpected),
			answer(headersReply(req, empty), Unjudged, "a later protocol_config"),
			answer(headersReply(resp, empty), Unjudged, "a later protocol_config"),
		}},
		{name: "a later protocol_config with the same modes is fine", reqMode: fd, steps: []step{
			send(hdrs(req, false)), send(envoymsg.WithModes(body(req, true), fd, none)), ok(headersReply(req, empty)),
		}, owed: []string{"request: the body ended but no end_of_stream reply came"}},
		{name: "override_message_timeout: once per call, only a running timer", reqMode: buffered, respMode: fd, steps: []step{
			send(hdrs(req, false)), ok(override(time.Second)),
			answer(override(time.Second), Ignored, "no running timer or already overridden"),
			ok(headersReply(req, empty)),
			answer(override(time.Second), Ignored, "no running timer"),
			send(body(req, true)), ok(override(time.Second)), ok(bodyReply(req, nil)),
			send(hdrs(resp, false)),
			answer(override(time.Second), Ignored, "no running timer"), // FULL_DUPLEX has none
		}},
		{name: "override_message_timeout: within [1ms, max_message_timeout]", reqMode: buffered, steps: []step{
			send(hdrs(req, false)),
			answer(override(time.Microsecond), Ignored, "ignored (max_message_timeout 1m0s)"),
			answer(override(2*time.Minute), Ignored, "ignored (max_message_timeout 1m0s)"),
			ok(override(time.Minute)),
		}, owed: []string{"request: 1 message(s) never answered"}},
		{name: "override_message_timeout: disabled by max_message_timeout 0", reqMode: buffered, noOverride: true, steps: []step{
			send(hdrs(req, false)), answer(override(time.Second), Ignored, "max_message_timeout 0s"),
		}, owed: []string{"request: 1 message(s) never answered"}},
		{name: "override_message_timeout: handled alone", reqMode: buffered, steps: []step{
			send(hdrs(req, false)),
			answer(&extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(time.Second),
				Response: headersReply(req, empty).GetResponse()}, Accepted, "handled alone (§5)"),
		}, owed: []string{"request: 1 message(s) never answered"}},
		{name: "an ImmediateResponse ends the stream", reqMode: fd, steps: []step{
			send(hdrs(req, false)), ok(immediate()),
			answer(headersReply(req, empty), Ignored, "a late reply, after an ImmediateResponse"),
		}},
		{name: "an ImmediateResponse under disable_immediate_response", reqMode: fd, noImmed: true, steps: []step{
			send(hdrs(req, false)), answer(immediate(), Spurious, "disable_immediate_response"),
		}},
		{name: "a reply with no oneof", reqMode: fd, steps: []step{
			send(hdrs(req, false)), answer(&extprocv3.ProcessingResponse{}, Spurious, "unhandled message"),
		}},
		{name: "a response headers reply before the response headers", reqMode: fd, steps: []step{
			send(hdrs(req, false)), answer(headersReply(resp, empty), Spurious, "response headers response received in state Idle"),
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{RequestMode: tc.reqMode, ResponseMode: tc.respMode, MaxMessageTimeout: time.Minute, DisableImmediateResponse: tc.noImmed}
			if tc.noOverride {
				cfg.MaxMessageTimeout = 0
			}
			s := NewStream(cfg)
			for i, st := range tc.steps {
				if st.msg != nil {
					if i == 0 {
						st.msg = envoymsg.WithModes(st.msg, tc.reqMode, tc.respMode)
					}
					if got := s.Sent(st.msg); got != st.fit {
						t.Fatalf("step %d: message %v fits %v, want %v", i, st.msg, got, st.fit)
					}
					continue
				}
				v := s.Reply(st.reply)
				if v.Outcome != st.want || !mentions(v, st.why) {
					t.Fatalf("step %d: reply %v is %v (%q, dropped %q), want %v mentioning %q", i, st.reply, v.Outcome, v.Reason, v.Dropped, st.want, st.why)
				}
			}
			owed := s.Owed()
			if len(owed) != len(tc.owed) {
				t.Fatalf("owed %q, want %q", owed, tc.owed)
			}
			for i, want := range tc.owed {
				if !strings.Contains(owed[i], want) {
					t.Errorf("owed[%d] = %q, want it to mention %q", i, owed[i], want)
				}
			}
		})
	}
}

// mentions: a reply expected with no reason must have none, and nothing
// dropped; otherwise why is in its reason or one of its dropped parts.
func mentions(v Verdict, why string) bool {
	if why == "" {
		return v.Reason == "" && len(v.Dropped) == 0
	}
	if strings.Contains(v.Reason, why) {
		return true
	}
	for _, d := range v.Dropped {
		if strings.Contains(d, why) {
			return true
		}
	}
	return false
}

// TestCallbacksTheCallerChooses covers what only the caller knows: headers
// passed on unseen (SKIP), and a STREAMED body complete before the headers
// reply, answered as a buffered body (§2.9).
func TestCallbacksTheCallerChooses(t *testing.T) {
	t.Run("FULL_DUPLEX with headers skipped takes body replies once a chunk went", func(t *testing.T) {
		s := NewStream(Config{RequestMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED})
		s.Request.SkipHeaders(false)
		if st := s.Request.State(); st != Idle {
			t.Fatalf("state before any chunk %v, want Idle", st)
		}
		s.Request.Body(true)
		if v := s.Reply(bodyReply(req, streamed("x", true))); v.Outcome != Accepted {
			t.Fatalf("body reply: %v (%s), want accepted", v.Outcome, v.Reason)
		}
		if !s.Request.Settled() {
			t.Error("after the end_of_stream reply the request still waits")
		}
	})
	t.Run("STREAMED whole body", func(t *testing.T) {
		s := NewStream(Config{RequestMode: filterv3.ProcessingMode_STREAMED})
		s.Request.Headers(false)
		s.Reply(headersReply(req, &extprocv3.CommonResponse{}))
		s.Request.WholeBody(true)
		if st := s.Request.State(); st != BufferedBodyCallback {
			t.Fatalf("state %v, want BufferedBodyCallback", st)
		}
		v := s.Reply(bodyReply(req, withHeader(streamed("x", true))))
		if v.Outcome != Accepted || v.Answered != BufferedBodyCallback || len(v.Dropped) != 1 {
			t.Fatalf("body reply: %+v, want accepted as a buffered body, its streamed_response a no-op", v)
		}
	})
}

func TestOverrideRestartsEachRunningTimer(t *testing.T) {
	s := NewStream(Config{RequestMode: filterv3.ProcessingMode_BUFFERED, ResponseMode: filterv3.ProcessingMode_BUFFERED, MaxMessageTimeout: time.Minute})
	s.Request.Headers(false)
	s.Response.Headers(false)
	v := s.Reply(override(time.Second))
	if v.Outcome != Accepted || len(v.Restarted) != 2 || v.Restarted[0] != s.Request || v.Restarted[1] != s.Response {
		t.Fatalf("override: %+v, want both timers restarted", v)
	}
}

func TestCheckContentLength(t *testing.T) {
	body := func(b string) *extprocv3.BodyMutation {
		return &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte(b)}}
	}
	clear := func(c bool) *extprocv3.BodyMutation {
		return &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_ClearBody{ClearBody: c}}
	}
	streamed := &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: []byte("abc")}}}
	for _, tt := range []struct {
		value string
		bm    *extprocv3.BodyMutation
		bad   bool
	}{
		{"5", body("12345"), false},
		{"5", body("123456"), true},
		{"0", body(""), false},
		{"", body("abc"), false},    // none
		{"abc", body("abc"), false}, // not a number: not checked
		{"-1", body("abc"), false},
		{"3", nil, false}, // no body_mutation: not checked
		{"3", clear(true), true},
		{"0", clear(true), false},
		// validateContentLength reads body_mutation().body() whatever the
		// mutation: one that changes nothing counts as empty.
		{"3", clear(false), true},
		{"3", streamed, true},
		{"0", streamed, false},
	} {
		if err := CheckContentLength(tt.value, tt.bm); (err != nil) != tt.bad {
			t.Errorf("CheckContentLength(%q, %v) = %v, want an error %v", tt.value, tt.bm, err, tt.bad)
		}
	}
}

func TestReplacement(t *testing.T) {
	if b, ok := Replacement(newBody("n").GetBodyMutation()); !ok || string(b) != "n" {
		t.Errorf("body: %q %v", b, ok)
	}
	if b, ok := Replacement(&extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_ClearBody{ClearBody: true}}); !ok || b != nil {
		t.Errorf("clear_body: %q %v", b, ok)
	}
	if _, ok := Replacement(streamed("x", true).GetBodyMutation()); ok {
		t.Error("streamed_response replaces a buffered body")
	}
	if _, ok := Replacement(nil); ok {
		t.Error("no mutation replaces the body")
	}
}
