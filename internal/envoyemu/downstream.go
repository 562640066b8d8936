package envoyemu

import (
	"errors"
	"io"
	"net/http"
	"strconv"
)

// downstream is the client connection: the request read from it, and, as
// the response direction's sink, the response written to it. Every write is
// flushed so SSE keeps streaming chunk by chunk.
type downstream struct {
	x        *exchange
	w        http.ResponseWriter
	r        *http.Request
	rc       *http.ResponseController
	bodyDone bool // the whole request body reached the filter
	started  bool // the response headers went out: a local reply now resets
}

// readBody turns the request body into data events, one per read (one
// request_body message per chunk in FULL_DUPLEX), none with the end of
// stream: as in Envoy's HTTP/1 codec (onBody), a body, Content-Length or
// chunked, ends with the trailers or with an empty end-of-stream chunk
// (onMessageCompleteBase).
func (s *downstream) readBody() {
	x, r := s.x, s.r
	buf := make([]byte, 64<<10)
	for {
		n, err := r.Body.Read(buf)
		if n > 0 {
			chunk := append([]byte(nil), buf[:n]...)
			if !x.post(func() { s.onData(chunk, false) }) {
				return
			}
		}
		if errors.Is(err, io.EOF) {
			var trailers *headerMap
			if len(r.Trailer) > 0 {
				trailers = &headerMap{}
				fromHTTPHeader(r.Trailer, trailers)
			}
			if trailers != nil && len(trailers.entries) > 0 {
				x.post(func() { s.onTrailers(trailers) })
			} else {
				x.post(func() { s.onData(nil, true) })
			}
			return
		}
		if err != nil {
			x.post(func() {
				x.logf("downstream reset while sending the body: %v", err)
				x.finished, x.abort = true, true // as Envoy, no answer: the stream is reset
			})
			return
		}
	}
}

func (s *downstream) onData(b []byte, end bool) {
	s.x.resetIdle()
	if end {
		s.requestDone()
	}
	s.x.dec.onData(b, end)
}

func (s *downstream) onTrailers(t *headerMap) {
	s.x.resetIdle()
	s.requestDone()
	s.x.dec.onTrailers(t)
}

func (s *downstream) requestDone() {
	s.bodyDone = true
	if h := s.x.p.hooks.clientBodyDone; h != nil {
		h()
	}
}

func (s *downstream) headers(h *headerMap, end bool) {
	x := s.x
	code := http.StatusOK
	if v, ok := h.get(":status"); ok {
		if n, err := strconv.Atoi(v); err == nil && n >= 100 && n <= 999 {
			code = n
		}
	}
	hdr := s.w.Header()
	h.toHTTPHeader(hdr)
	if _, ok := hdr["Content-Type"]; !ok {
		hdr["Content-Type"] = nil // Go would sniff one; Envoy passes what it got
	}
	s.started = true
	x.resetIdle()
	s.w.WriteHeader(code)
	if end {
		x.finished = true
		return
	}
	_ = s.rc.Flush()
}

func (s *downstream) data(b []byte, end bool) {
	x := s.x
	if len(b) > 0 {
		if _, err := s.w.Write(b); err != nil {
			x.logf("downstream write: %v", err)
			x.finished = true
			return
		}
	}
	_ = s.rc.Flush()
	x.resetIdle()
	if end {
		x.finished = true
	}
}

func (s *downstream) trailers(t *headerMap) {
	hdr := s.w.Header()
	for _, e := range t.entries {
		hdr.Add(http.TrailerPrefix+http.CanonicalHeaderKey(e.key), e.value)
	}
	s.x.finished = true
}
