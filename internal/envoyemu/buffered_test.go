package envoyemu

import (
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

func overrideTimeout(d time.Duration) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(d)}
}

// bufferedScript answers the headers at once and the one body message with
// reply(body); the response headers are passed through.
func bufferedScript(t *testing.T, reply func(body []byte) *extprocv3.ProcessingResponse) func(*procStream) error {
	return func(s *procStream) error {
		if s.next().GetRequestHeaders() == nil {
			t.Error("first message is not request_headers")
			return nil
		}
		s.reply(continueHeaders())
		m := s.next()
		if m == nil {
			return nil
		}
		if !m.GetRequestBody().GetEndOfStream() {
			t.Errorf("BUFFERED body message = %v, want one message with end_of_stream", m)
		}
		s.reply(reply(m.GetRequestBody().GetBody()))
		passResponse(s)
		return nil
	}
}

// TestBufferedContentLength is §3.5 for BUFFERED + SEND: Content-Length is
// kept and must match a mutated body, or the client gets a 500.
func TestBufferedContentLength(t *testing.T) {
	const newBody = `{"model":"m","kv_transfer_params":{"remote":1}}`
	tests := []struct {
		name       string
		chunked    bool
		reply      func(addr string) *extprocv3.CommonResponse
		wantStatus int
		wantCL     int64 // upstream ContentLength (-1 = chunked)
	}{
		{
			name: "content-length updated in the body reply",
			reply: func(addr string) *extprocv3.CommonResponse {
				return bodyMutation([]byte(newBody), rawHeader("x-gateway-destination-endpoint", addr), rawHeader("content-length", strconv.Itoa(len(newBody))))
			},
			wantStatus: http.StatusOK, wantCL: int64(len(newBody)),
		},
		{
			name: "stale content-length",
			reply: func(addr string) *extprocv3.CommonResponse {
				return bodyMutation([]byte(newBody), rawHeader("x-gateway-destination-endpoint", addr))
			},
			wantStatus: http.StatusInternalServerError,
		},
		{
			name: "clear_body with a non-zero content-length",
			reply: func(addr string) *extprocv3.CommonResponse {
				cr := setHeaders(rawHeader("x-gateway-destination-endpoint", addr))
				cr.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_ClearBody{ClearBody: true}}
				return cr
			},
			wantStatus: http.StatusInternalServerError,
		},
		// ProcessorState::validateContentLength compares the Content-Length
		// with body_mutation().body().size() whenever has_body_mutation():
		// a body_mutation that changes nothing (streamed_response, or
		// clear_body false) counts as an empty body, and fails the check.
		{
			name: "streamed_response with a non-zero content-length",
			reply: func(addr string) *extprocv3.CommonResponse {
				cr := setHeaders(rawHeader("x-gateway-destination-endpoint", addr))
				cr.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: []byte(newBody), EndOfStream: true}}}
				return cr
			},
			wantStatus: http.StatusInternalServerError,
		},
		{
			name: "clear_body false with a non-zero content-length",
			reply: func(addr string) *extprocv3.CommonResponse {
				cr := setHeaders(rawHeader("x-gateway-destination-endpoint", addr))
				cr.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_ClearBody{ClearBody: false}}
				return cr
			},
			wantStatus: http.StatusInternalServerError,
		},
		{
			name:    "chunked client: nothing to check",
			chunked: true,
			reply: func(addr string) *extprocv3.CommonResponse {
				return bodyMutation([]byte(newBody), rawHeader("x-gateway-destination-endpoint", addr))
			},
			wantStatus: http.StatusOK, wantCL: -1,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := startUpstream(t)
			p := startProxy(t, loadShipped(t, "envoy-buffered.yaml"), bufferedScript(t, func([]byte) *extprocv3.ProcessingResponse {
				return requestBodyReply(tc.reply(up.addr))
			}))
			req, _ := http.NewRequest(http.MethodPost, p.URL()+"/v1/completions", strings.NewReader(`{"model":"m"}`))
			if tc.chunked {
				req.Body = io.NopCloser(chunked(`{"model":"m"}`))
				req.ContentLength = -1
			}
			res := doReq(t, req)
			if res.status != tc.wantStatus {
				t.Fatalf("status = %d %q, want %d", res.status, res.body, tc.wantStatus)
			}
			if tc.wantStatus != http.StatusOK {
				if d := res.header.Get(DetailsHeader); !strings.Contains(d, "mismatch between content length and the length of the mutated body") {
					t.Errorf("details = %q", d)
				}
				if n := len(up.requests()); n != 0 {
					t.Errorf("upstream saw %d requests", n)
				}
				return
			}
			reqs := up.requests()
			if len(reqs) != 1 || string(reqs[0].Body) != newBody || reqs[0].ContentLength != tc.wantCL {
				t.Fatalf("upstream saw %+v, want the new body with content-length %d", reqs, tc.wantCL)
			}
		})
	}
}

