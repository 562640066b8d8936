package envoyemu

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

func streamedConfig(t *testing.T, mode extprocfilterv3.ProcessingMode_BodySendMode) *Config {
	cfg := loadShipped(t, "envoy-buffered.yaml")
	cfg.Modes.Request.Body = mode
	return cfg
}

// TestBodyCompleteBeforeHeadersReply is §2.9: in STREAMED, a body that is
// complete when the headers reply arrives goes as one message, answered as
// a buffered body: its header mutations still apply (the headers are held).
func TestBodyCompleteBeforeHeadersReply(t *testing.T) {
	up := startUpstream(t)
	bodyDone := make(chan struct{})
	var once sync.Once
	p := startProxy(t, streamedConfig(t, extprocfilterv3.ProcessingMode_STREAMED), func(s *procStream) error {
		s.next()
		<-bodyDone
		s.reply(continueHeaders())
		m := s.next()
		if got := m.GetRequestBody(); string(got.GetBody()) != `{"model":"m"}` || !got.GetEndOfStream() {
			t.Errorf("body message = %v, want the whole body with end_of_stream", m)
		}
		// The routing header comes only now: it must still apply.
		s.reply(requestBodyReply(bodyMutation([]byte("new"), rawHeader("x-gateway-destination-endpoint", up.addr))))
		passResponse(s)
		return nil
	})
	p.hooks.clientBodyDone = func() { once.Do(func() { close(bodyDone) }) }
	res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
	if res.status != http.StatusOK || res.body != "upstream:new" {
		t.Fatalf("response = %d %q (%s)", res.status, res.body, res.header.Get(DetailsHeader))
	}
	// STREAMED removes Content-Length (§3.5), so no length check and chunked.
	if reqs := up.requests(); len(reqs) != 1 || reqs[0].ContentLength != -1 {
		t.Errorf("upstream = %+v, want one chunked request", reqs)
	}
}

// TestStreamedChunks is §2.4: one message per chunk, one reply per chunk in
// order, each reply replacing only its chunk; streamed_response is spurious.
func TestStreamedChunks(t *testing.T) {
	t.Run("FIFO replies", func(t *testing.T) {
		up := startUpstream(t)
		got := make(chan string)
		p := startProxy(t, streamedConfig(t, extprocfilterv3.ProcessingMode_STREAMED), func(s *procStream) error {
			s.next()
			s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil))
			for {
				m := s.next()
				if m == nil {
					return nil
				}
				b := m.GetRequestBody()
				s.reply(requestBodyReply(bodyMutation(bytes.ToUpper(b.GetBody()))))
				got <- string(b.GetBody())
				if b.GetEndOfStream() {
					passResponse(s)
					return nil
				}
			}
		})
		pw, resc := streamedPost(p.URL() + "/v1/completions")
		for _, chunk := range []string{"ab", "cd"} {
			_, _ = pw.Write([]byte(chunk))
			if g := <-got; g != chunk {
				t.Errorf("server got chunk %q, want %q", g, chunk)
			}
		}
		_ = pw.Close()
		if g := <-got; g != "" {
			t.Errorf("last chunk = %q, want the empty end-of-stream chunk", g)
		}
		if res := <-resc; res.err != nil || res.status != http.StatusOK || res.body != "upstream:ABCD" {
			t.Fatalf("response = %d %q (%v)", res.status, res.body, res.err)
		}
	})
	t.Run("streamed_response is spurious", func(t *testing.T) {
		up := startUpstream(t)
		p := startProxy(t, streamedConfig(t, extprocfilterv3.ProcessingMode_STREAMED), func(s *procStream) error {
			s.next()
			s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil))
			m := s.next()
			s.reply(requestBodyReply(streamedMutation(m.GetRequestBody().GetBody(), true)))
			<-s.Context().Done()
			return nil
		})
		// An open body keeps §2.9 out of the way: the chunk is streamed.
		pr, pw := io.Pipe()
		defer pw.Close()
		go func() { _, _ = pw.Write([]byte(`{"model"`)) }()
		req, _ := http.NewRequest(http.MethodPost, p.URL()+"/v1/completions", pr)
		res := doReq(t, req)
		if res.status != http.StatusInternalServerError || !strings.Contains(res.header.Get(DetailsHeader), "streamed_response") {
			t.Fatalf("response = %d (%s), want 500", res.status, res.header.Get(DetailsHeader))
		}
	})
}

// TestBufferedPartial is §2.5: one message once the buffer limit is reached,
// one reply, then the rest passes through unseen.
func TestBufferedPartial(t *testing.T) {
	up := startUpstream(t)
	cfg := streamedConfig(t, extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL)
	cfg.Limits.BufferLimitBytes = 8
	got := make(chan *extprocv3.HttpBody, 2)
	p := startProxy(t, cfg, func(s *procStream) error {
		s.next()
		s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil))
		m := s.next()
		got <- m.GetRequestBody()
		s.reply(requestBodyReply(bodyMutation(bytes.ToUpper(m.GetRequestBody().GetBody()))))
		if m := s.next(); m.GetResponseHeaders() == nil {
			t.Errorf("after the partial body the server got %v, want response_headers", m)
			return nil
		}
		s.reply(responseHeadersReply())
		passResponse(s)
		return nil
	})
	pw, resc := streamedPost(p.URL() + "/v1/completions")
	_, _ = pw.Write([]byte("sixteen-bytes-ab"))
	if b := <-got; string(b.GetBody()) != "sixteen-bytes-ab" || b.GetEndOfStream() {
		t.Errorf("partial message = %v, want 16 bytes without end_of_stream", b)
	}
	_, _ = pw.Write([]byte("-tail"))
	_ = pw.Close()
	if res := <-resc; res.err != nil || res.status != http.StatusOK || res.body != "upstream:SIXTEEN-BYTES-AB-tail" {
		t.Fatalf("response = %d %q (%v)", res.status, res.body, res.err)
	}
}
