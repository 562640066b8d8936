package envoyemu

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestFullDuplexRoutesAndRewrites is the GIE-style happy path on the shipped
// envoy.yaml: what the server sees (§1, §2.6) and what reaches the engine.
func TestFullDuplexRoutesAndRewrites(t *testing.T) {
	up := startUpstream(t)
	seen := make(chan *extprocv3.ProcessingRequest, 1)
	endCode := make(chan codes.Code, 1)
	p := startProxy(t, loadShipped(t, "envoy.yaml"), func(s *procStream) error {
		first := s.next()
		seen <- first
		body, _, ok := readRequestBody(s)
		if !ok {
			return nil
		}
		s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr), rawHeader("content-length", "999")), lbMetadata("envoy.lb", up.addr)))
		rewritten := strings.Replace(string(body), "hello", "HELLO", 1)
		// Split the new body: the number of replies is free (§2.6 rule 4).
		s.reply(requestBodyReply(streamedMutation([]byte(rewritten[:3]), false)))
		s.reply(requestBodyReply(streamedMutation([]byte(rewritten[3:]), true)))
		passResponse(s)
		_, err := s.Recv()
		endCode <- status.Code(err)
		return nil
	})

	res := do(t, p, http.MethodPost, "/v1/completions?x=1", `{"prompt":"hello"}`, map[string]string{"X-Custom": "a"})
	if res.status != http.StatusOK || res.body != `upstream:{"prompt":"HELLO"}` {
		t.Fatalf("response = %d %q", res.status, res.body)
	}
	// §3.5 on the response path too: FULL_DUPLEX drops the engine's length.
	if cl := res.header.Get("Content-Length"); cl != "" {
		t.Errorf("client got Content-Length %s; FULL_DUPLEX responses are chunked", cl)
	}

	first := <-seen
	pc := first.GetProtocolConfig()
	if pc.GetRequestBodyMode() != extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED || pc.GetResponseBodyMode() != extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		t.Errorf("protocol_config = %v", pc)
	}
	hdrs := map[string]string{}
	for _, h := range first.GetRequestHeaders().GetHeaders().GetHeaders() {
		if h.GetValue() != "" {
			t.Errorf("header %q has value %q; Envoy sends raw_value only", h.GetKey(), h.GetValue())
		}
		if h.GetKey() != strings.ToLower(h.GetKey()) {
			t.Errorf("header key %q is not lower-case", h.GetKey())
		}
		hdrs[h.GetKey()] = string(h.GetRawValue())
	}
	for k, want := range map[string]string{":method": "POST", ":path": "/v1/completions?x=1", ":scheme": "http", "x-custom": "a", "content-length": "18"} {
		if hdrs[k] != want {
			t.Errorf("request_headers %s = %q, want %q", k, hdrs[k], want)
		}
	}
	if hdrs[":authority"] == "" || hdrs["x-request-id"] == "" {
		t.Errorf("request_headers lack :authority or x-request-id: %v", hdrs)
	}
	if first.GetRequestHeaders().GetEndOfStream() {
		t.Error("headers end_of_stream = true for a request with a body")
	}

	reqs := up.requests()
	if len(reqs) != 1 {
		t.Fatalf("upstream saw %d requests", len(reqs))
	}
	got := reqs[0]
	// §3.5: FULL_DUPLEX removes Content-Length and drops it from set_headers;
	// the upstream hop is chunked.
	if got.ContentLength != -1 || !slicesContains(got.TransferEncoding, "chunked") {
		t.Errorf("upstream framing: content-length %d, transfer-encoding %v; want chunked", got.ContentLength, got.TransferEncoding)
	}
	if got.Path != "/v1/completions?x=1" || got.Header.Get("X-Gateway-Destination-Endpoint") != up.addr {
		t.Errorf("upstream request = %+v", got)
	}
	if ups := p.Upstreams(); len(ups) != 1 || ups[0] != up.addr {
		t.Errorf("Upstreams() = %v, want [%s]", ups, up.addr)
	}
	// §1: Envoy resets the stream when the exchange is over.
	if c := <-endCode; c != codes.Canceled {
		t.Errorf("server saw the stream end with %v, want Canceled", c)
	}
}