// TestMessageTimeout is §5: the per-message timer (504), and
// override_message_timeout honoured once per call within max_message_timeout.
// The waits here are the behaviour under test, not synchronisation.
func TestMessageTimeout(t *testing.T) {
	tests := []struct {
		name          string
		msg, max      time.Duration
		failOpen      bool
		onBody        func(s *procStream, addr string, body []byte)
		wantStatus    int
		minElapsed    time.Duration
		maxElapsed    time.Duration
		wantUpstreamN int
	}{
		{
			name: "no reply to the body", msg: 50 * time.Millisecond,
			onBody:     func(s *procStream, _ string, _ []byte) { <-s.Context().Done() },
			wantStatus: http.StatusGatewayTimeout, minElapsed: 50 * time.Millisecond,
		},
		{
			name: "override extends the timer", msg: 200 * time.Millisecond, max: 10 * time.Second,
			onBody: func(s *procStream, addr string, body []byte) {
				s.reply(overrideTimeout(5 * time.Second))
				select {
				case <-time.After(600 * time.Millisecond): // well past the original 200ms
				case <-s.Context().Done():
					return
				}
				s.reply(requestBodyReply(setHeaders(rawHeader("x-gateway-destination-endpoint", addr))))
			},
			wantStatus: http.StatusOK, minElapsed: 600 * time.Millisecond, wantUpstreamN: 1,
		},
		{
			name: "second override for the same call is ignored", msg: 100 * time.Millisecond, max: 10 * time.Second,
			onBody: func(s *procStream, _ string, _ []byte) {
				s.reply(overrideTimeout(300 * time.Millisecond))
				s.reply(overrideTimeout(10 * time.Second))
				<-s.Context().Done()
			},
			wantStatus: http.StatusGatewayTimeout, minElapsed: 300 * time.Millisecond, maxElapsed: 5 * time.Second,
		},
		{
			name: "override above max_message_timeout is ignored", msg: 100 * time.Millisecond, max: time.Second,
			onBody: func(s *procStream, _ string, _ []byte) {
				s.reply(overrideTimeout(30 * time.Second))
				<-s.Context().Done()
			},
			wantStatus: http.StatusGatewayTimeout, minElapsed: 100 * time.Millisecond, maxElapsed: 5 * time.Second,
		},
		{
			name: "failure_mode_allow continues unmodified", msg: 50 * time.Millisecond, failOpen: true,
			onBody:     func(s *procStream, _ string, _ []byte) { <-s.Context().Done() },
			wantStatus: http.StatusOK, wantUpstreamN: 1,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := startUpstream(t)
			cfg := loadShipped(t, "envoy-buffered.yaml")
			cfg.Failure.MessageTimeout, cfg.Failure.MaxMessageTimeout, cfg.Failure.FailureModeAllow = tc.msg, tc.max, tc.failOpen
			p := startProxy(t, cfg, func(s *procStream) error {
				s.next()
				s.reply(continueHeaders())
				m := s.next()
				if m == nil {
					return nil
				}
				tc.onBody(s, up.addr, m.GetRequestBody().GetBody())
				passResponse(s)
				return nil
			})
			start := time.Now()
			// The client's own header only matters when ext_proc fails open.
			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, map[string]string{"x-gateway-destination-endpoint": up.addr})
			elapsed := time.Since(start)
			if res.status != tc.wantStatus {
				t.Fatalf("status = %d %q (%s), want %d", res.status, res.body, res.header.Get(DetailsHeader), tc.wantStatus)
			}
			if tc.wantStatus == http.StatusGatewayTimeout && res.header.Get(DetailsHeader) != "ext_proc_error_per-message_timeout_exceeded" {
				t.Errorf("details = %q", res.header.Get(DetailsHeader))
			}
			if elapsed < tc.minElapsed || (tc.maxElapsed > 0 && elapsed > tc.maxElapsed) {
				t.Errorf("took %v, want within [%v, %v]", elapsed, tc.minElapsed, tc.maxElapsed)
			}
			if n := len(up.requests()); n != tc.wantUpstreamN {
				t.Errorf("upstream saw %d requests, want %d", n, tc.wantUpstreamN)
			}
		})
	}
}

