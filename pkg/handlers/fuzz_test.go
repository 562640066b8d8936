package handlers_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// FuzzProcess drives one Process stream per input over real gRPC (bufconn)
// with a fake prefill engine behind the pipeline, and checks what a real Envoy
// would make of the replies (shared/reference/envoy-ext-proc.md §2, §3.5, §7.3,
// §10):
//
//   - the server never panics, every stream ends within fuzzStreamBound, and
//     nothing it started outlives the stream (goleak);
//   - every reply is well formed whatever the input: a oneof, or
//     override_message_timeout alone; header mutations in raw_value only, never
//     touching routing or x-envoy headers; the destination a configured decode
//     endpoint, the same in header and envoy.lb metadata; end_of_stream at most
//     once per direction and nothing after it; an ImmediateResponse last;
//   - for the messages Envoy can send (most inputs are built to look like
//     Envoy's own sequences) the replies follow Envoy's state machine: in
//     FULL_DUPLEX the headers reply before body replies, body replies only as
//     streamed_response, end_of_stream only after Envoy's; in other modes
//     exactly one reply per message, in order, unless an ImmediateResponse ends
//     the stream; a BUFFERED body reply that replaces the body sets
//     Content-Length to the new body's size exactly when the client sent one; the response path is echoed
//     byte for byte; nothing is owed when the stream ends; and no
//     client-supplied kv_transfer_params or bootstrap_* reaches the decode body.
//
// Messages Envoy never sends in that state are fed too. A body after the
// direction's end_of_stream is the one Envoy really does send (envoy#46237) and
// must get no reply. Anything else (duplicate headers, a body in NONE mode, a
// second protocol_config, ...) leaves the server free to answer or not, so from
// there on that direction gets only the always-rules.
//
// Input layout: fuzzCtlLen control bytes (see fuzzCase), then free data used
// for prompts, raw bodies and header values.
func FuzzProcess(f *testing.F) {
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		runFuzzCase(t, decodeFuzzCase(in))
	})
}

// fuzzStreamBound is how long one stream may take before it counts as a
// deadlock: the slowest fake prefill ends at the 50 ms prefill timeout.
const fuzzStreamBound = 10 * time.Second

// fuzzDecodeEndpoints are the only places a request may be routed to.
var fuzzDecodeEndpoints = []string{"10.1.1.1:8000", "10.1.1.2:8000"}

// fuzzPrefillParams is what the fake prefill engine hands over (kv-nixl).
const fuzzPrefillParams = `{"do_remote_prefill":true,"remote_block_ids":[[1,2]],"remote_engine_id":"e-1",` +
	`"remote_request_id":"r-1","remote_host":"10.9.9.9","remote_port":5600,"big":12345678901234567890}`

// fuzzBootstrapPort is the prefill pool's SGLang bootstrap port in every case.
const fuzzBootstrapPort = 8998

// ---------------------------------------------------------------- the case

// Behaviours of the fake prefill engine.
const (
	prefillParams      = iota // 200 with kv_transfer_params
	prefillNullParams         // 200, kv_transfer_params null (no connector)
	prefillNoParams           // 200 without the field
	prefillArrayParams        // 200, kv_transfer_params not an object
	prefill5xx
	prefill4xx
	prefill4xxNoType // 422 with no Content-Type
	prefillSlow      // 3 ms, then params: past a 1 ms override_after
	prefillHang      // until the 50 ms prefill timeout cancels it
	prefillDrop      // closes the connection without answering
	prefillGarbage   // 200 with a body that is not JSON
	prefillRefused   // nothing listens at the address
	prefillBehaviours
)

var fuzzModes = []filterv3.ProcessingMode_BodySendMode{
	filterv3.ProcessingMode_NONE, filterv3.ProcessingMode_STREAMED, filterv3.ProcessingMode_BUFFERED,
	filterv3.ProcessingMode_BUFFERED_PARTIAL, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
	filterv3.ProcessingMode_GRPC, 9, // 9: a mode from a future Envoy
}

// fuzzSubsets are endpoint-picker subset hints Envoy may forward (§8.2).
var fuzzSubsets = []*structpb.Value{
	nil,
	structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewStringValue("10.1.1.2:8000")}}),
	structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewStringValue("6.6.6.6:1")}}), // none of ours: 503
	structpb.NewListValue(&structpb.ListValue{}),                                                                // empty: 503
	structpb.NewStringValue("10.1.1.1:8000, 10.1.1.2:8000"),
	structpb.NewNumberValue(7), // unreadable: allows nothing
}

var fuzzConnectors = []string{"kv-nixl", "kv-shared-storage", "kv-sglang"}

// fuzzCtlLen is the size of the control part of an input; the rest is data.
const fuzzCtlLen = 48

// Control byte offsets.
const (
	ctlConnector = iota
	ctlPrefill
	ctlOptions  // bit 0 on_failure fail, 1 300-byte body limit, 2 second prefill endpoint, 3 verbose logs + prompts, 4 metrics, 5-6 override_after
	ctlReqMode  // index in fuzzModes
	ctlRespMode // index in fuzzModes
	ctlStyle    // bit 0 chaos, bit 1 reset the stream instead of half-closing; the rest: where
	ctlPath     // bits 0-2 path, bit 3 GET
	ctlBody     // body template
	ctlLength   // content-length header
	ctlChunks   // request body chunks; bit 7 BUFFERED_PARTIAL cut at the buffer limit
	ctlExtra    // bit 0 x-request-id, 1 authorization, 2 traceparent, 3 client destination, 4 request trailers, 5 response path, 6 response trailers, 7 stream:true
	ctlRespChunks
	ctlPerturb // number of perturbations (envoy-like) or operations (chaos)
	ctlSubset  // envoy.lb.subset_hint metadata on the request headers (fuzzSubsets); bit 7: the decode engine answers 503
	ctlOps     // then 2 bytes per perturbation or operation
)

type fuzzCase struct {
	connector     string
	prefill       int
	onFailureFail bool
	smallLimit    bool
	twoPrefills   bool
	verbose       bool
	metrics       bool
	overrideAfter time.Duration
	cancelAt      int // reset the stream before sending msgs[cancelAt]; -1: half-close after all
	msgs          []*extprocv3.ProcessingRequest
}

// fuzzBytes reads bytes, then zeros once they run out.
type fuzzBytes struct{ b []byte }

func (r *fuzzBytes) next() byte {
	if len(r.b) == 0 {
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *fuzzBytes) take(n int) []byte {
	n = min(n, len(r.b))
	out := r.b[:n:n]
	r.b = r.b[n:]
	return out
}

func decodeFuzzCase(in []byte) *fuzzCase {
	var ctl [fuzzCtlLen]byte
	copy(ctl[:], in)
	var data []byte
	if len(in) > fuzzCtlLen {
		data = in[fuzzCtlLen:]
	}
	opt := ctl[ctlOptions]
	c := &fuzzCase{
		connector:     fuzzConnectors[int(ctl[ctlConnector])%len(fuzzConnectors)],
		prefill:       int(ctl[ctlPrefill]) % prefillBehaviours,
		onFailureFail: opt&1 != 0,
		smallLimit:    opt&2 != 0,
		twoPrefills:   opt&4 != 0,
		verbose:       opt&8 != 0,
		metrics:       opt&16 != 0,
		overrideAfter: []time.Duration{0, time.Millisecond, 150 * time.Millisecond, time.Millisecond}[opt>>5&3],
		cancelAt:      -1,
	}
	reqMode := fuzzModes[int(ctl[ctlReqMode])%len(fuzzModes)]
	respMode := fuzzModes[int(ctl[ctlRespMode])%len(fuzzModes)]
	g := &fuzzGen{ctl: &fuzzBytes{ctl[ctlOps:]}, data: &fuzzBytes{data}, reqMode: reqMode, respMode: respMode}
	if ctl[ctlStyle]&1 != 0 {
		c.msgs = g.chaos(int(ctl[ctlPerturb]) % 16)
	} else {
		c.msgs = g.envoyLike(ctl)
	}
	if len(c.msgs) > 0 {
		c.msgs[0].ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: reqMode, ResponseBodyMode: respMode}
	}
	if ctl[ctlStyle]&2 != 0 {
		c.cancelAt = int(ctl[ctlStyle]>>2) % (len(c.msgs) + 1)
	}
	return c
}