func slicesContains(l []string, s string) bool {
	for _, v := range l {
		if v == s {
			return true
		}
	}
	return false
}

// TestFullDuplexStrictReplies: replies Envoy rejects as spurious or invalid
// end in a 500 local reply and never reach the engine (§2.6, §3.2, §7.3).
func TestFullDuplexStrictReplies(t *testing.T) {
	route := func(addr string) *extprocv3.CommonResponse {
		return setHeaders(rawHeader("x-gateway-destination-endpoint", addr))
	}
	tests := []struct {
		name    string
		script  func(s *procStream, addr string, body []byte)
		details string
	}{
		{
			name: "body reply without streamed_response",
			script: func(s *procStream, addr string, body []byte) {
				s.reply(requestHeadersReply(route(addr), nil))
				s.reply(requestBodyReply(bodyMutation(body)))
			},
			details: "Normal body mutation response",
		},
		{
			name: "empty CommonResponse body reply",
			script: func(s *procStream, addr string, body []byte) {
				s.reply(requestHeadersReply(route(addr), nil))
				s.reply(requestBodyReply(&extprocv3.CommonResponse{}))
			},
			details: "Normal body mutation response",
		},
		{
			name: "body reply before the headers reply",
			script: func(s *procStream, addr string, body []byte) {
				s.reply(requestBodyReply(streamedMutation(body, true)))
				s.reply(requestHeadersReply(route(addr), nil))
			},
			details: "before the headers response",
		},
		{
			name: "body reply after end_of_stream",
			script: func(s *procStream, addr string, body []byte) {
				s.reply(requestHeadersReply(route(addr), nil))
				s.reply(requestBodyReply(streamedMutation(body[:1], true)))
				s.reply(requestBodyReply(streamedMutation(body[1:], true)))
			},
			details: "end_of_stream=true",
		},
		{
			name: "duplicate headers reply",
			script: func(s *procStream, addr string, body []byte) {
				s.reply(requestHeadersReply(route(addr), nil))
				s.reply(requestHeadersReply(route(addr), nil))
			},
			details: "headers response received in state",
		},
		{
			name: "value and raw_value both set",
			script: func(s *procStream, addr string, body []byte) {
				both := rawHeader("x-gateway-destination-endpoint", addr)
				both.Header.Value = addr
				s.reply(requestHeadersReply(setHeaders(both), nil))
			},
			details: "Only one of value or raw_value",
		},
		{
			name: "trailers reply when no trailers were sent",
			script: func(s *procStream, addr string, body []byte) {
				s.reply(requestHeadersReply(route(addr), nil))
				s.reply(requestTrailersReply())
			},
			details: "trailers response received while not waiting",
		},
		{
			name: "message with no oneof",
			script: func(s *procStream, addr string, body []byte) {
				s.reply(&extprocv3.ProcessingResponse{DynamicMetadata: lbMetadata("envoy.lb", addr)})
			},
			details: "unhandled message",
		},
		{
			name: "response headers reply before response headers were sent",
			script: func(s *procStream, addr string, body []byte) {
				s.reply(responseHeadersReply())
			},
			details: "response headers response received in state Idle",
		},
		{
			name: "server ends the stream with an error",
			script: func(s *procStream, addr string, body []byte) {
				// returned by the caller below
			},
			details: "ext_proc_error_gRPC_error_13",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, up := startOnBody(t, func(s *procStream, upstream string, body []byte) error {
				tc.script(s, upstream, body)
				if strings.HasPrefix(tc.name, "server ends") {
					return status.Error(codes.Internal, "boom")
				}
				passResponse(s)
				return nil
			})
			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
			if res.status != http.StatusInternalServerError {
				t.Fatalf("status = %d (%q), want 500", res.status, res.body)
			}
			if d := res.header.Get(DetailsHeader); !strings.Contains(d, tc.details) {
				t.Errorf("details = %q, want it to mention %q", d, tc.details)
			}
			// After an end_of_stream reply the request may already be on its
			// way upstream; otherwise it must never get there.
			if n := len(up.requests()); n != 0 && tc.name != "body reply after end_of_stream" {
				t.Errorf("upstream saw %d requests, want 0", n)
			}
		})
	}
}

