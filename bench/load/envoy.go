package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// Mode is the request body mode Envoy is configured with.
type Mode int

const (
	FullDuplex Mode = iota // FULL_DUPLEX_STREAMED, what GIE configures
	Buffered               // BUFFERED
)

func (m Mode) String() string {
	if m == Buffered {
		return "BUFFERED"
	}
	return "FULL_DUPLEX_STREAMED"
}

func parseMode(s string) (Mode, error) {
	switch s {
	case "full-duplex", "FULL_DUPLEX_STREAMED":
		return FullDuplex, nil
	case "buffered", "BUFFERED":
		return Buffered, nil
	}
	return 0, fmt.Errorf("mode %q: want full-duplex or buffered", s)
}

func (m Mode) proto() filterv3.ProcessingMode_BodySendMode {
	if m == Buffered {
		return filterv3.ProcessingMode_BUFFERED
	}
	return filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// envoyChunk is the size of the data chunks Envoy forwards in FULL_DUPLEX:
// its default HTTP/2 and HTTP/1 read buffers hand the filter 64 KiB at most.
const envoyChunk = 64 << 10

// Payload is one request body, with its Envoy messages prepared once and shared
// by every stream (protobuf messages are safe for concurrent marshalling).
type Payload struct {
	Body       []byte
	fullDuplex []*extprocv3.ProcessingRequest // the body in envoyChunk pieces, the last with end_of_stream
	buffered   *extprocv3.ProcessingRequest   // the whole body, end_of_stream
}

// NewPayload prepares body for both modes.
func NewPayload(body []byte) *Payload {
	return &Payload{
		Body:       body,
		buffered:   envoymsg.Body(envoymsg.Request, body, true),
		fullDuplex: envoymsg.ChunksOf(envoymsg.Request, body, envoyChunk, true),
	}
}

// headersMessage is the first message of a stream, as Envoy sends a chat
// completion POST: pseudo-headers, the client's headers, the ones Envoy adds,
// and protocol_config: the request body mode, and the response body mode,
// FULL_DUPLEX_STREAMED when the response is processed too, else NONE. Values
// travel in raw_value (Envoy's default).
func headersMessage(mode Mode, bodyLen int, requestID string, response bool) *extprocv3.ProcessingRequest {
	responseMode := filterv3.ProcessingMode_NONE
	if response {
		responseMode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	return envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, []envoymsg.Header{
		{":authority", "gateway.example.com"}, {":path", "/v1/chat/completions"}, {":method", "POST"}, {":scheme", "https"},
		{"content-type", "application/json"}, {"content-length", strconv.Itoa(bodyLen)},
		{"authorization", "Bearer sk-bench-0123456789abcdef"}, {"user-agent", "OpenAI/Python 1.54.4"},
		{"accept", "application/json"}, {"accept-encoding", "gzip, deflate"},
		{"x-forwarded-proto", "https"}, {"x-forwarded-for", "10.1.2.3"}, {"x-request-id", requestID},
		{"x-envoy-expected-rq-timeout-ms", "600000"},
	}...), mode.proto(), responseMode)
}

// Reply is what Envoy would forward upstream after the ext_proc exchange,
// and downstream of the answer when the response path was played.
type Reply struct {
	Destination string // x-gateway-destination-endpoint set by the server
	BodyBytes   int
	Body        []byte // only when asked to keep it
	// Chunks is how long each chunk of the answer took to come back, and
	// Answer the answer as the client gets it (only when asked to keep it).
	Chunks []time.Duration
	Answer []byte
}

// roundTrip runs one HTTP request's ext_proc exchange on a new Process stream,
// sending exactly what Envoy sends in mode, then, with an answer, the
// response path in FULL_DUPLEX; it returns once the last reply is in. It then
// resets the stream, as Envoy does when it has every reply it expects.
func roundTrip(ctx context.Context, c extprocv3.ExternalProcessorClient, mode Mode, p *Payload, a *Answer, requestID string, keepBody bool) (*Reply, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // Envoy's RST_STREAM once the last reply is in
	s, err := c.Process(ctx)
	if err != nil {
		return nil, err
	}
	if err := s.Send(headersMessage(mode, len(p.Body), requestID, a != nil)); err != nil {
		return nil, err
	}
	r := &Reply{}
	if err := requestPath(s, mode, p, r, keepBody); err != nil {
		return nil, err
	}
	if a != nil {
		if r.Chunks, r.Answer, err = playAnswer(s, a, keepBody); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// recvReply reads the server's next reply; an ImmediateResponse is an error.
func recvReply(s extprocv3.ExternalProcessor_ProcessClient) (*extprocv3.ProcessingResponse, error) {
	for {
		m, err := s.Recv()
		if err != nil {
			return nil, err
		}
		if ir := m.GetImmediateResponse(); ir != nil {
			return nil, fmt.Errorf("immediate response %d: %.200s", ir.GetStatus().GetCode(), ir.GetBody())
		}
		if m.Response == nil {
			continue // override_message_timeout only
		}
		return m, nil
	}
}

// requestPath sends the request body as Envoy does in mode, once the headers
// are out, and reads the replies into r until the request path is complete.
func requestPath(s extprocv3.ExternalProcessor_ProcessClient, mode Mode, p *Payload, r *Reply, keepBody bool) error {
	readDestination := func(cr *extprocv3.CommonResponse) {
		for _, h := range cr.GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() == handlers.DestinationHeader {
				r.Destination = string(h.GetHeader().GetRawValue())
			}
		}
	}

	if mode == Buffered {
		m, err := recvReply(s)
		if err != nil {
			return err
		}
		if m.GetRequestHeaders() == nil {
			return fmt.Errorf("BUFFERED: want a headers reply first, got %T", m.Response)
		}
		if err := s.Send(p.buffered); err != nil {
			return err
		}
		if m, err = recvReply(s); err != nil {
			return err
		}
		cr := m.GetRequestBody().GetResponse()
		if cr == nil {
			return fmt.Errorf("BUFFERED: want a body reply, got %T", m.Response)
		}
		readDestination(cr)
		b := cr.GetBodyMutation().GetBody()
		if cr.GetBodyMutation() == nil {
			b = p.Body // Envoy forwards the body it buffered
		}
		r.BodyBytes = len(b)
		if keepBody {
			r.Body = b
		}
		return nil
	}

	// FULL_DUPLEX: every chunk goes out without waiting; the server holds its
	// headers reply until it has the whole body.
	for _, m := range p.fullDuplex {
		if err := s.Send(m); err != nil {
			return err
		}
	}
	headersSeen := false
	for {
		m, err := recvReply(s)
		if err != nil {
			return err
		}
		switch {
		case m.GetRequestHeaders() != nil:
			headersSeen = true
			readDestination(m.GetRequestHeaders().GetResponse())
		case m.GetRequestBody() != nil:
			if !headersSeen {
				return errors.New("FULL_DUPLEX: body reply before the headers reply (Envoy answers 500)")
			}
			sr := m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if sr == nil {
				return errors.New("FULL_DUPLEX: body reply without streamed_response (Envoy answers 500)")
			}
			r.BodyBytes += len(sr.GetBody())
			if keepBody {
				r.Body = append(r.Body, sr.GetBody()...)
			}
			if sr.GetEndOfStream() {
				return nil
			}
		default:
			return fmt.Errorf("FULL_DUPLEX: unexpected reply %T", m.Response)
		}
	}
}