// fuzzGen builds message sequences: ctl steers, data fills in.
type fuzzGen struct {
	ctl, data         *fuzzBytes
	reqMode, respMode filterv3.ProcessingMode_BodySendMode
}

func (g *fuzzGen) envoyLike(ctl [fuzzCtlLen]byte) []*extprocv3.ProcessingRequest {
	extra := ctl[ctlExtra]
	stream := extra&128 != 0
	body := g.body(int(ctl[ctlBody]), stream)
	get := ctl[ctlPath]&8 != 0
	if get {
		body = nil
	}
	trailers := extra&16 != 0 && !get

	hs := [][2]string{{":method", "POST"}, {":path", g.path(int(ctl[ctlPath]) & 7)}, {":authority", "gw"}, {":scheme", "http"}, {"content-type", "application/json"}}
	if get {
		hs[0][1] = "GET"
	}
	switch int(ctl[ctlLength]) % 6 {
	case 0:
		hs = append(hs, [2]string{"content-length", strconv.Itoa(len(body))})
	case 1: // chunked: none
	case 2:
		hs = append(hs, [2]string{"content-length", strconv.Itoa(len(body) + 1)})
	case 3:
		hs = append(hs, [2]string{"content-length", "abc"})
	case 4:
		hs = append(hs, [2]string{"content-length", strconv.Itoa(len(body))}, [2]string{"content-length", strconv.Itoa(len(body) + 7)})
	case 5:
		hs = append(hs, [2]string{"content-length", "-1"})
	}
	if extra&1 != 0 {
		// Envoy's codec refuses NUL, CR and LF in a value; anything else reaches us.
		id := bytes.Map(func(r rune) rune {
			if r == 0 || r == '\r' || r == '\n' {
				return 'x'
			}
			return r
		}, g.data.take(int(g.data.next())%40))
		hs = append(hs, [2]string{"x-request-id", string(bytes.TrimSpace(id))})
	}
	if extra&2 != 0 {
		hs = append(hs, [2]string{"authorization", "Bearer sk-secret"})
	}
	if extra&4 != 0 {
		hs = append(hs, [2]string{"traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
	}
	if extra&8 != 0 {
		hs = append(hs, [2]string{handlers.DestinationHeader, "6.6.6.6:666"})
	}
	noBody := len(body) == 0 && !trailers
	msgs := []*extprocv3.ProcessingRequest{fuzzHeadersMsg(false, noBody, hs...)}
	if hint := fuzzSubsets[int(ctl[ctlSubset]&127)%len(fuzzSubsets)]; hint != nil {
		msgs[0].MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			handlers.SubsetHintNamespace: {Fields: map[string]*structpb.Value{handlers.SubsetHintKey: hint}},
		}}
	}

	if !noBody {
		switch g.reqMode {
		case filterv3.ProcessingMode_NONE:
		case filterv3.ProcessingMode_BUFFERED:
			msgs = append(msgs, fuzzBodyMsg(false, body, !trailers))
		case filterv3.ProcessingMode_BUFFERED_PARTIAL:
			if ctl[ctlChunks]&128 != 0 && len(body) > 1 {
				// The buffer limit was reached: what is queued goes, the rest passes unseen.
				msgs = append(msgs, fuzzBodyMsg(false, body[:len(body)/2], false))
				trailers = false
			} else {
				msgs = append(msgs, fuzzBodyMsg(false, body, !trailers))
			}
		default:
			msgs = append(msgs, fuzzChunks(false, body, 1+int(ctl[ctlChunks]&7), !trailers)...)
		}
		if trailers {
			msgs = append(msgs, fuzzTrailersMsg(false))
		}
	}

	if extra&32 != 0 { // the upstream answered: the response path
		var resp []byte
		for i := range int(ctl[ctlRespChunks]) % 4 {
			resp = fmt.Appendf(resp, "data: {\"choices\":[{\"delta\":{\"content\":\"tok%d\"}}]}\n\n", i)
		}
		respTrailers := extra&64 != 0
		respNoBody := len(resp) == 0 && !respTrailers
		status := "200"
		if ctl[ctlSubset]&128 != 0 {
			status = "503" // the decode engine failed: scheduling is told
		}
		msgs = append(msgs, fuzzHeadersMsg(true, respNoBody, [2]string{":status", status}, [2]string{"content-type", "text/event-stream"}))
		if !respNoBody {
			switch g.respMode {
			case filterv3.ProcessingMode_NONE:
			case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
				msgs = append(msgs, fuzzBodyMsg(true, resp, !respTrailers))
			default:
				msgs = append(msgs, fuzzChunks(true, resp, 1+int(ctl[ctlRespChunks]>>2&3), !respTrailers)...)
			}
			if respTrailers {
				msgs = append(msgs, fuzzTrailersMsg(true))
			}
		}
	}

	for range int(ctl[ctlPerturb]) % 4 {
		msgs = g.perturb(msgs)
	}
	return msgs
}

// perturb applies one thing Envoy does not do in order (except the first,
// which it does: envoy#46237).
func (g *fuzzGen) perturb(msgs []*extprocv3.ProcessingRequest) []*extprocv3.ProcessingRequest {
	kind, at := int(g.ctl.next())%8, int(g.ctl.next())%(len(msgs)+1)
	insert := func(m *extprocv3.ProcessingRequest, at int) []*extprocv3.ProcessingRequest {
		return append(msgs[:at:at], append([]*extprocv3.ProcessingRequest{m}, msgs[at:]...)...)
	}
	switch kind {
	case 0: // the final request chunk again
		for i := len(msgs) - 1; i >= 0; i-- {
			if b := msgs[i].GetRequestBody(); b != nil && b.GetEndOfStream() {
				return insert(proto.Clone(msgs[i]).(*extprocv3.ProcessingRequest), i+1)
			}
		}
	case 1:
		if len(msgs) > 0 {
			return insert(proto.Clone(msgs[0]).(*extprocv3.ProcessingRequest), max(at, 1))
		}
	case 2:
		return insert(&extprocv3.ProcessingRequest{}, at)
	case 3:
		return insert(fuzzBodyMsg(false, g.data.take(int(g.data.next())), g.data.next()&1 != 0), at)
	case 4:
		return insert(fuzzBodyMsg(true, g.data.take(int(g.data.next())), g.data.next()&1 != 0), at)
	case 5:
		if at > 0 && at < len(msgs) {
			msgs[at].ProtocolConfig = &extprocv3.ProtocolConfiguration{
				RequestBodyMode:  fuzzModes[int(g.ctl.next())%len(fuzzModes)],
				ResponseBodyMode: fuzzModes[int(g.ctl.next())%len(fuzzModes)],
			}
		}
	case 6:
		if at < len(msgs) {
			return append(msgs[:at:at], msgs[at+1:]...)
		}
	case 7:
		if at+1 < len(msgs) {
			msgs[at], msgs[at+1] = msgs[at+1], msgs[at]
		}
	}
	return msgs
}