// TestFullDuplexCleanCloseLosesUnechoedBody: an OK close means "continue
// unmodified", and in FULL_DUPLEX the chunks already handed to the server
// are gone (§5 FULL_DUPLEX notes). The client's own destination header then
// steers ORIGINAL_DST (§8.1 security note).
func TestFullDuplexCleanCloseLosesUnechoedBody(t *testing.T) {
	up := startUpstream(t)
	p := startProxy(t, loadShipped(t, "envoy.yaml"), func(s *procStream) error {
		s.next()
		readRequestBody(s)
		return nil // OK close before any reply
	})
	res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, map[string]string{"x-gateway-destination-endpoint": up.addr})
	if res.status != http.StatusOK || res.body != "upstream:" {
		t.Fatalf("response = %d %q, want 200 with the body lost", res.status, res.body)
	}
	reqs := up.requests()
	if len(reqs) != 1 || len(reqs[0].Body) != 0 || reqs[0].Header.Get("Content-Length") != "" {
		t.Fatalf("upstream saw %+v, want one request with an empty body and no Content-Length", reqs)
	}
}

// TestFullDuplexTrailersAndBodiless covers §2.1 (headers end_of_stream and
// nothing else) and §2.6 (trailers end the body, body replies before the
// trailers reply use end_of_stream=false).
func TestFullDuplexTrailersAndBodiless(t *testing.T) {
	t.Run("GET without body", func(t *testing.T) {
		up := startUpstream(t)
		next := make(chan string, 1)
		p := startProxy(t, loadShipped(t, "envoy.yaml"), func(s *procStream) error {
			m := s.next()
			if !m.GetRequestHeaders().GetEndOfStream() {
				t.Error("request_headers end_of_stream = false for a GET without body")
			}
			s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil))
			n := s.next()
			if n.GetResponseHeaders() != nil {
				next <- "response_headers"
				s.reply(responseHeadersReply())
				passResponse(s)
			} else {
				next <- fmt.Sprintf("%T", n.GetRequest())
			}
			return nil
		})
		res := do(t, p, http.MethodGet, "/v1/models", "", nil)
		if res.status != http.StatusOK {
			t.Fatalf("status = %d", res.status)
		}
		if got := <-next; got != "response_headers" {
			t.Errorf("message after the bodiless headers = %s, want response_headers", got)
		}
	})
	t.Run("chunked body with trailers", func(t *testing.T) {
		up := startUpstream(t)
		p := startProxy(t, loadShipped(t, "envoy.yaml"), func(s *procStream) error {
			s.next()
			body, tr, ok := readRequestBody(s)
			if !ok || tr == nil {
				t.Errorf("want the body to end with request_trailers, got ok=%v trailers=%v", ok, tr)
				return nil
			}
			s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil))
			s.reply(requestBodyReply(streamedMutation(body, false)))
			s.reply(requestTrailersReply(rawHeader("x-checksum", "rewritten")))
			passResponse(s)
			return nil
		})
		req, _ := http.NewRequest(http.MethodPost, p.URL()+"/v1/completions", chunked(`{"model":"m"}`))
		req.Trailer = http.Header{"X-Checksum": {"original"}}
		res := doReq(t, req)
		if res.status != http.StatusOK || res.body != `upstream:{"model":"m"}` {
			t.Fatalf("response = %d %q", res.status, res.body)
		}
		if reqs := up.requests(); len(reqs) != 1 || reqs[0].Trailer.Get("X-Checksum") != "rewritten" {
			t.Fatalf("upstream trailers = %v, want X-Checksum: rewritten", reqs)
		}
	})
}