// TestBufferedOverLimit: a BUFFERED body over the buffer limit gets Envoy's
// own 413 (§2.3).
func TestBufferedOverLimit(t *testing.T) {
	cfg := loadShipped(t, "envoy-buffered.yaml")
	cfg.Limits.BufferLimitBytes = 1024
	p := startProxy(t, cfg, func(s *procStream) error {
		s.next()
		s.reply(continueHeaders())
		for s.next() != nil {
		}
		return nil
	})
	res := do(t, p, http.MethodPost, "/v1/completions", strings.Repeat("x", 4096), nil)
	if res.status != http.StatusRequestEntityTooLarge || res.body != "Payload Too Large" {
		t.Fatalf("response = %d %q, want 413", res.status, res.body)
	}
}

// TestFailOpen: with failure_mode_allow, a broken or
// misbehaving server lets the request through unmodified (§5) — and the
// client's own destination header then picks the upstream (§8.1).
func TestFailOpen(t *testing.T) {
	tests := []struct {
		name   string
		script func(s *procStream) error
	}{
		{"stream error", func(s *procStream) error {
			s.next()
			return status.Error(codes.Unavailable, "down")
		}},
		{"spurious reply", func(s *procStream) error {
			s.next()
			s.reply(requestBodyReply(&extprocv3.CommonResponse{})) // before the headers reply
			<-s.Context().Done()
			return nil
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := startUpstream(t)
			cfg := loadShipped(t, "envoy-buffered.yaml")
			cfg.Failure.FailureModeAllow = true
			p := startProxy(t, cfg, tc.script)
			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, map[string]string{"x-gateway-destination-endpoint": up.addr})
			if res.status != http.StatusOK || res.body != `upstream:{"model":"m"}` {
				t.Fatalf("response = %d %q", res.status, res.body)
			}
		})
	}
	// FULL_DUPLEX_STREAMED fails open until the first body chunk went to the
	// server (envoy#41276; the config check that refused failure_mode_allow
	// with it, envoy#39740, was reverted by envoy#40503), and closed after.
	t.Run("FULL_DUPLEX, no body sent", func(t *testing.T) {
		up := startUpstream(t)
		cfg := loadShipped(t, "envoy.yaml")
		cfg.Failure.FailureModeAllow = true
		p := startProxy(t, cfg, tests[0].script)
		res := do(t, p, http.MethodGet, "/v1/models", "", map[string]string{"x-gateway-destination-endpoint": up.addr})
		if res.status != http.StatusOK || len(up.requests()) != 1 {
			t.Fatalf("response = %d %q, upstream saw %d requests; want 200 from it", res.status, res.body, len(up.requests()))
		}
	})
	t.Run("FULL_DUPLEX, once a body chunk went", func(t *testing.T) {
		up := startUpstream(t)
		cfg := loadShipped(t, "envoy.yaml")
		cfg.Failure.FailureModeAllow = true
		p := startProxy(t, cfg, func(s *procStream) error {
			for m := s.next(); m != nil && m.GetRequestBody() == nil; m = s.next() {
			}
			return status.Error(codes.Unavailable, "down")
		})
		res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, map[string]string{"x-gateway-destination-endpoint": up.addr})
		if res.status != http.StatusInternalServerError || len(up.requests()) != 0 {
			t.Fatalf("response = %d %q, upstream saw %d requests; want 500 and none", res.status, res.body, len(up.requests()))
		}
	})
	t.Run("without failure_mode_allow", func(t *testing.T) {
		p := startProxy(t, loadShipped(t, "envoy-buffered.yaml"), tests[0].script)
		if res := do(t, p, http.MethodPost, "/v1/completions", `{}`, nil); res.status != http.StatusInternalServerError {
			t.Fatalf("status = %d, want 500", res.status)
		}
	})
}

// TestContinueAndReplace is §3.1: the body is replaced from the headers
// reply, Content-Length goes, and no body message follows.
func TestContinueAndReplace(t *testing.T) {
	up := startUpstream(t)
	next := make(chan string, 1)
	p := startProxy(t, loadShipped(t, "envoy-buffered.yaml"), func(s *procStream) error {
		s.next()
		cr := bodyMutation([]byte("replaced"), rawHeader("x-gateway-destination-endpoint", up.addr))
		cr.Status = extprocv3.CommonResponse_CONTINUE_AND_REPLACE
		s.reply(requestHeadersReply(cr, nil))
		m := s.next()
		if m.GetResponseHeaders() == nil {
			next <- m.String()
			return nil
		}
		next <- "response_headers"
		s.reply(responseHeadersReply())
		passResponse(s)
		return nil
	})
	res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
	if res.status != http.StatusOK || res.body != "upstream:replaced" {
		t.Fatalf("response = %d %q", res.status, res.body)
	}
	if got := <-next; got != "response_headers" {
		t.Errorf("after CONTINUE_AND_REPLACE the server got %s, want response_headers", got)
	}
	if reqs := up.requests(); len(reqs) != 1 || reqs[0].ContentLength != -1 {
		t.Errorf("upstream = %+v, want a chunked request", reqs)
	}
}

