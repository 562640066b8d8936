// Package echo is the floor of the benchmarks: the least an ext_proc server can
// do and still answer Envoy the way pd-extproc must. It routes nothing and parses
// nothing; it buffers the request body and hands it back unchanged, so the
// difference between it and extproc is what routing costs.
package echo

import (
	"errors"
	"io"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// MaxStreamedChunk bounds each FULL_DUPLEX body reply, as extproc does.
const MaxStreamedChunk = 62000

// Value is where every request is routed by default: the value of the one
// header each routed request gets, handlers.DestinationHeader.
const Value = "127.0.0.1:8201"

// maxPresize caps the Content-Length pre-allocation so a lying header costs little.
const maxPresize = 64 << 20

// Server implements envoy.service.ext_proc.v3.ExternalProcessor as an echo.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	// Destination is the value of the destination header; Value when empty.
	Destination string
}

// Process answers one HTTP request:
//   - FULL_DUPLEX_STREAMED: hold the headers reply until the body's end_of_stream,
//     then one headers reply setting the destination header, then the body back as streamed_response
//     chunks of at most MaxStreamedChunk bytes, the last with end_of_stream.
//   - BUFFERED: headers CONTINUE at once; the body reply sets the destination header and carries the
//     body unchanged (the same bytes extproc would send back).
//   - anything else: CONTINUE.
func (s Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	dest := s.Destination
	if dest == "" {
		dest = Value
	}
	var (
		mode filterv3.ProcessingMode_BodySendMode
		body []byte
		done bool
	)
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled || stream.Context().Err() != nil {
			return nil
		}
		if err != nil {
			return err
		}
		if pc := req.GetProtocolConfig(); pc != nil {
			mode = pc.GetRequestBodyMode()
		}
		var replies []*extprocv3.ProcessingResponse
		switch m := req.Request.(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			h := m.RequestHeaders
			if mode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED && !h.GetEndOfStream() {
				body = make([]byte, 0, presize(h.GetHeaders()))
				continue
			}
			replies = append(replies, headersReply(dest, h.GetEndOfStream()))
		case *extprocv3.ProcessingRequest_RequestBody:
			b := m.RequestBody
			if done {
				continue
			}
			if mode != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
				done = true
				replies = append(replies, bufferedReply(dest, b.GetBody()))
				break
			}
			body = append(body, b.GetBody()...)
			if !b.GetEndOfStream() {
				continue
			}
			done = true
			replies = append(replies, headersReply(dest, true))
			replies = append(replies, streamed(body, true)...)
		case *extprocv3.ProcessingRequest_RequestTrailers:
			if mode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED && !done {
				done = true
				replies = append(replies, headersReply(dest, true))
				replies = append(replies, streamed(body, false)...)
			}
			replies = append(replies, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
				RequestTrailers: &extprocv3.TrailersResponse{}}})
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			replies = append(replies, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extprocv3.HeadersResponse{}}})
		case *extprocv3.ProcessingRequest_ResponseBody:
			replies = append(replies, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
				ResponseBody: streamedBody(m.ResponseBody.GetBody(), m.ResponseBody.GetEndOfStream())}})
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			replies = append(replies, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
				ResponseTrailers: &extprocv3.TrailersResponse{}}})
		}
		for _, r := range replies {
			if err := stream.Send(r); err != nil {
				return err
			}
		}
	}
}

func presize(hm *corev3.HeaderMap) int {
	for _, h := range hm.GetHeaders() {
		if h.GetKey() == "content-length" {
			if n, err := strconv.Atoi(string(h.GetRawValue())); err == nil && n > 0 {
				return min(n, maxPresize)
			}
		}
	}
	return 0
}

func setHeader(dest string) *extprocv3.HeaderMutation {
	return &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
		{Header: &corev3.HeaderValue{Key: handlers.DestinationHeader, RawValue: []byte(dest)}},
	}}
}

// headersReply is CONTINUE; routed says it carries the destination header.
func headersReply(dest string, routed bool) *extprocv3.ProcessingResponse {
	common := &extprocv3.CommonResponse{}
	if routed {
		common.HeaderMutation = setHeader(dest)
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: common}}}
}

func bufferedReply(dest string, body []byte) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
		Response: &extprocv3.CommonResponse{
			HeaderMutation: setHeader(dest),
			BodyMutation:   &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}},
		}}}}
}

func streamedBody(chunk []byte, eos bool) *extprocv3.BodyResponse {
	return &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: eos}},
	}}}
}

// streamed splits body into FULL_DUPLEX request-body replies; an empty body is
// one empty chunk. Only the last carries eos.
func streamed(body []byte, eos bool) []*extprocv3.ProcessingResponse {
	var out []*extprocv3.ProcessingResponse
	for {
		n := min(len(body), MaxStreamedChunk)
		last := n == len(body)
		out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: streamedBody(body[:n], eos && last)}})
		if last {
			return out
		}
		body = body[n:]
	}
}