// TestFullDuplexStreamsResponse: SSE chunks reach the client one by one while
// the engine is still generating (no buffering anywhere on the path).
func TestFullDuplexStreamsResponse(t *testing.T) {
	release := make(chan struct{})
	up := startUpstreamWith(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: one\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "data: two\n\ndata: [DONE]\n\n")
	})
	p := startProxy(t, loadShipped(t, "envoy.yaml"), fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil, nil))

	resp, err := http.Post(p.URL()+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Errorf("content-type = %q", resp.Header.Get("Content-Type"))
	}
	rd := bufio.NewReader(resp.Body)
	line, err := rd.ReadString('\n')
	if err != nil || line != "data: one\n" {
		t.Fatalf("first event = %q, %v", line, err)
	}
	// The engine sends the rest only now: the first event was not held back.
	close(release)
	rest, _ := io.ReadAll(rd)
	if !strings.Contains(string(rest), "data: two") {
		t.Fatalf("rest = %q", rest)
	}
}

// TestClientDisconnectCancelsStream: a client that goes away cancels the
// ext_proc stream while the server still holds the headers reply.
func TestClientDisconnectCancelsStream(t *testing.T) {
	gotHeaders := make(chan struct{})
	ended := make(chan codes.Code, 1)
	p := startProxy(t, loadShipped(t, "envoy.yaml"), func(s *procStream) error {
		s.next()
		close(gotHeaders)
		for {
			if _, err := s.Recv(); err != nil {
				ended <- status.Code(err)
				return nil
			}
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p.URL()+"/v1/completions", strings.NewReader(`{}`))
	errc := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	<-gotHeaders
	cancel()
	if err := <-errc; err == nil {
		t.Error("client request succeeded, want cancellation")
	}
	if c := <-ended; c != codes.Canceled {
		t.Errorf("server saw %v, want Canceled", c)
	}
}

// TestFullDuplexResponseTrailersAndNoTimer: response trailers go to the
// server (mode SEND) and on to the client; and no message timer runs in a
// FULL_DUPLEX direction, so a slow reply is fine (§5).
func TestFullDuplexResponseTrailersAndNoTimer(t *testing.T) {
	up := startUpstreamWith(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Usage")
		_, _ = io.WriteString(w, "tokens")
		w.Header().Set("X-Usage", "5")
	})
	cfg := loadShipped(t, "envoy.yaml")
	cfg.Failure.MessageTimeout = 10 * time.Millisecond
	sawTrailers := make(chan string, 1)
	p := startProxy(t, cfg, func(s *procStream) error {
		s.next()
		body, _, ok := readRequestBody(s)
		if !ok {
			return nil
		}
		select {
		case <-time.After(200 * time.Millisecond): // 20× message_timeout
		case <-s.Context().Done():
			return nil
		}
		s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil))
		s.reply(requestBodyReply(streamedMutation(body, true)))
		for {
			m := s.next()
			if m == nil {
				return nil
			}
			switch r := m.Request.(type) {
			case *extprocv3.ProcessingRequest_ResponseHeaders:
				s.reply(responseHeadersReply())
			case *extprocv3.ProcessingRequest_ResponseBody:
				s.reply(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
					Response: streamedMutation(r.ResponseBody.GetBody(), false),
				}}})
			case *extprocv3.ProcessingRequest_ResponseTrailers:
				for _, h := range r.ResponseTrailers.GetTrailers().GetHeaders() {
					sawTrailers <- h.GetKey() + "=" + string(h.GetRawValue())
				}
				s.reply(responseTrailersReply(rawHeader("x-usage", "6")))
			}
		}
	})
	res := do(t, p, http.MethodPost, "/v1/completions", `{}`, nil)
	if res.status != http.StatusOK || res.body != "tokens" {
		t.Fatalf("response = %d %q (%s)", res.status, res.body, res.header.Get(DetailsHeader))
	}
	if got := <-sawTrailers; got != "x-usage=5" {
		t.Errorf("server saw trailer %s", got)
	}
	if got := res.trailer.Get("X-Usage"); got != "6" {
		t.Errorf("client trailer X-Usage = %q, want the mutated 6", got)
	}
}

