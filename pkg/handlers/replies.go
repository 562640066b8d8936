package handlers

import (
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// The endpoint-picker protocol of the Gateway API Inference Extension: the chosen
// endpoint goes both in a request header (read by an ORIGINAL_DST cluster) and in
// dynamic metadata under the envoy.lb namespace, with the same value.
const (
	DestinationHeader   = "x-gateway-destination-endpoint"
	DestinationMetadata = "envoy.lb"
	RequestIDHeader     = "x-request-id"

	// The proxy may restrict the choice to a subset of endpoints.
	SubsetHintNamespace = "envoy.lb.subset_hint"
	SubsetHintKey       = "x-gateway-destination-endpoint-subset"

	// On the response path, a gateway that implements the protocol (v1.0.0)
	// reports the endpoint that served the request, which of a fallback
	// list, under this key of DestinationMetadata in the message's
	// metadata_context. Vanilla Envoy reports none.
	DestinationServedKey = "x-gateway-destination-endpoint-served"
)

// reply is what a phase answers a message with, sent in this order: a
// message; a FULL_DUPLEX body reply for each chunk (the body's own bytes, not
// copies), the last with end_of_stream when eos; a last message. Then, when
// routed, the request is concluded as routed (exchange.routed); done says
// the stream is finished for us.
type reply struct {
	msg     *extprocv3.ProcessingResponse
	chunks  [][]byte
	request bool // the chunks are of the request's body, else of the response's
	eos     bool
	last    *extprocv3.ProcessingResponse
	routed  bool
	done    bool
}

// messages yields r's messages in the order they are sent.
func (r reply) messages(yield func(*extprocv3.ProcessingResponse) bool) {
	if r.msg != nil && !yield(r.msg) {
		return
	}
	for i, c := range r.chunks {
		if !yield(streamedChunk(r.request, c, r.eos && i == len(r.chunks)-1)) {
			return
		}
	}
	if r.last != nil {
		yield(r.last)
	}
}

// answer is a reply of one message.
func answer(m *extprocv3.ProcessingResponse) reply { return reply{msg: m} }

// maxStreamedChunk bounds each FULL_DUPLEX body reply, below Envoy's recommended
// 64 KiB per message.
const maxStreamedChunk = 62000

// setHeader returns a header mutation entry. Envoy reads only raw_value (value and
// raw_value together are rejected), and with append unset it overwrites, which
// also replaces any value the client sent.
func setHeader(key, value string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: key, RawValue: []byte(value)}}
}

// destination is d's endpoints as the endpoint-picker protocol writes them:
// the pick, then its fallbacks, comma-separated.
func destination(d *pipeline.Decision) string { return strings.Join(d.Endpoints, ",") }

// routing returns the header mutation and metadata that send the request to d.
func routing(d *pipeline.Decision, requestID string) (*extprocv3.HeaderMutation, *structpb.Struct) {
	m := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
		setHeader(DestinationHeader, destination(d)),
		setHeader(RequestIDHeader, requestID),
	}, RemoveHeaders: d.Headers.Remove} // Envoy may remove any of them (docs/envoy.md §3.3)
	if d.Headers.Authorization != "" { // Envoy may set it, as any header not its own (§3.3)
		m.SetHeaders = append(m.SetHeaders, setHeader("authorization", d.Headers.Authorization))
	}
	md := &structpb.Struct{Fields: map[string]*structpb.Value{
		DestinationMetadata: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			DestinationHeader: structpb.NewStringValue(destination(d)),
		}}),
	}}
	return m, md
}

// headersReply answers request headers; with a decision it carries the routing.
// clear_route_cache is honoured by Envoy only next to a header mutation.
func headersReply(d *pipeline.Decision, requestID string) *extprocv3.ProcessingResponse {
	common := &extprocv3.CommonResponse{}
	var md *structpb.Struct
	if d != nil {
		common.HeaderMutation, md = routing(d, requestID)
		common.ClearRouteCache = true
	}
	return &extprocv3.ProcessingResponse{
		Response:        &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: common}},
		DynamicMetadata: md,
	}
}