// TestBufferedResponseBody runs the §3.5 check on the response path: a
// mutated response body needs a matching content-length.
func TestBufferedResponseBody(t *testing.T) {
	for _, fixLength := range []bool{true, false} {
		t.Run("content-length fixed="+strconv.FormatBool(fixLength), func(t *testing.T) {
			up := startUpstream(t)
			cfg := loadShipped(t, "envoy-buffered.yaml")
			cfg.Modes.Response.Body = extprocfilterv3.ProcessingMode_BUFFERED
			p := startProxy(t, cfg, func(s *procStream) error {
				s.next()
				s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil))
				s.next()
				s.reply(requestBodyReply(&extprocv3.CommonResponse{}))
				if s.next().GetResponseHeaders() == nil {
					t.Error("want response_headers")
				}
				s.reply(responseHeadersReply())
				m := s.next()
				if got := string(m.GetResponseBody().GetBody()); got != "upstream:hi" || !m.GetResponseBody().GetEndOfStream() {
					t.Errorf("response body message = %v", m)
				}
				var hs []*corev3.HeaderValueOption
				if fixLength {
					hs = append(hs, rawHeader("content-length", "3"))
				}
				s.reply(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
					Response: bodyMutation([]byte("new"), hs...),
				}}})
				<-s.Context().Done()
				return nil
			})
			res := do(t, p, http.MethodPost, "/v1/completions", "hi", nil)
			switch {
			case fixLength && (res.status != http.StatusOK || res.body != "new"):
				t.Fatalf("response = %d %q, want 200 new", res.status, res.body)
			case !fixLength && res.status != http.StatusInternalServerError:
				t.Fatalf("response = %d %q, want 500", res.status, res.body)
			}
		})
	}
}

// TestBufferedHeadersSkipped is §3.5 case 3: BUFFERED with the headers not
// sent continues the headers at once (routing included) without their
// Content-Length, so a body of another length goes out chunked.
func TestBufferedHeadersSkipped(t *testing.T) {
	up := startUpstream(t)
	cfg := loadShipped(t, "envoy-buffered.yaml")
	cfg.Modes.Request.Headers = extprocfilterv3.ProcessingMode_SKIP
	p := startProxy(t, cfg, func(s *procStream) error {
		m := s.next()
		if m.GetRequestBody() == nil || m.GetProtocolConfig() == nil {
			t.Errorf("first message = %v, want request_body with protocol_config", m)
			return nil
		}
		s.reply(requestBodyReply(bodyMutation([]byte("a longer body"))))
		passResponse(s)
		return nil
	})
	res := do(t, p, http.MethodPost, "/v1/completions", "short", map[string]string{"x-gateway-destination-endpoint": up.addr})
	if res.status != http.StatusOK || res.body != "upstream:a longer body" {
		t.Fatalf("response = %d %q (%s)", res.status, res.body, res.header.Get(DetailsHeader))
	}
	if reqs := up.requests(); len(reqs) != 1 || reqs[0].ContentLength != -1 {
		t.Errorf("upstream = %+v, want chunked", reqs)
	}
}

// TestTheLastResponseHeadersReplyEndsTheStream is
// closeGrpcStreamIfLastRespReceived (ext_proc.cc): with the response's body
// and trailers not sent (envoy-buffered.yaml), the response-headers reply
// is the stream's last, and Envoy ends the stream there, while the response
// body still streams to the client.
func TestTheLastResponseHeadersReplyEndsTheStream(t *testing.T) {
	release := make(chan struct{})
	up := startUpstreamWith(t, func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-release // the generation goes on
		_, _ = io.WriteString(w, "done")
	})
	ended := make(chan struct{})
	p := startProxy(t, loadShipped(t, "envoy-buffered.yaml"), func(s *procStream) error {
		s.next()
		s.reply(continueHeaders())
		s.next()
		s.reply(requestBodyReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr))))
		if m := s.next(); m.GetResponseHeaders() == nil {
			t.Errorf("message = %v, want response_headers", m)
		}
		s.reply(responseHeadersReply())
		if m := s.next(); m != nil {
			t.Errorf("message %v after the last reply", m)
		}
		close(ended)
		return nil
	})
	done := make(chan result, 1)
	go func() { done <- do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil) }()
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Error("the stream is still open while the response streams")
	}
	close(release)
	if res := <-done; res.status != http.StatusOK || res.body != "done" {
		t.Errorf("response = %d %q", res.status, res.body)
	}
}