// chaos is an arbitrary sequence of n messages.
func (g *fuzzGen) chaos(n int) []*extprocv3.ProcessingRequest {
	var msgs []*extprocv3.ProcessingRequest
	for range n {
		kind, flags := int(g.ctl.next())%8, g.ctl.next()
		eos := flags&1 != 0
		var m *extprocv3.ProcessingRequest
		switch kind {
		case 0, 7:
			m = fuzzHeadersMsg(false, eos, [2]string{":method", "POST"}, [2]string{":path", g.path(int(flags>>1) & 7)},
				[2]string{"content-length", strconv.Itoa(int(g.data.next()))})
		case 1:
			b := g.data.take(int(g.data.next()))
			if flags&64 != 0 {
				b = g.body(int(flags>>2), false)
			}
			m = fuzzBodyMsg(false, b, eos)
		case 2:
			m = fuzzTrailersMsg(false)
		case 3:
			m = fuzzHeadersMsg(true, eos, [2]string{":status", "200"})
		case 4:
			m = fuzzBodyMsg(true, g.data.take(int(g.data.next())), eos)
		case 5:
			m = fuzzTrailersMsg(true)
		case 6:
			m = &extprocv3.ProcessingRequest{}
		}
		if flags&2 != 0 && len(msgs) > 0 {
			m.ProtocolConfig = &extprocv3.ProtocolConfiguration{
				RequestBodyMode:  fuzzModes[int(flags>>2)%len(fuzzModes)],
				ResponseBodyMode: fuzzModes[int(flags>>5)%len(fuzzModes)],
			}
		}
		msgs = append(msgs, m)
	}
	if n > 0 && len(msgs) > 0 && msgs[0].GetRequestHeaders() == nil {
		// Most chaos still starts like a request, so the body paths are reached.
		msgs = append([]*extprocv3.ProcessingRequest{fuzzHeadersMsg(false, false,
			[2]string{":method", "POST"}, [2]string{":path", "/v1/chat/completions"})}, msgs...)
	}
	return msgs
}

func (g *fuzzGen) path(i int) string {
	switch i % 6 {
	case 0:
		return "/v1/chat/completions"
	case 1:
		return "/v1/completions"
	case 2:
		return "/v1/embeddings"
	case 3:
		return "/v1/chat/completions?api-version=1"
	case 4:
		return ""
	}
	return "/" + string(g.data.take(int(g.data.next())%16))
}

// body returns a request body: mostly the OpenAI shapes, some hostile, some raw data.
func (g *fuzzGen) body(template int, stream bool) []byte {
	s, _ := json.Marshal(string(g.data.take(int(g.data.next()))))
	switch template % 8 {
	case 0:
		return fmt.Appendf(nil, `{"model":"m","messages":[{"role":"user","content":%s}],"stream":%v,"max_tokens":5}`, s, stream)
	case 1:
		return fmt.Appendf(nil, `{"model":"m","prompt":%s,"stream":%v}`, s, stream)
	case 2: // everything a client must not steer with, duplicated, escaped and nested
		return fmt.Appendf(nil, `{"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"6.6.6.6"},"model":"m",`+
			`"messages":[{"role":"user","content":%s,"kv_transfer_params":{"nested":true}}],`+
			`"kv\u005ftransfer_params":{"remote_port":666},"bootstrap_host":"6.6.6.6","bootstrap_port":666,`+
			`"bootstrap_room":"x","bootstrap\u005froom":7,"stream":%v,"kv_transfer_params":null}`, s, stream)
	case 3:
		return g.data.take(int(g.data.next()) * 4)
	case 4:
		return nil
	case 5:
		return fmt.Appendf(nil, `{"model":"m","prompt":%s,"n":2}`, s)
	case 6:
		return fmt.Appendf(nil, `{"prompt":%s}`, s)
	}
	// Longer than one FULL_DUPLEX reply chunk (62,000 bytes).
	return fmt.Appendf(nil, `{"model":"m","prompt":"%s%s","stream":%v}`, strings.Repeat("a", 70_000), s[1:len(s)-1], stream)
}

func fuzzHeadersMsg(response, eos bool, hs ...[2]string) *extprocv3.ProcessingRequest {
	hm := &corev3.HeaderMap{}
	for _, h := range hs {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: h[0], RawValue: []byte(h[1])})
	}
	hh := &extprocv3.HttpHeaders{Headers: hm, EndOfStream: eos}
	if response {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hh}}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hh}}
}

func fuzzBodyMsg(response bool, b []byte, eos bool) *extprocv3.ProcessingRequest {
	hb := &extprocv3.HttpBody{Body: bytes.Clone(b), EndOfStream: eos}
	if response {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: hb}}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: hb}}
}

func fuzzTrailersMsg(response bool) *extprocv3.ProcessingRequest {
	ht := &extprocv3.HttpTrailers{Trailers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-checksum", RawValue: []byte("1")}}}}
	if response {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: ht}}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: ht}}
}

// fuzzChunks cuts b into n data frames as Envoy forwards them; an empty body is
// one empty frame (the HTTP/1 chunked terminator).
func fuzzChunks(response bool, b []byte, n int, eos bool) []*extprocv3.ProcessingRequest {
	size := max((len(b)+n-1)/n, 1)
	var out []*extprocv3.ProcessingRequest
	for i := 0; i < len(b) || len(out) == 0; i += size {
		end := min(i+size, len(b))
		out = append(out, fuzzBodyMsg(response, b[i:end], eos && end == len(b)))
	}
	return out
}

// ---------------------------------------------------------------- the run

// fuzzRecorder wraps the server side of the stream and logs, in the order the
// handler did them, every message it read and every reply it sent: each reply
// belongs to the last message read before it.
type fuzzRecorder struct {
	mu      sync.Mutex
	events  []fuzzEvent
	recvErr error // how the handler's last Recv failed
	ret     error // what Process returned
	done    chan struct{}
}

type fuzzEvent struct {
	recv *extprocv3.ProcessingRequest
	sent *extprocv3.ProcessingResponse
}

type fuzzServerStream struct {
	grpc.ServerStream
	rec *fuzzRecorder
}

func (s fuzzServerStream) RecvMsg(m any) error {
	err := s.ServerStream.RecvMsg(m)
	s.rec.mu.Lock()
	defer s.rec.mu.Unlock()
	if err != nil {
		s.rec.recvErr = err
		return err
	}
	s.rec.events = append(s.rec.events, fuzzEvent{recv: proto.Clone(m.(proto.Message)).(*extprocv3.ProcessingRequest)})
	return nil
}

func (s fuzzServerStream) SendMsg(m any) error {
	s.rec.mu.Lock()
	s.rec.events = append(s.rec.events, fuzzEvent{sent: proto.Clone(m.(proto.Message)).(*extprocv3.ProcessingResponse)})
	s.rec.mu.Unlock()
	return s.ServerStream.SendMsg(m)
}

func (r *fuzzRecorder) intercept(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if info.FullMethod != "/envoy.service.ext_proc.v3.ExternalProcessor/Process" {
		return handler(srv, ss)
	}
	defer close(r.done)
	err := handler(srv, fuzzServerStream{ss, r})
	r.mu.Lock()
	r.ret = err
	r.mu.Unlock()
	return err
}

// fuzzEngine is the fake prefill engine.
type fuzzEngine struct {
	*httptest.Server
	behaviour int
}

func newFuzzEngine(behaviour int) *fuzzEngine {
	e := &fuzzEngine{behaviour: behaviour}
	e.Server = httptest.NewServer(http.HandlerFunc(e.serve))
	return e
}

