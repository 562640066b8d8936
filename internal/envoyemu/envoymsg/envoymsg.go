// Package envoymsg builds ext_proc messages as Envoy sends them: one builder
// for the emulator, the handlers' tests and fuzzing, and the benchmarks, so
// that every one of them speaks the same shapes (values in raw_value, the
// protocol_config on the first message only, a chunked body as data frames);
// Exchange plays them on a stream of a server under test.
package envoymsg

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// Direction is the half of the HTTP exchange a message belongs to.
type Direction bool

const (
	Request  Direction = false
	Response Direction = true
)

// Header is one header entry, name and value.
type Header = [2]string

// HeaderMap is hs as Envoy sends them: each value in raw_value (value is left
// empty, as with Envoy's default send_header_raw_value).
func HeaderMap(hs ...Header) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, len(hs))}
	for i, h := range hs {
		hm.Headers[i] = &corev3.HeaderValue{Key: h[0], RawValue: []byte(h[1])}
	}
	return hm
}

// Headers is a headers message; eos says no body follows.
func Headers(d Direction, eos bool, hs ...Header) *extprocv3.ProcessingRequest {
	return HeadersOf(d, HeaderMap(hs...), eos)
}

// HeadersOf is a headers message carrying hm as it is.
func HeadersOf(d Direction, hm *corev3.HeaderMap, eos bool) *extprocv3.ProcessingRequest {
	hh := &extprocv3.HttpHeaders{Headers: hm, EndOfStream: eos}
	if d == Response {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hh}}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hh}}
}

// Body is one body message. The chunk is used as it is, not copied.
func Body(d Direction, chunk []byte, eos bool) *extprocv3.ProcessingRequest {
	hb := &extprocv3.HttpBody{Body: chunk, EndOfStream: eos}
	if d == Response {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: hb}}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: hb}}
}

// Trailers is a trailers message.
func Trailers(d Direction, hs ...Header) *extprocv3.ProcessingRequest {
	return TrailersOf(d, HeaderMap(hs...))
}

// TrailersOf is a trailers message carrying hm as it is.
func TrailersOf(d Direction, hm *corev3.HeaderMap) *extprocv3.ProcessingRequest {
	ht := &extprocv3.HttpTrailers{Trailers: hm}
	if d == Response {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: ht}}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: ht}}
}

// Chunks cuts b into n body messages of equal size (the last may be shorter),
// as Envoy forwards data frames; eos goes on the last. An empty body is one
// empty message, as a chunked request's terminator arrives.
func Chunks(d Direction, b []byte, n int, eos bool) []*extprocv3.ProcessingRequest {
	size := max((len(b)+max(n, 1)-1)/max(n, 1), 1)
	return ChunksOf(d, b, size, eos)
}

// ChunksOf cuts b into body messages of size bytes (the last may be shorter).
func ChunksOf(d Direction, b []byte, size int, eos bool) []*extprocv3.ProcessingRequest {
	size = max(size, 1)
	var out []*extprocv3.ProcessingRequest
	for i := 0; i < len(b) || len(out) == 0; i += size {
		end := min(i+size, len(b))
		out = append(out, Body(d, b[i:end], eos && end == len(b)))
	}
	return out
}

// WithModes sets the protocol_config Envoy sends on a stream's first message:
// the body modes of the two directions.
func WithModes(m *extprocv3.ProcessingRequest, request, response filterv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
	m.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: request, ResponseBodyMode: response}
	return m
}

// Post is the request headers of a JSON POST to path with a body of n bytes,
// as Envoy forwards them (pseudo-headers first), then extra.
func Post(path string, n int, extra ...Header) []Header {
	return append([]Header{{":method", "POST"}, {":path", path}, {":authority", "gw"}, {":scheme", "http"},
		{"content-type", "application/json"}, {"content-length", strconv.Itoa(n)}}, extra...)
}

// Exchange plays msgs on a new stream of c, as Envoy would send them, and
// returns every reply until the server ends the stream, within ten seconds.
// With halfClose the client half-closes after the last message, as Envoy's
// graceful close does; without, the server must end the stream itself.
func Exchange(c extprocv3.ExternalProcessorClient, halfClose bool, msgs ...*extprocv3.ProcessingRequest) ([]*extprocv3.ProcessingResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := c.Process(ctx)
	if err != nil {
		return nil, err
	}
	for _, m := range msgs {
		if err := s.Send(m); err != nil {
			return nil, err
		}
	}
	if halfClose {
		s.CloseSend()
	}
	var out []*extprocv3.ProcessingResponse
	for {
		r, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, fmt.Errorf("Recv: %w", err)
		}
		out = append(out, r)
	}
}
