package envoyemu

import (
	"net/http"
	"strconv"
)

// downstream is the response direction's sink: the client connection. Every
// write is flushed so SSE keeps streaming chunk by chunk.
type downstream struct {
	x *exchange
}

func (s *downstream) headers(h *headerMap, end bool) {
	x := s.x
	code := http.StatusOK
	if v, ok := h.get(":status"); ok {
		if n, err := strconv.Atoi(v); err == nil && n >= 100 && n <= 999 {
			code = n
		}
	}
	hdr := x.w.Header()
	h.toHTTPHeader(hdr)
	if _, ok := hdr["Content-Type"]; !ok {
		hdr["Content-Type"] = nil // Go would sniff one; Envoy passes what it got
	}
	x.respStarted = true
	x.resetIdle()
	x.w.WriteHeader(code)
	if end {
		x.finished = true
		return
	}
	_ = x.rc.Flush()
}

func (s *downstream) data(b []byte, end bool) {
	x := s.x
	if len(b) > 0 {
		if _, err := x.w.Write(b); err != nil {
			x.logf("downstream write: %v", err)
			x.finished = true
			return
		}
	}
	_ = x.rc.Flush()
	x.resetIdle()
	if end {
		x.finished = true
	}
}

func (s *downstream) trailers(t *headerMap) {
	x := s.x
	hdr := x.w.Header()
	for _, e := range t.entries {
		hdr.Add(http.TrailerPrefix+http.CanonicalHeaderKey(e.key), e.value)
	}
	x.finished = true
}