func (e *fuzzEngine) serve(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	params := func() {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"p","choices":[{"text":"a"}],"kv_transfer_params":`+fuzzPrefillParams+`}`)
	}
	switch e.behaviour {
	case prefillParams:
		params()
	case prefillNullParams:
		io.WriteString(w, `{"id":"p","kv_transfer_params":null}`)
	case prefillNoParams:
		io.WriteString(w, `{"id":"p"}`)
	case prefillArrayParams:
		io.WriteString(w, `{"id":"p","kv_transfer_params":[1,2]}`)
	case prefill5xx:
		http.Error(w, `{"error":"overloaded"}`, http.StatusServiceUnavailable)
	case prefill4xx:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, `{"object":"error","message":"bad","code":400}`)
	case prefill4xxNoType:
		w.Header()["Content-Type"] = nil
		w.WriteHeader(http.StatusUnprocessableEntity)
		io.WriteString(w, "unprocessable")
	case prefillSlow:
		t := time.NewTimer(3 * time.Millisecond)
		defer t.Stop()
		select {
		case <-t.C:
			params()
		case <-r.Context().Done():
		}
	case prefillHang:
		<-r.Context().Done()
	case prefillDrop:
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
		}
	case prefillGarbage:
		io.WriteString(w, "<html>not json")
	}
}

func (e *fuzzEngine) addr() string { return strings.TrimPrefix(e.URL, "http://") }

func runFuzzCase(t *testing.T, c *fuzzCase) {
	leaks := goleak.IgnoreCurrent()
	eng := newFuzzEngine(c.prefill)
	prefillAddrs := []string{eng.addr()}
	if c.prefill == prefillRefused {
		prefillAddrs[0] = "127.0.0.1:1"
	}
	var second *fuzzEngine
	if c.twoPrefills {
		second = newFuzzEngine(prefillParams)
		prefillAddrs = append(prefillAddrs, second.addr())
	}
	yaml := fmt.Sprintf("connector: %s\npools: {prefill: {endpoints: [%s], bootstrap_port: %d}, decode: {endpoints: [%s]}}\nprefill: {timeout: 50ms, on_failure: %s}\n",
		c.connector, fuzzQuote(prefillAddrs), fuzzBootstrapPort, fuzzQuote(fuzzDecodeEndpoints), map[bool]string{false: "decode-only", true: "fail"}[c.onFailureFail])
	if c.smallLimit {
		yaml += "limits: {max_body_bytes: 300}\n"
	}
	cfg, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatalf("config: %v\n%s", err, yaml)
	}
	log := logr.Discard()
	if c.verbose {
		log = funcr.New(func(string, string) {}, funcr.Options{Verbosity: 2})
	}
	var m *metrics.Metrics
	var popts []pipeline.Option
	if c.metrics {
		m = metrics.New(c.connector)
		popts = append(popts, pipeline.WithMetrics(m))
	}
	p, err := pipeline.New(cfg, log, popts...)
	if err != nil {
		t.Fatal(err)
	}
	rec := &fuzzRecorder{done: make(chan struct{})}
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer(grpc.StreamInterceptor(rec.intercept), grpc.WaitForHandlers(true), grpc.MaxRecvMsgSize(int(cfg.Limits.MaxBodyBytes)+1<<20))
	extprocv3.RegisterExternalProcessorServer(srv, handlers.NewServer(p, handlers.Options{
		OverrideAfter: c.overrideAfter, OverrideTimeout: 90 * time.Second, Metrics: m, LogPrompts: c.verbose,
	}, log))
	served := make(chan struct{})
	go func() { srv.Serve(lis); close(served) }()
	conn, err := grpc.NewClient("passthrough:///bufconn", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), fuzzStreamBound)
	replies := make(chan int, 1)
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	go func() { // Envoy reads every reply until the stream ends
		n := 0
		for {
			if _, err := stream.Recv(); err != nil {
				replies <- n
				return
			}
			n++
		}
	}()
	reset := false
	for i, msg := range c.msgs {
		if i == c.cancelAt {
			cancel()
			reset = true
			break
		}
		if stream.Send(msg) != nil {
			break // the server ended the stream (an ImmediateResponse)
		}
	}
	if !reset {
		// Envoy's graceful close: a half-close, seen as EOF. The handler must
		// end by itself.
		stream.CloseSend()
		select {
		case <-rec.done:
		case <-time.After(fuzzStreamBound):
			t.Fatalf("deadlock: Process has not returned %v after the half-close\n%s", fuzzStreamBound, fuzzTrace(c, rec))
		}
	}
	select {
	case <-replies:
	case <-time.After(fuzzStreamBound):
		t.Fatalf("the client stream did not end after %v\n%s", fuzzStreamBound, fuzzTrace(c, rec))
	}
	cancel()
	conn.Close()
	// After a reset the handler may or may not have started; Stop waits for
	// any that did (WaitForHandlers).
	stopped := make(chan struct{})
	go func() { srv.Stop(); <-served; close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(fuzzStreamBound):
		t.Fatalf("deadlock: a handler still runs %v after the stream was reset\n%s", fuzzStreamBound, fuzzTrace(c, rec))
	}
	waited := make(chan struct{})
	go func() { p.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(fuzzStreamBound):
		t.Fatalf("background prefill legs still running after %v", fuzzStreamBound)
	}
	eng.CloseClientConnections()
	eng.Close()
	if second != nil {
		second.CloseClientConnections()
		second.Close()
	}
	if err := goleak.Find(leaks); err != nil {
		t.Fatalf("goroutines outlived the stream: %v\n%s", err, fuzzTrace(c, rec))
	}

	rec.mu.Lock()
	defer rec.mu.Unlock()
	if problems := checkFuzzExchange(c, rec, reset); len(problems) > 0 {
		t.Fatalf("%s\n%s", strings.Join(problems, "\n"), fuzzTrace(c, rec))
	}
}

func fuzzQuote(addrs []string) string {
	q := make([]string, len(addrs))
	for i, a := range addrs {
		q[i] = strconv.Quote(a)
	}
	return strings.Join(q, ", ")
}

// fuzzTrace prints the case and what the handler read and sent, for a failure.
func fuzzTrace(c *fuzzCase, rec *fuzzRecorder) string {
	var b strings.Builder
	fmt.Fprintf(&b, "case: connector=%s prefill=%d fail=%v smallLimit=%v override=%v cancelAt=%d, %d messages\n",
		c.connector, c.prefill, c.onFailureFail, c.smallLimit, c.overrideAfter, c.cancelAt, len(c.msgs))
	for _, e := range rec.events {
		if e.recv != nil {
			fmt.Fprintf(&b, "  -> %.300s\n", e.recv.String())
		} else {
			fmt.Fprintf(&b, "  <- %.300s\n", e.sent.String())
		}
	}
	fmt.Fprintf(&b, "  recv error: %v; Process returned: %v\n", rec.recvErr, rec.ret)
	return b.String()
}

// ---------------------------------------------------------------- the checker

type fuzzKind int

const (
	fuzzHeaders fuzzKind = iota + 1
	fuzzBody
	fuzzTrailers
)

// fuzzDirection is Envoy's view of one direction (§1.7, §10): what it sent,
// and what it is owed.
type fuzzDirection struct {
	name                   string
	mode                   filterv3.ProcessingMode_BodySendMode
	hdrSent, hdrEOS        bool
	bodyMsgs               int
	bodyEOS, trailersSent  bool
	degraded               string     // why only the always-rules apply from now on
	pending                []fuzzKind // non-FULL_DUPLEX: messages awaiting their one reply, in order
	hdrReplied, eosReplied bool
	trailersReplied        bool
	sentBody, repliedBody  []byte                        // body bytes Envoy sent, and the body the replies carry
	bodyReplaced           bool                          // a BUFFERED reply carried a new body
	headers                []*corev3.HeaderValue         // what the request headers message carried
	routing                *extprocv3.ProcessingResponse // the reply that carried the destination
	anyEOSReplied          bool
}

func (d *fuzzDirection) fullDuplex() bool {
	return d.mode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

func (d *fuzzDirection) sendsBody() bool {
	switch d.mode {
	case filterv3.ProcessingMode_STREAMED, filterv3.ProcessingMode_BUFFERED,
		filterv3.ProcessingMode_BUFFERED_PARTIAL, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return true
	}
	return false
}

func (d *fuzzDirection) oneBodyMessage() bool {
	return d.mode == filterv3.ProcessingMode_BUFFERED || d.mode == filterv3.ProcessingMode_BUFFERED_PARTIAL
}

func (d *fuzzDirection) degrade(why string) {
	if d.degraded == "" {
		d.degraded = why
	}
}

type fuzzChecker struct {
	c         *fuzzCase
	req, resp *fuzzDirection
	problems  []string
	first     *extprocv3.ProtocolConfiguration
	received  int
	ignorable bool // the message being answered must get no reply
	overrides int  // override_message_timeout replies to the message being answered
	immediate bool
	subset    []string // the endpoints the request's subset hint allows
	hasSubset bool
}

func (k *fuzzChecker) fail(format string, args ...any) {
	k.problems = append(k.problems, fmt.Sprintf("message %d: ", k.received)+fmt.Sprintf(format, args...))
}

func checkFuzzExchange(c *fuzzCase, rec *fuzzRecorder, reset bool) []string {
	k := &fuzzChecker{c: c, req: &fuzzDirection{name: "request"}, resp: &fuzzDirection{name: "response"}}
	for i, e := range rec.events {
		if e.recv != nil {
			if i == 0 {
				k.req.mode, k.resp.mode = e.recv.GetProtocolConfig().GetRequestBodyMode(), e.recv.GetProtocolConfig().GetResponseBodyMode()
				k.first = e.recv.GetProtocolConfig()
			}
			k.received++
			k.onMessage(e.recv)
			continue
		}
		k.onReply(e.sent)
	}
	if rec.ret != nil && !reset {
		k.fail("Process returned %v: Envoy answers a non-OK stream with a 500", rec.ret)
	}
	// Owed replies: only when Envoy half-closed after its last message and no
	// ImmediateResponse ended the exchange.
	if !reset && !k.immediate && errors.Is(rec.recvErr, io.EOF) {
		for _, d := range []*fuzzDirection{k.req, k.resp} {
			k.owed(d)
		}
		k.checkRouting()
	}
	return k.problems
}

// onMessage updates Envoy's state with a message it sent, classifying it.
func (k *fuzzChecker) onMessage(m *extprocv3.ProcessingRequest) {
	k.ignorable, k.overrides = false, 0
	if pc := m.GetProtocolConfig(); pc != nil && k.received > 1 && !proto.Equal(pc, k.first) {
		// Envoy sends protocol_config on the first message only (§1.2).
		k.req.degrade("a later protocol_config changed the modes")
		k.resp.degrade("a later protocol_config changed the modes")
	}
	var d *fuzzDirection
	switch m.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders, *extprocv3.ProcessingRequest_RequestBody, *extprocv3.ProcessingRequest_RequestTrailers:
		d = k.req
	case *extprocv3.ProcessingRequest_ResponseHeaders, *extprocv3.ProcessingRequest_ResponseBody, *extprocv3.ProcessingRequest_ResponseTrailers:
		d = k.resp
	default:
		return // no oneof: nothing to answer, no state changed
	}
	switch {
	case m.GetRequestHeaders() != nil || m.GetResponseHeaders() != nil:
		h := m.GetRequestHeaders()
		if h == nil {
			h = m.GetResponseHeaders()
		}
		if d.hdrSent {
			d.degrade("headers sent twice")
			return
		}
		d.hdrSent, d.hdrEOS = true, h.GetEndOfStream()
		d.headers = h.GetHeaders().GetHeaders()
		if d == k.req {
			k.subset, k.hasSubset = fuzzSubsetOf(m.GetMetadataContext())
		}
		if !d.fullDuplex() {
			d.pending = append(d.pending, fuzzHeaders)
		}
	case m.GetRequestBody() != nil || m.GetResponseBody() != nil:
		b := m.GetRequestBody()
		if b == nil {
			b = m.GetResponseBody()
		}
		switch {
		case d.bodyEOS && d.degraded == "":
			// envoy#46237: the end of the body again. It must be dropped.
			k.ignorable = true
			return
		case !d.hdrSent, d.hdrEOS, d.bodyEOS, d.trailersSent, !d.sendsBody(), d.oneBodyMessage() && d.bodyMsgs > 0:
			d.degrade(fmt.Sprintf("a body Envoy would not send (mode %s)", d.mode))
			return
		}
		d.bodyMsgs++
		d.bodyEOS = b.GetEndOfStream()
		d.sentBody = append(d.sentBody, b.GetBody()...)
		if !d.fullDuplex() {
			d.pending = append(d.pending, fuzzBody)
		}
	default: // trailers
		if !d.hdrSent || d.hdrEOS || d.bodyEOS || d.trailersSent || (d.oneBodyMessage() && d.bodyMsgs != 1) {
			d.degrade("trailers Envoy would not send")
			return
		}
		d.trailersSent = true
		if !d.fullDuplex() {
			d.pending = append(d.pending, fuzzTrailers)
		}
	}
}

// onReply checks one reply against Envoy's state.
func (k *fuzzChecker) onReply(r *extprocv3.ProcessingResponse) {
	if k.immediate {
		k.fail("a reply after the ImmediateResponse: %v", r)
		return
	}
	if k.ignorable {
		k.fail("a reply to a repeated end of the body, which must be dropped (envoy#46237): %v", r)
	}
	if ot := r.GetOverrideMessageTimeout(); ot != nil {
		switch {
		case r.Response != nil:
			k.fail("override_message_timeout together with a %T: Envoy ignores every other field of the message, so that reply is lost", r.Response)
		case ot.AsDuration() < time.Millisecond:
			k.fail("override_message_timeout %v is below Envoy's 1 ms minimum", ot.AsDuration())
		}
		k.overrides++
		if k.overrides > 1 {
			k.fail("%d override_message_timeout replies to one message: Envoy honours one per call", k.overrides)
		}
		if !k.timedCallPending() {
			k.fail("override_message_timeout while no timed (non-FULL_DUPLEX) call is outstanding")
		}
		return
	}
	k.checkDynamicMetadata(r)
	switch x := r.Response.(type) {
	case nil:
		k.fail("a reply with no oneof and no override_message_timeout is spurious (§7.3)")
	case *extprocv3.ProcessingResponse_RequestHeaders:
		k.headersReply(k.req, x.RequestHeaders.GetResponse(), r)
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		k.headersReply(k.resp, x.ResponseHeaders.GetResponse(), r)
	case *extprocv3.ProcessingResponse_RequestBody:
		k.bodyReply(k.req, x.RequestBody.GetResponse(), r)
	case *extprocv3.ProcessingResponse_ResponseBody:
		k.bodyReply(k.resp, x.ResponseBody.GetResponse(), r)
	case *extprocv3.ProcessingResponse_RequestTrailers:
		k.checkMutation("request trailers reply", x.RequestTrailers.GetHeaderMutation())
		k.trailersReply(k.req)
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		k.checkMutation("response trailers reply", x.ResponseTrailers.GetHeaderMutation())
		k.trailersReply(k.resp)
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		k.immediate = true
		ir := x.ImmediateResponse
		if code := ir.GetStatus().GetCode(); code < 400 || code > 599 {
			k.fail("ImmediateResponse status %d: errors must be 4xx or 5xx", code)
		}
		k.checkMutation("ImmediateResponse", ir.GetHeaders())
		if ir.GetGrpcStatus() != nil {
			k.fail("ImmediateResponse carries a grpc_status for an HTTP request")
		}
	default:
		k.fail("unsupported reply %T: this Envoy treats it as spurious", r.Response)
	}
}

func (k *fuzzChecker) timedCallPending() bool {
	for _, d := range []*fuzzDirection{k.req, k.resp} {
		if !d.fullDuplex() && (len(d.pending) > 0 || d.degraded != "") {
			return true
		}
	}
	return false
}

func (k *fuzzChecker) headersReply(d *fuzzDirection, cr *extprocv3.CommonResponse, r *extprocv3.ProcessingResponse) {
	k.checkMutation(d.name+" headers reply", cr.GetHeaderMutation())
	k.checkBodyMutationOutsideBody(d, cr)
	k.noteRouting(d, cr, r)
	if d.degraded != "" {
		return
	}
	if cr.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE {
		k.fail("%s headers reply with CONTINUE_AND_REPLACE: it drops the body and Content-Length (§3.1)", d.name)
	}
	if d.fullDuplex() {
		if !d.hdrSent || d.hdrReplied {
			k.fail("%s headers reply while Envoy waits for none (sent %v, already answered %v): spurious (§7.3)", d.name, d.hdrSent, d.hdrReplied)
		}
		d.hdrReplied = true
		return
	}
	k.pop(d, fuzzHeaders)
	d.hdrReplied = true
}

func (k *fuzzChecker) bodyReply(d *fuzzDirection, cr *extprocv3.CommonResponse, r *extprocv3.ProcessingResponse) {
	k.checkMutation(d.name+" body reply", cr.GetHeaderMutation())
	sr := cr.GetBodyMutation().GetStreamedResponse()
	// Always: one end per direction, nothing after it.
	if d.anyEOSReplied {
		k.fail("%s body reply after the one that ended the body: spurious (§2.6 rule 5)", d.name)
	}
	if sr.GetEndOfStream() {
		d.anyEOSReplied = true
	}
	if sr != nil && d == k.req && len(sr.GetBody()) > 64<<10 {
		k.fail("request body reply chunk of %d bytes: over the 64 KiB Envoy recommends", len(sr.GetBody()))
	}
	k.noteRouting(d, cr, r)
	if d.degraded != "" {
		return
	}
	if d.fullDuplex() {
		switch {
		case !d.hdrReplied:
			k.fail("%s body reply before the headers reply in FULL_DUPLEX: spurious, 500 (§2.6 rule 1)", d.name)
		case sr == nil:
			k.fail("%s FULL_DUPLEX body reply without streamed_response: spurious, 500 (§2.6 rule 3)", d.name)
		case sr.GetEndOfStream() && !d.bodyEOS && !d.trailersSent:
			k.fail("%s end_of_stream reply before Envoy ended the body (§2.6 rule 5)", d.name)
		case d.eosReplied:
			k.fail("%s body reply after end_of_stream (§2.6 rule 5)", d.name)
		}
		if sr.GetEndOfStream() {
			d.eosReplied = true
		}
		d.repliedBody = append(d.repliedBody, sr.GetBody()...)
		return
	}
	if sr != nil {
		k.fail("%s streamed_response outside FULL_DUPLEX (mode %s): spurious in STREAMED, a no-op otherwise (§3.4)", d.name, d.mode)
	}
	k.pop(d, fuzzBody)
	if b, ok := cr.GetBodyMutation().GetMutation().(*extprocv3.BodyMutation_Body); ok {
		d.repliedBody, d.bodyReplaced = b.Body, true
	} else {
		d.repliedBody = d.sentBody // Envoy forwards the body it buffered
	}
}

func (k *fuzzChecker) trailersReply(d *fuzzDirection) {
	if d.degraded != "" {
		return
	}
	if d.fullDuplex() {
		if !d.trailersSent || d.trailersReplied || !d.hdrReplied {
			k.fail("%s trailers reply while Envoy waits for none: spurious (§7.3)", d.name)
		}
		d.trailersReplied = true
		return
	}
	k.pop(d, fuzzTrailers)
}

// pop matches a non-FULL_DUPLEX reply with the oldest message awaiting one.
func (k *fuzzChecker) pop(d *fuzzDirection, kind fuzzKind) {
	names := map[fuzzKind]string{fuzzHeaders: "headers", fuzzBody: "body", fuzzTrailers: "trailers"}
	if len(d.pending) == 0 {
		k.fail("%s %s reply while Envoy waits for nothing in that direction (mode %s): spurious (§7.3)", d.name, names[kind], d.mode)
		return
	}
	if d.pending[0] != kind {
		k.fail("%s %s reply while Envoy waits for the %s reply: spurious (§7.3)", d.name, names[kind], names[d.pending[0]])
	}
	d.pending = d.pending[1:]
}

// owed checks nothing is left unanswered once Envoy half-closed.
func (k *fuzzChecker) owed(d *fuzzDirection) {
	if d.degraded != "" {
		return
	}
	if !d.fullDuplex() {
		if len(d.pending) > 0 {
			k.fail("%s: %d message(s) never answered (mode %s): Envoy would wait until its message timeout", d.name, len(d.pending), d.mode)
		}
		return
	}
	switch {
	case d.hdrSent && (d.hdrEOS || d.bodyEOS || d.trailersSent || d == k.resp) && !d.hdrReplied:
		k.fail("%s: the headers reply never came", d.name)
	case d.bodyEOS && !d.trailersSent && !d.eosReplied:
		k.fail("%s: the body ended but no end_of_stream reply came: Envoy would wait forever (FULL_DUPLEX has no message timer)", d.name)
	case d.trailersSent && !d.trailersReplied:
		k.fail("%s: the trailers reply never came", d.name)
	}
	if d == k.resp && !bytes.Equal(d.sentBody, d.repliedBody) {
		k.fail("response body echoed as %q, want %q unchanged", d.repliedBody, d.sentBody)
	}
}

// noteRouting keeps the reply that carries the destination.
func (k *fuzzChecker) noteRouting(d *fuzzDirection, cr *extprocv3.CommonResponse, r *extprocv3.ProcessingResponse) {
	dest, ok := fuzzSetHeader(cr.GetHeaderMutation(), handlers.DestinationHeader)
	if !ok {
		return
	}
	if d != k.req {
		k.fail("destination header on a response-path reply")
		return
	}
	if d.routing != nil {
		k.fail("a second routing reply")
	}
	d.routing = r
	if !cr.GetClearRouteCache() {
		k.fail("routing reply without clear_route_cache: Envoy keeps the route it cached at decodeHeaders (§3.6)")
	}
	if k.hasSubset && !slices.Contains(k.subset, dest) {
		k.fail("routed to %s, outside the subset hint %v (§8.2)", dest, k.subset)
	}
	md := r.GetDynamicMetadata().GetFields()[handlers.DestinationMetadata].GetStructValue().GetFields()[handlers.DestinationHeader].GetStringValue()
	if md != dest {
		k.fail("destination header %q but envoy.lb metadata %q: both must name the same endpoint (§8.2)", dest, md)
	}
}

func (k *fuzzChecker) checkDynamicMetadata(r *extprocv3.ProcessingResponse) {
	for ns, v := range r.GetDynamicMetadata().GetFields() {
		if v.GetStructValue() == nil {
			k.fail("dynamic_metadata namespace %q is not a Struct: Envoy drops it (§3.7)", ns)
		}
	}
}

// checkBodyMutationOutsideBody: a body mutation in a CONTINUE headers reply is ignored.
func (k *fuzzChecker) checkBodyMutationOutsideBody(d *fuzzDirection, cr *extprocv3.CommonResponse) {
	if cr.GetBodyMutation() != nil && cr.GetStatus() != extprocv3.CommonResponse_CONTINUE_AND_REPLACE {
		k.fail("%s headers reply carries a body mutation Envoy ignores (§3.4)", d.name)
	}
}

// checkMutation applies the always-rules of §3.2–§3.3 to a header mutation.
func (k *fuzzChecker) checkMutation(where string, m *extprocv3.HeaderMutation) {
	for _, h := range m.GetSetHeaders() {
		hv := h.GetHeader()
		key := hv.GetKey()
		switch {
		case hv == nil:
			k.fail("%s: a set_headers entry without a header", where)
			continue
		case hv.GetValue() != "":
			k.fail("%s: %s set in value (%q): Envoy reads raw_value only, and both set is a 500 (§3.2)", where, key, hv.GetValue())
		case len(hv.GetRawValue()) == 0:
			k.fail("%s: %s set to an empty value", where, key)
		case !fuzzValidHeaderName(key):
			k.fail("%s: invalid header name %q", where, key)
		case bytes.ContainsAny(hv.GetRawValue(), "\r\n\x00"):
			k.fail("%s: %s value %q has characters Envoy rejects (500)", where, key, hv.GetRawValue())
		case key == ":authority" || key == ":method" || key == ":scheme" || key == "host" || strings.HasPrefix(key, "x-envoy-"):
			k.fail("%s: %s may not be mutated under the default rules (§3.3)", where, key)
		}
		if h.GetAppend().GetValue() {
			k.fail("%s: %s appended: a client's own value would stay next to ours", where, key)
		}
		if key == handlers.DestinationHeader && !fuzzIsDecodeEndpoint(string(hv.GetRawValue())) {
			k.fail("%s: destination %q is not a configured decode endpoint", where, hv.GetRawValue())
		}
	}
	for _, name := range m.GetRemoveHeaders() {
		if strings.HasPrefix(name, ":") || name == "host" {
			k.fail("%s: removing %s, which Envoy never allows", where, name)
		}
	}
}

// checkRouting checks the routing of a request that ran to its end.
func (k *fuzzChecker) checkRouting() {
	d := k.req
	if d.degraded != "" || !d.hdrSent {
		return
	}
	bodyless := d.hdrEOS || d.mode == filterv3.ProcessingMode_NONE
	complete := bodyless || d.bodyEOS || d.trailersSent
	if !complete {
		return
	}
	if d.routing == nil {
		k.fail("the request ended without a routing reply or an ImmediateResponse")
		return
	}
	cr := fuzzCommon(d.routing)
	if want, ok := fuzzSingleHeader(d.headers, "x-request-id"); ok && want != "" {
		if got, _ := fuzzSetHeader(cr.GetHeaderMutation(), "x-request-id"); got != want {
			k.fail("x-request-id %q, want the client's %q on both legs", got, want)
		}
	} else if _, ok := fuzzSetHeader(cr.GetHeaderMutation(), "x-request-id"); !ok && len(fuzzAllHeaders(d.headers, "x-request-id")) < 2 {
		k.fail("routing reply without an x-request-id")
	}
	if bodyless {
		return
	}
	cl, hasCL := fuzzSetHeader(cr.GetHeaderMutation(), "content-length")
	if d.mode == filterv3.ProcessingMode_BUFFERED {
		if d.routing.GetRequestBody() == nil {
			k.fail("BUFFERED routing must be in the body reply, while Envoy still holds the headers (§2.11)")
		}
		client := fuzzAllHeaders(d.headers, "content-length")
		valid := len(client) == 1 && fuzzIsUint(client[0])
		switch {
		case valid && d.bodyReplaced && cl != strconv.Itoa(len(d.repliedBody)):
			k.fail("BUFFERED body reply: content-length %q for a %d-byte body: Envoy answers 500 on a mismatch (§3.5)", cl, len(d.repliedBody))
		case len(client) == 0 && hasCL:
			k.fail("BUFFERED body reply sets content-length %q on a chunked request", cl)
		}
	}
	if hasCL && cl != strconv.Itoa(len(d.repliedBody)) {
		k.fail("content-length %q for a %d-byte body", cl, len(d.repliedBody))
	}
	k.checkDecodeBody(d.repliedBody)
}

// checkDecodeBody: whatever the client sent, the reserved keys the decode
// engine reads at the top level are ours (§5).
func (k *fuzzChecker) checkDecodeBody(b []byte) {
	var top map[string]json.RawMessage
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	if err := d.Decode(&top); err != nil || top == nil {
		k.fail("routed decode body is not a JSON object (%v): %.200q", err, b)
		return
	}
	keep := map[string]bool{}
	switch k.c.connector {
	case "kv-nixl":
		if raw, ok := top["kv_transfer_params"]; ok {
			keep["kv_transfer_params"] = true
			if !fuzzJSONEqual(raw, []byte(fuzzPrefillParams)) {
				k.fail("decode body kv_transfer_params %s, want the prefill engine's", raw)
			}
		}
	case "kv-sglang":
		if _, ok := top["bootstrap_room"]; ok {
			for _, key := range []string{"bootstrap_host", "bootstrap_port", "bootstrap_room"} {
				keep[key] = true
			}
			if string(top["bootstrap_host"]) != `"127.0.0.1"` || string(top["bootstrap_port"]) != strconv.Itoa(fuzzBootstrapPort) {
				k.fail("decode body bootstrap %s:%s, want the chosen prefill's 127.0.0.1:%d", top["bootstrap_host"], top["bootstrap_port"], fuzzBootstrapPort)
			}
			if n, err := strconv.ParseUint(string(top["bootstrap_room"]), 10, 63); err != nil || n > 1<<63-1 {
				k.fail("decode body bootstrap_room %s, want an integer 0..2^63-1", top["bootstrap_room"])
			}
		}
	}
	for _, key := range []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"} {
		if _, ok := top[key]; ok && !keep[key] {
			k.fail("client-supplied %s reached the decode body: %s", key, top[key])
		}
	}
}

// fuzzSubsetOf reads a subset hint as the endpoint-picker protocol defines it:
// a list of ip:port (lwepp also takes one comma-separated string); anything
// else allows nothing.
func fuzzSubsetOf(md *corev3.Metadata) ([]string, bool) {
	ns, ok := md.GetFilterMetadata()[handlers.SubsetHintNamespace]
	if !ok {
		return nil, false
	}
	v, ok := ns.GetFields()[handlers.SubsetHintKey]
	if !ok {
		return nil, false
	}
	var out []string
	switch x := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		for _, p := range strings.Split(x.StringValue, ",") {
			out = append(out, strings.TrimSpace(p))
		}
	case *structpb.Value_ListValue:
		for _, e := range x.ListValue.GetValues() {
			s, ok := e.GetKind().(*structpb.Value_StringValue)
			if !ok {
				return nil, true
			}
			out = append(out, s.StringValue)
		}
	}
	return out, true
}

func fuzzCommon(r *extprocv3.ProcessingResponse) *extprocv3.CommonResponse {
	if h := r.GetRequestHeaders(); h != nil {
		return h.GetResponse()
	}
	return r.GetRequestBody().GetResponse()
}

func fuzzSetHeader(m *extprocv3.HeaderMutation, key string) (string, bool) {
	for _, h := range m.GetSetHeaders() {
		if h.GetHeader().GetKey() == key {
			return string(h.GetHeader().GetRawValue()), true
		}
	}
	return "", false
}

func fuzzAllHeaders(hs []*corev3.HeaderValue, key string) []string {
	var out []string
	for _, h := range hs {
		if h.GetKey() == key {
			out = append(out, string(h.GetRawValue()))
		}
	}
	return out
}

func fuzzSingleHeader(hs []*corev3.HeaderValue, key string) (string, bool) {
	all := fuzzAllHeaders(hs, key)
	if len(all) != 1 {
		return "", false
	}
	return all[0], true
}

func fuzzIsUint(s string) bool {
	_, err := strconv.ParseUint(s, 10, 64)
	return err == nil
}

func fuzzIsDecodeEndpoint(addr string) bool {
	for _, e := range fuzzDecodeEndpoints {
		if e == addr {
			return true
		}
	}
	return false
}

func fuzzValidHeaderName(key string) bool {
	if key == "" || key != strings.ToLower(key) {
		return false
	}
	name := strings.TrimPrefix(key, ":")
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || strings.ContainsRune("!#$%&'*+-.^_`|~", c)) {
			return false
		}
	}
	return name != ""
}

