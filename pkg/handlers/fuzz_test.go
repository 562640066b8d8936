package handlers_test

import (
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// FuzzProcess drives one Process stream per input over real gRPC (bufconn)
// with a fake prefill engine behind the pipeline, and checks what a real Envoy
// would make of the replies (docs/envoy.md §2, §3.5, §7.3, §10):
//
//   - the server never panics, every stream ends within fuzzStreamBound, and
//     nothing it started outlives the stream (goleak);
//   - every reply is well formed whatever the input: a oneof, or
//     override_message_timeout alone; header mutations in raw_value only, never
//     touching routing or x-envoy headers; the destination a configured decode
//     endpoint, the same in header and envoy.lb metadata; end_of_stream at most
//     once per direction and nothing after it; an ImmediateResponse last;
//   - for the messages Envoy can send (most inputs are built to look like
//     Envoy's own sequences) Envoy accepts every reply whole, by the reply
//     rules the emulator runs on (internal/envoyemu/rules): in FULL_DUPLEX the
//     headers reply before body replies, body replies only as
//     streamed_response; in other modes exactly one reply per message, in
//     order, unless an ImmediateResponse ends the stream; an
//     override_message_timeout only for a running timer, once per call; a
//     replaced BUFFERED body matching the Content-Length Envoy holds; and
//     nothing is owed when the stream ends;
//   - beyond Envoy's rules, our own: FULL_DUPLEX end_of_stream only after
//     Envoy's; a BUFFERED body reply that replaces the body sets
//     Content-Length to the new body's size exactly when the client sent one;
//     the response path is echoed byte for byte; and no client-supplied
//     kv_transfer_params or bootstrap_* reaches the decode body.
//
// Messages Envoy never sends in that state are fed too. A body after the
// direction's end_of_stream is the one Envoy really does send (envoy#46237) and
// must get no reply. Anything else (duplicate headers, a body in NONE mode, a
// second protocol_config, ...) takes that direction off Envoy's model: the
// server is free to answer or not, so from there on that direction gets only
// the always-rules.
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