// bufferedHeadersReply answers BUFFERED request headers, whose routing the
// body reply carries. It removes the client's own destination header, so
// that no path by which Envoy passes the headers on unrouted (trailers
// before any body) lets the client pick the upstream.
func bufferedHeadersReply() *extprocv3.ProcessingResponse {
	m := headersReply(nil, "")
	m.GetRequestHeaders().Response.HeaderMutation = &extprocv3.HeaderMutation{RemoveHeaders: []string{DestinationHeader}}
	return m
}

// bufferedBodyReply carries the routing in one BUFFERED body reply (Envoy still
// holds the headers) and the rewritten body, if any, with a matching
// Content-Length when the client sent one: Envoy checks it against a new body,
// and a chunked request must not be given one.
func bufferedBodyReply(d *pipeline.Decision, requestID string, rewritten []byte, clientSentLength bool) *extprocv3.ProcessingResponse {
	m, md := routing(d, requestID)
	common := &extprocv3.CommonResponse{HeaderMutation: m, ClearRouteCache: true}
	if rewritten != nil {
		common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: rewritten}}
		if clientSentLength {
			m.SetHeaders = append(m.SetHeaders, setHeader("content-length", strconv.Itoa(len(rewritten))))
		}
	}
	return &extprocv3.ProcessingResponse{
		Response:        &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}},
		DynamicMetadata: md,
	}
}

// streamedChunk is one FULL_DUPLEX body reply; Envoy rejects any other body
// mutation in that mode, an empty CommonResponse included.
// Its seven messages and wrappers are one allocation (chunkReply): a
// streamed answer sends one per token.
func streamedChunk(request bool, chunk []byte, eos bool) *extprocv3.ProcessingResponse {
	c := new(chunkReply)
	c.streamed = extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: eos}
	c.mutation.StreamedResponse = &c.streamed
	c.body.Mutation = &c.mutation
	c.common.BodyMutation = &c.body
	c.response.Response = &c.common
	if request {
		c.request.RequestBody = &c.response
		c.reply.Response = &c.request
	} else {
		c.responseBody.ResponseBody = &c.response
		c.reply.Response = &c.responseBody
	}
	return &c.reply
}

// chunkReply holds what streamedChunk's reply points to.
type chunkReply struct {
	reply        extprocv3.ProcessingResponse
	request      extprocv3.ProcessingResponse_RequestBody
	responseBody extprocv3.ProcessingResponse_ResponseBody
	response     extprocv3.BodyResponse
	common       extprocv3.CommonResponse
	body         extprocv3.BodyMutation
	mutation     extprocv3.BodyMutation_StreamedResponse
	streamed     extprocv3.StreamedBodyResponse
}

// The replies that answer a message without changing anything.
func continueResponseHeaders() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
}

func continueResponseBody() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
}

func continueRequestTrailers() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
}

func continueResponseTrailers() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
}

// immediate turns an error into Envoy's local reply to the client, in
// Anthropic's words with anthropic (pipeline.Error.Body).
func immediate(e *pipeline.Error, anthropic bool) *extprocv3.ProcessingResponse {
	b, contentType := e.Body(anthropic)
	return localReply(e.Status, b, contentType, e.RetryAfter)
}

// localReply is Envoy's local reply to the client: status, body and its
// content type, and a Retry-After when retryAfter is set. Its details are
// pd_extproc_<status>.
func localReply(status int, body []byte, contentType string, retryAfter time.Duration) *extprocv3.ProcessingResponse {
	var headers []*corev3.HeaderValueOption
	if contentType != "" { // else Envoy's local reply keeps its own text/plain
		headers = append(headers, setHeader("content-type", contentType))
	}
	if retryAfter > 0 {
		headers = append(headers, setHeader("retry-after", strconv.Itoa(int(retryAfter.Round(time.Second)/time.Second))))
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status:  &typev3.HttpStatus{Code: typev3.StatusCode(status)},
		Headers: &extprocv3.HeaderMutation{SetHeaders: headers},
		Body:    body,
		Details: "pd_extproc_" + strconv.Itoa(status),
	}}}
}

// overrideReply extends Envoy's message timer for the outstanding message. Envoy
// ignores every other field of such a message.
func overrideReply(d time.Duration) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(d)}
}