func fuzzJSONEqual(a, b []byte) bool {
	var x, y any
	da, db := json.NewDecoder(bytes.NewReader(a)), json.NewDecoder(bytes.NewReader(b))
	da.UseNumber()
	db.UseNumber()
	if da.Decode(&x) != nil || db.Decode(&y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}

// ---------------------------------------------------------------- seeds

// fuzzSeed builds an input from control bytes (by offset) and data.
func fuzzSeed(ctl map[int]byte, data string) []byte {
	in := make([]byte, fuzzCtlLen, fuzzCtlLen+len(data))
	for off, v := range ctl {
		in[off] = v
	}
	return append(in, data...)
}

// Indexes in fuzzModes.
const (
	modeNone = iota
	modeStreamed
	modeBuffered
	modePartial
	modeDuplex
	modeGRPC
	modeFuture
)

// fuzzSeeds are the sequences Envoy really sends, per mode and connector, and
// the known traps; the fuzzer mutates from here.
func fuzzSeeds() [][]byte {
	const prompt = "\x05hello" // a 5-byte prompt read from the data
	var seeds [][]byte
	for conn := range byte(3) {
		for _, mode := range []byte{modeDuplex, modeBuffered} {
			// chat, streamed, 3 chunks, content-length, x-request-id, response path echoed.
			seeds = append(seeds, fuzzSeed(map[int]byte{ctlConnector: conn, ctlReqMode: mode, ctlRespMode: modeDuplex,
				ctlChunks: 2, ctlExtra: 1 | 32 | 128, ctlRespChunks: 3 | 2<<2}, "\x04req1"+prompt))
		}
	}
	for _, s := range []map[int]byte{
		{ctlReqMode: modeDuplex, ctlBody: 2, ctlExtra: 8 | 32, ctlRespChunks: 2},                          // hostile body and destination header
		{ctlReqMode: modeBuffered, ctlBody: 2, ctlConnector: 2, ctlLength: 1},                             // hostile, chunked BUFFERED, sglang
		{ctlReqMode: modeDuplex, ctlBody: 7, ctlChunks: 5},                                                // 70 KB body: several reply chunks
		{ctlReqMode: modeBuffered, ctlBody: 7, ctlLength: 0},                                              // 70 KB BUFFERED with content-length
		{ctlReqMode: modeDuplex, ctlExtra: 16 | 32 | 64, ctlRespChunks: 2},                                // trailers both ways
		{ctlReqMode: modeBuffered, ctlExtra: 16, ctlRespMode: modeNone},                                   // BUFFERED with trailers
		{ctlReqMode: modeDuplex, ctlPerturb: 1, ctlOps: 0},                                                // envoy#46237: final chunk twice
		{ctlReqMode: modeDuplex, ctlExtra: 32, ctlRespChunks: 1, ctlPerturb: 1, ctlOps: 4, ctlOps + 1: 9}, // response body after its end
		{ctlReqMode: modeBuffered, ctlPrefill: prefillSlow, ctlOptions: 1 << 5},                           // override_message_timeout
		{ctlReqMode: modePartial, ctlPrefill: prefillSlow, ctlOptions: 1 << 5},                            // BUFFERED_PARTIAL whole body
		{ctlReqMode: modePartial, ctlChunks: 128},                                                         // BUFFERED_PARTIAL cut at the limit
		{ctlReqMode: modeStreamed},                                                                        // unsupported mode: 500
		{ctlReqMode: modeGRPC},                                                                            // not implemented in Envoy
		{ctlReqMode: modeFuture, ctlRespMode: modeFuture, ctlExtra: 32, ctlRespChunks: 1},                 // unknown modes
		{ctlReqMode: modeNone, ctlExtra: 32, ctlRespMode: modeBuffered, ctlRespChunks: 1},                 // NONE routes from headers
		{ctlReqMode: modeDuplex, ctlPath: 8},                                                              // GET without a body
		{ctlReqMode: modeDuplex, ctlPath: 2},                                                              // unknown path: 404
		{ctlReqMode: modeDuplex, ctlBody: 3},                                                              // raw data body: 400
		{ctlReqMode: modeDuplex, ctlBody: 6},                                                              // no model: 400
		{ctlReqMode: modeDuplex, ctlBody: 5},                                                              // n=2: decode-only
		{ctlReqMode: modeDuplex, ctlBody: 4, ctlLength: 1},                                                // empty chunked body
		{ctlReqMode: modeDuplex, ctlOptions: 2, ctlBody: 7},                                               // over a 300-byte limit: 413 at the headers
		{ctlReqMode: modeDuplex, ctlOptions: 2, ctlBody: 7, ctlLength: 1, ctlChunks: 7},                   // chunked, growing over the limit
		{ctlReqMode: modeBuffered, ctlLength: 2},                                                          // content-length off by one
		{ctlReqMode: modeBuffered, ctlLength: 4},                                                          // two content-length headers
		{ctlReqMode: modeDuplex, ctlPrefill: prefill5xx, ctlOptions: 4},                                   // retry on the second endpoint
		{ctlReqMode: modeDuplex, ctlPrefill: prefill5xx, ctlOptions: 1},                                   // on_failure fail: 502
		{ctlReqMode: modeBuffered, ctlPrefill: prefill4xx},                                                // engine 4xx passed on
		{ctlReqMode: modeBuffered, ctlPrefill: prefill4xxNoType},                                          // engine 4xx without a content-type
		{ctlReqMode: modeDuplex, ctlPrefill: prefillHang},                                                 // prefill timeout
		{ctlReqMode: modeDuplex, ctlPrefill: prefillHang, ctlConnector: 2, ctlStyle: 2 | 2<<2},            // sglang leg outlives a reset stream
		{ctlReqMode: modeDuplex, ctlPrefill: prefillDrop},                                                 // connection dropped
		{ctlReqMode: modeDuplex, ctlPrefill: prefillRefused, ctlOptions: 1},                               // refused, on_failure fail: 503
		{ctlReqMode: modeDuplex, ctlPrefill: prefillNullParams},                                           // no params: decode recomputes
		{ctlReqMode: modeDuplex, ctlPrefill: prefillArrayParams},
		{ctlReqMode: modeDuplex, ctlPrefill: prefillGarbage},
		{ctlReqMode: modeDuplex, ctlPrefill: prefillNoParams, ctlOptions: 8 | 16},                   // verbose logs and metrics
		{ctlReqMode: modeDuplex, ctlStyle: 2 | 1<<2, ctlPrefill: prefillHang},                       // reset after the headers
		{ctlReqMode: modeBuffered, ctlStyle: 2 | 2<<2, ctlPrefill: prefillHang, ctlOptions: 1 << 5}, // reset during the prefill leg
		{ctlStyle: 1, ctlPerturb: 8, ctlOps: 1, ctlOps + 1: 1, ctlOps + 2: 1, ctlOps + 3: 0, ctlOps + 4: 2, ctlOps + 6: 3, ctlOps + 8: 4, ctlOps + 9: 1, ctlOps + 10: 5, ctlOps + 12: 6, ctlOps + 14: 1, ctlOps + 15: 3}, // chaos
	} {
		seeds = append(seeds, fuzzSeed(s, "\x04req2"+prompt))
	}
	return seeds
}

// TestEngineErrorWithoutContentTypeSetsNoEmptyHeader: a prefill engine's 4xx
// without a Content-Type reaches the client with Envoy's own local-reply
// content type, not an empty content-type header (found by FuzzProcess).
func TestEngineErrorWithoutContentTypeSetsNoEmptyHeader(t *testing.T) {
	c := decodeFuzzCase(fuzzSeed(map[int]byte{ctlReqMode: modeBuffered, ctlPrefill: prefill4xxNoType}, "\x05hello"))
	runFuzzCase(t, c)
}