// TestExtProcUnreachable: a stream that cannot open is a gRPC error, a 500
// without failure_mode_allow (§5).
func TestExtProcUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close() // nothing listens there any more
	p, err := Start(loadShipped(t, "envoy.yaml"), addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	res := do(t, p, http.MethodPost, "/v1/completions", `{}`, nil)
	if res.status != http.StatusInternalServerError || !strings.Contains(res.header.Get(DetailsHeader), "ext_proc_error_gRPC_error_14") {
		t.Fatalf("response = %d (%s), want 500 with gRPC Unavailable", res.status, res.header.Get(DetailsHeader))
	}
}

// TestHTTP1BodiesEndWithAnEmptyChunk: Envoy's HTTP/1 codecs hand every body
// over as data with end_stream=false (onBody) and end it with an empty data
// callback with end_stream=true (onMessageCompleteBase: decodeData(buffer,
// true) on an empty buffer, in source/common/http/http1/codec_impl.cc; the
// client codec the same for the response), Content-Length or chunked. In
// FULL_DUPLEX every one is a message: the last body message of each
// direction is empty, and only it has end_of_stream.
func TestHTTP1BodiesEndWithAnEmptyChunk(t *testing.T) {
	up := startUpstreamWith(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "6")
		_, _ = w.Write([]byte("answer"))
	})
	type msg struct {
		body string
		eos  bool
	}
	reqMsgs, respMsgs := make(chan []msg, 1), make(chan []msg, 1)
	p := startProxy(t, loadShipped(t, "envoy.yaml"), func(s *procStream) error {
		s.next() // request_headers
		var got []msg
		for {
			m := s.next()
			if m == nil {
				return nil
			}
			b := m.GetRequestBody()
			got = append(got, msg{string(b.GetBody()), b.GetEndOfStream()})
			if b.GetEndOfStream() {
				break
			}
		}
		reqMsgs <- got
		s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil))
		s.reply(requestBodyReply(streamedMutation([]byte(`{"model":"m"}`), true)))
		got = nil
		for {
			m := s.next()
			if m == nil {
				return nil
			}
			switch r := m.Request.(type) {
			case *extprocv3.ProcessingRequest_ResponseHeaders:
				s.reply(responseHeadersReply())
			case *extprocv3.ProcessingRequest_ResponseBody:
				got = append(got, msg{string(r.ResponseBody.GetBody()), r.ResponseBody.GetEndOfStream()})
				if r.ResponseBody.GetEndOfStream() {
					respMsgs <- got
					s.reply(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
						Response: streamedMutation([]byte("answer"), true),
					}}})
					return nil
				}
			}
		}
	})
	res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
	if res.status != http.StatusOK || res.body != "answer" {
		t.Fatalf("status %d %q", res.status, res.body)
	}
	for dir, ch := range map[string]chan []msg{"request": reqMsgs, "response": respMsgs} {
		got := <-ch
		var body string
		for i, m := range got[:len(got)-1] {
			if m.eos {
				t.Errorf("%s body message %d of %d has end_of_stream", dir, i, len(got))
			}
			body += m.body
		}
		if last := got[len(got)-1]; last.body != "" || !last.eos {
			t.Errorf("%s: last body message %+v, want an empty one with end_of_stream", dir, last)
		}
		if body == "" {
			t.Errorf("%s: no body before the end: %+v", dir, got)
		}
	}
}
