package handlers_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// fuzzMaxMessageTimeout is the max_message_timeout of
// config/envoy/envoy-buffered.yaml, the mode in which the server extends
// Envoy's message timer (§5).
const fuzzMaxMessageTimeout = 120 * time.Second

// fuzzChecker judges what the server sent: Envoy's reply rules, the model the
// emulator runs on (internal/envoyemu/rules), decide whether Envoy would
// accept each reply and what it is still owed; the rest are this server's own
// rules (routing, the decode body, the subset hint, raw_value-only mutations,
// the response echoed...).
type fuzzChecker struct {
	c         *fuzzCase
	envoy     *rules.Stream
	req, resp *fuzzSide
	problems  []string
	received  int
	repeat    bool     // the message being answered is the body's end again: it must get no reply
	overrides int      // override_message_timeout replies to the message being answered
	subset    []string // the endpoints the request's subset hint allows
	hasSubset bool
}

// fuzzSide is what the checker keeps of one direction for its own rules,
// next to Envoy's view of it.
type fuzzSide struct {
	*rules.Direction
	headersSeen  bool
	headers      []*corev3.HeaderValue         // what the headers message carried
	sentBody     []byte                        // body bytes Envoy sent
	repliedBody  []byte                        // the body the replies carry
	bodyReplaced bool                          // a buffered body reply carried a new body
	endReplied   bool                          // a body reply carried end_of_stream
	routing      *extprocv3.ProcessingResponse // the reply that carried the destination
}

func (k *fuzzChecker) fail(format string, args ...any) {
	k.problems = append(k.problems, fmt.Sprintf("message %d: ", k.received)+fmt.Sprintf(format, args...))
}

func checkFuzzExchange(c *fuzzCase, rec *fuzzRecorder, reset bool) []string {
	// The first message's protocol_config gives the modes (§1.2).
	var pc *extprocv3.ProtocolConfiguration
	for _, e := range rec.events {
		if e.recv != nil {
			pc = e.recv.GetProtocolConfig()
			break
		}
	}
	envoy := rules.NewStream(rules.Config{
		RequestMode:                             pc.GetRequestBodyMode(),
		ResponseMode:                            pc.GetResponseBodyMode(),
		SendBodyWithoutWaitingForHeaderResponse: pc.GetSendBodyWithoutWaitingForHeaderResponse(),
		MaxMessageTimeout:                       fuzzMaxMessageTimeout,
	})
	k := &fuzzChecker{c: c, envoy: envoy, req: &fuzzSide{Direction: envoy.Request}, resp: &fuzzSide{Direction: envoy.Response}}
	for _, e := range rec.events {
		if e.recv != nil {
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
	if !reset && envoy.Over() == "" && errors.Is(rec.recvErr, io.EOF) {
		for _, why := range envoy.Owed() {
			k.fail("%s", why)
		}
		k.owedResponse()
		k.checkRouting()
	}
	return k.problems
}

func (k *fuzzChecker) side(m *extprocv3.ProcessingRequest) *fuzzSide {
	switch m.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders, *extprocv3.ProcessingRequest_RequestBody, *extprocv3.ProcessingRequest_RequestTrailers:
		return k.req
	case *extprocv3.ProcessingRequest_ResponseHeaders, *extprocv3.ProcessingRequest_ResponseBody, *extprocv3.ProcessingRequest_ResponseTrailers:
		return k.resp
	}
	return nil
}

// onMessage records a message Envoy sent.
func (k *fuzzChecker) onMessage(m *extprocv3.ProcessingRequest) {
	k.repeat, k.overrides = false, 0
	d := k.side(m)
	h := m.GetRequestHeaders()
	if h == nil {
		h = m.GetResponseHeaders()
	}
	if h != nil && !d.headersSeen {
		d.headersSeen, d.headers = true, h.GetHeaders().GetHeaders()
		if d == k.req {
			k.subset, k.hasSubset = fuzzSubsetOf(m.GetMetadataContext())
		}
	}
	switch k.envoy.Sent(m) {
	case rules.Repeat:
		k.repeat = true // envoy#46237: the end of the body again
	case rules.Expected:
		b := m.GetRequestBody()
		if b == nil {
			b = m.GetResponseBody()
		}
		d.sentBody = append(d.sentBody, b.GetBody()...)
	}
}

// onReply judges one reply with Envoy's rules, then with ours.
func (k *fuzzChecker) onReply(r *extprocv3.ProcessingResponse) {
	if over := k.envoy.Over(); over != "" {
		k.fail("a reply after %s, which ended the stream: %v", over, r)
		return
	}
	if k.repeat {
		k.fail("a reply to a repeated end of the body, which must be dropped (envoy#46237): %v", r)
	}
	v := k.envoy.Reply(r)
	switch v.Outcome {
	case rules.Spurious:
		k.fail("spurious (§7.3), Envoy answers status_on_error: %s", v.Reason)
	case rules.Ignored:
		k.fail("Envoy ignores it: %s", v.Reason)
	}
	for _, part := range v.Dropped {
		k.fail("Envoy drops %s", part)
	}
	if r.GetOverrideMessageTimeout() != nil {
		if k.overrides++; k.overrides > 1 {
			k.fail("%d override_message_timeout replies to one message: Envoy honours one per call", k.overrides)
		}
		return
	}
	k.checkDynamicMetadata(r)
	switch x := r.Response.(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		k.headersReply(k.req, x.RequestHeaders.GetResponse(), r, v)
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		k.headersReply(k.resp, x.ResponseHeaders.GetResponse(), r, v)
	case *extprocv3.ProcessingResponse_RequestBody:
		k.bodyReply(k.req, x.RequestBody.GetResponse(), r, v)
	case *extprocv3.ProcessingResponse_ResponseBody:
		k.bodyReply(k.resp, x.ResponseBody.GetResponse(), r, v)
	case *extprocv3.ProcessingResponse_RequestTrailers:
		k.checkMutation("request trailers reply", x.RequestTrailers.GetHeaderMutation())
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		k.checkMutation("response trailers reply", x.ResponseTrailers.GetHeaderMutation())
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		ir := x.ImmediateResponse
		if code := ir.GetStatus().GetCode(); code < 400 || code > 599 {
			k.fail("ImmediateResponse status %d: errors must be 4xx or 5xx", code)
		}
		k.checkMutation("ImmediateResponse", ir.GetHeaders())
		if ir.GetGrpcStatus() != nil {
			k.fail("ImmediateResponse carries a grpc_status for an HTTP request")
		}
	}
}

func (k *fuzzChecker) headersReply(d *fuzzSide, cr *extprocv3.CommonResponse, r *extprocv3.ProcessingResponse, v rules.Verdict) {
	k.checkMutation(d.Name()+" headers reply", cr.GetHeaderMutation())
	k.noteRouting(d, cr, r)
	if v.Outcome == rules.Accepted && cr.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE {
		k.fail("%s headers reply with CONTINUE_AND_REPLACE: it drops the body and Content-Length (§3.1)", d.Name())
	}
}

func (k *fuzzChecker) bodyReply(d *fuzzSide, cr *extprocv3.CommonResponse, r *extprocv3.ProcessingResponse, v rules.Verdict) {
	k.checkMutation(d.Name()+" body reply", cr.GetHeaderMutation())
	sr := cr.GetBodyMutation().GetStreamedResponse()
	// Always: one end per direction, nothing after it.
	if d.endReplied {
		k.fail("%s body reply after the one that ended the body (§2.6 rule 5)", d.Name())
	}
	if sr.GetEndOfStream() {
		d.endReplied = true
	}
	if sr != nil && d == k.req && len(sr.GetBody()) > 64<<10 {
		k.fail("request body reply chunk of %d bytes: over the 64 KiB Envoy recommends", len(sr.GetBody()))
	}
	k.noteRouting(d, cr, r)
	if v.Outcome != rules.Accepted {
		return
	}
	if d.Mode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		// Envoy takes an early end, and the rest of the body then gets no reply.
		if sr.GetEndOfStream() && !d.BodyEnded() {
			k.fail("%s end_of_stream reply before Envoy ended the body (§2.6 rule 5)", d.Name())
		}
		d.repliedBody = append(d.repliedBody, sr.GetBody()...)
		return
	}
	if v.Answered == rules.BufferedBodyCallback { // the headers are still held (§2.3)
		cl := fuzzContentLength(d.headers, cr.GetHeaderMutation())
		if err := rules.CheckContentLength(cl, cr.GetBodyMutation()); err != nil {
			k.fail("%s body reply: %v (content-length %q, %d bytes): Envoy answers 500 (§3.5)", d.Name(), err, cl, len(cr.GetBodyMutation().GetBody()))
		}
	}
	nb, ok := rules.Replacement(cr.GetBodyMutation())
	if !ok {
		d.repliedBody = d.sentBody // Envoy forwards the body it buffered
		return
	}
	d.repliedBody, d.bodyReplaced = nb, true
}

// fuzzContentLength is the Content-Length Envoy holds once a reply's header
// mutation applied: the last one it sets, else the first the headers had.
func fuzzContentLength(hs []*corev3.HeaderValue, m *extprocv3.HeaderMutation) string {
	cl, set := "", false
	for _, h := range m.GetSetHeaders() {
		if h.GetHeader().GetKey() == "content-length" {
			cl, set = string(h.GetHeader().GetRawValue()), true
		}
	}
	if all := fuzzAllHeaders(hs, "content-length"); !set && len(all) > 0 {
		cl = all[0]
	}
	return cl
}

// owedResponse: beyond what Envoy waits for, this server answers the response
// headers at once and echoes a FULL_DUPLEX response byte for byte.
func (k *fuzzChecker) owedResponse() {
	d := k.resp
	if d.Off() != "" || d.Mode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return
	}
	if d.State() == rules.HeadersCallback && !d.HeadersEOS() && !d.BodyEnded() {
		k.fail("response: the headers reply never came") // else Envoy's own rules say so
	}
	if !bytes.Equal(d.sentBody, d.repliedBody) {
		k.fail("response body echoed as %q, want %q unchanged", d.repliedBody, d.sentBody)
	}
}

// noteRouting keeps the reply that carries the destination.
func (k *fuzzChecker) noteRouting(d *fuzzSide, cr *extprocv3.CommonResponse, r *extprocv3.ProcessingResponse) {
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

// fuzzHeaderRules are Envoy's default mutation_rules, which the shipped
// configurations keep.
var fuzzHeaderRules, _ = rules.NewHeaderRules(nil, "")

// checkMutation applies Envoy's rules of §3.2–§3.3 to a header mutation, and
// ours: raw_value only, lower-case names, no empty value, no append.
func (k *fuzzChecker) checkMutation(where string, m *extprocv3.HeaderMutation) {
	for _, h := range m.GetSetHeaders() {
		hv := h.GetHeader()
		key, value := hv.GetKey(), string(hv.GetRawValue())
		switch {
		case hv == nil:
			k.fail("%s: a set_headers entry without a header", where)
			continue
		case hv.GetValue() != "":
			k.fail("%s: %s set in value (%q): Envoy reads raw_value only, and both set is a 500 (§3.2)", where, key, hv.GetValue())
		case value == "":
			k.fail("%s: %s set to an empty value", where, key)
		case !rules.HeaderNameIsValid(key) || key != strings.ToLower(key):
			k.fail("%s: invalid header name %q", where, key)
		case !rules.HeaderValueIsValid(value):
			k.fail("%s: %s value %q has characters Envoy rejects (500)", where, key, value)
		case fuzzHeaderRules.Check(rules.OpSet, key, value) != rules.CheckOK:
			k.fail("%s: %s may not be set to %q under the default rules (§3.3)", where, key, value)
		}
		if h.GetAppend().GetValue() {
			k.fail("%s: %s appended: a client's own value would stay next to ours", where, key)
		}
		if key == handlers.DestinationHeader && !fuzzIsDecodeEndpoint(string(hv.GetRawValue())) {
			k.fail("%s: destination %q is not a configured decode endpoint", where, hv.GetRawValue())
		}
	}
	for _, name := range m.GetRemoveHeaders() {
		if !rules.HeaderNameIsValid(name) || fuzzHeaderRules.Remove(strings.ToLower(name)) != rules.CheckOK {
			k.fail("%s: removing %s, which Envoy does not allow (§3.3)", where, name)
		}
	}
}

// checkRouting checks the routing of a request that ran to its end.
func (k *fuzzChecker) checkRouting() {
	d := k.req
	if d.Off() != "" || !d.HeadersSent() {
		return
	}
	bodyless := d.HeadersEOS() || d.Mode() == filterv3.ProcessingMode_NONE
	if !bodyless && !d.BodyEnded() {
		return
	}
	if d.routing == nil {
		k.fail("the request ended without a routing reply or an ImmediateResponse")
		return
	}
	cr := fuzzCommon(d.routing)
	got, set := fuzzSetHeader(cr.GetHeaderMutation(), "x-request-id")
	switch want, ok := fuzzSingleHeader(d.headers, "x-request-id"); {
	case ok && fuzzSafeRequestID.MatchString(want):
		if got != want {
			k.fail("x-request-id %q, want the client's %q on both legs", got, want)
		}
	case !set:
		k.fail("routing reply without an x-request-id")
	case !fuzzSafeRequestID.MatchString(got):
		k.fail("x-request-id %.80q replaces the client's with one that is not safe either", got)
	}
	removed := cr.GetHeaderMutation().GetRemoveHeaders()
	for _, h := range fuzzReservedHeaders[k.c.connector] {
		if !slices.Contains(removed, h) {
			k.fail("routing reply does not remove %s: a client's would steer the decode engine (removes %v)", h, removed)
		}
	}
	if bodyless {
		return
	}
	cl, hasCL := fuzzSetHeader(cr.GetHeaderMutation(), "content-length")
	if d.Mode() == filterv3.ProcessingMode_BUFFERED {
		if d.routing.GetRequestBody() == nil {
			k.fail("BUFFERED routing must be in the body reply, while Envoy still holds the headers (§2.11)")
		}
		// Envoy checks a Content-Length against the new body (§3.5, at the
		// reply); ours is set exactly when the client sent one.
		client := fuzzAllHeaders(d.headers, "content-length")
		valid := len(client) == 1 && fuzzIsUint(client[0])
		switch {
		case valid && d.bodyReplaced && !hasCL:
			k.fail("BUFFERED body reply replaces the body without the content-length the client sent")
		case len(client) == 0 && hasCL:
			k.fail("BUFFERED body reply sets content-length %q on a chunked request", cl)
		}
	}
	if hasCL && cl != strconv.Itoa(len(d.repliedBody)) {
		k.fail("content-length %q for a %d-byte body", cl, len(d.repliedBody))
	}
	if len(d.sentBody) == 0 && len(d.repliedBody) == 0 {
		return // a body of no bytes is no body: it goes on as it came (a pass-through route's)
	}
	k.checkDecodeBody(d.repliedBody)
}

// fuzzSafeRequestID is a request id kept as the client sent it; any other is replaced.
var fuzzSafeRequestID = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,128}$`)

// fuzzReservedHeaders are some of the headers each connector's decode engines
// read that only a router may set (pkg/kv lists them all, with their sources).
var fuzzReservedHeaders = map[string][]string{
	"kv-nixl":           {"x-data-parallel-rank"},
	"kv-shared-storage": {"x-data-parallel-rank"},
	"kv-sglang":         {"x-data-parallel-rank", "x-override-bootstrap-host", "x-override-bootstrap-room", "x-override-routed-dp-rank"},
}

// checkDecodeBody: whatever the client sent, the reserved keys the decode
// engine reads at the top level are ours (docs/architecture.md, Security rules).
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

// TestFuzzCheckerCatchesWhatEnvoyRefuses runs the checker on hand-made
// exchanges: one Envoy takes whole, and replies Envoy would refuse, ignore or
// wait for in vain.
func TestFuzzCheckerCatchesWhatEnvoyRefuses(t *testing.T) {
	const (
		fd       = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
		buffered = filterv3.ProcessingMode_BUFFERED
	)
	body := []byte(`{"model":"m","prompt":"hi"}`)
	dest := fuzzDecodeEndpoints[0]
	headers := func(mode filterv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
		return envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false,
			envoymsg.Post("/v1/completions", len(body), envoymsg.Header{"x-request-id", "r1"})...), mode, fd)
	}
	routing := &extprocv3.CommonResponse{ClearRouteCache: true, HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
		{Header: &corev3.HeaderValue{Key: handlers.DestinationHeader, RawValue: []byte(dest)}},
		{Header: &corev3.HeaderValue{Key: "x-request-id", RawValue: []byte("r1")}},
	}, RemoveHeaders: []string{"x-data-parallel-rank"}}}
	md, _ := structpb.NewStruct(map[string]any{handlers.DestinationMetadata: map[string]any{handlers.DestinationHeader: dest}})
	headersReply := &extprocv3.ProcessingResponse{DynamicMetadata: md,
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: routing}}}
	bodyReply := func(bm *extprocv3.BodyMutation) *extprocv3.ProcessingResponse {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
			Response: &extprocv3.CommonResponse{BodyMutation: bm}}}}
	}
	streamed := bodyReply(&extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: true}}})
	override := &extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(time.Second)}
	bufferedRouting := &extprocv3.ProcessingResponse{DynamicMetadata: md,
		Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: routing}}}
	keeping := proto.Clone(routing).(*extprocv3.CommonResponse)
	keeping.HeaderMutation.RemoveHeaders = nil
	headersReplyKeeping := &extprocv3.ProcessingResponse{DynamicMetadata: md,
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: keeping}}}
	continueHeaders := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}
	// mutated is the routing headers reply setting one more header, or removing more.
	mutated := func(set *corev3.HeaderValueOption, remove ...string) []fuzzEvent {
		r := proto.Clone(headersReply).(*extprocv3.ProcessingResponse)
		m := r.GetRequestHeaders().GetResponse().GetHeaderMutation()
		if set != nil {
			m.SetHeaders = append(m.SetHeaders, set)
		}
		m.RemoveHeaders = append(m.RemoveHeaders, remove...)
		return []fuzzEvent{{recv: headers(fd)}, {recv: envoymsg.Body(envoymsg.Request, body, true)}, {sent: r}, {sent: streamed}}
	}
	raw := func(k, v string) *corev3.HeaderValueOption {
		return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}}
	}

	recv := func(m *extprocv3.ProcessingRequest) fuzzEvent { return fuzzEvent{recv: m} }
	sent := func(r *extprocv3.ProcessingResponse) fuzzEvent { return fuzzEvent{sent: r} }
	tests := []struct {
		name   string
		events []fuzzEvent
		want   string // in one of the problems; "" for none at all
	}{
		{"FULL_DUPLEX as Envoy wants it", []fuzzEvent{
			recv(headers(fd)), recv(envoymsg.Body(envoymsg.Request, body, true)), sent(headersReply), sent(streamed),
		}, ""},
		{"BUFFERED as Envoy wants it, the timer extended once", []fuzzEvent{
			recv(headers(buffered)), sent(continueHeaders), recv(envoymsg.Body(envoymsg.Request, body, true)),
			sent(override), sent(bufferedRouting),
		}, ""},
		{"FULL_DUPLEX body reply that is not streamed_response", []fuzzEvent{
			recv(headers(fd)), recv(envoymsg.Body(envoymsg.Request, body, true)), sent(headersReply),
			sent(bodyReply(&extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}})),
		}, "Normal body mutation response"},
		{"FULL_DUPLEX body reply before the headers reply", []fuzzEvent{
			recv(headers(fd)), recv(envoymsg.Body(envoymsg.Request, body, true)), sent(streamed), sent(headersReply),
		}, "before the headers response"},
		{"headers answered twice", []fuzzEvent{
			recv(headers(fd)), recv(envoymsg.Body(envoymsg.Request, body, true)), sent(headersReply), sent(headersReply),
		}, "headers response received in state StreamedBodyCallback"},
		{"a body the server never answers", []fuzzEvent{
			recv(headers(buffered)), sent(continueHeaders), recv(envoymsg.Body(envoymsg.Request, body, true)),
		}, "1 message(s) never answered"},
		{"a second override for one call", []fuzzEvent{
			recv(headers(buffered)), sent(continueHeaders), recv(envoymsg.Body(envoymsg.Request, body, true)),
			sent(override), sent(override), sent(bufferedRouting),
		}, "already overridden"},
		{"a reply to the body's end sent again", []fuzzEvent{
			recv(headers(fd)), recv(envoymsg.Body(envoymsg.Request, body, true)), sent(headersReply), sent(streamed),
			recv(envoymsg.Body(envoymsg.Request, body, true)), sent(streamed),
		}, "envoy#46237"},
		{"a client's data-parallel rank left on the request", []fuzzEvent{
			recv(headers(fd)), recv(envoymsg.Body(envoymsg.Request, body, true)), sent(headersReplyKeeping), sent(streamed),
		}, "does not remove x-data-parallel-rank"},
		{"a routing header set", mutated(raw(":authority", "evil.example")), ":authority may not be set"},
		{"an x-envoy header set", mutated(raw("x-envoy-debug", "1")), "x-envoy-debug may not be set"},
		{"a value Envoy refuses", mutated(raw("x-note", "a\r\nb")), "characters Envoy rejects"},
		{"a mixed-case name", mutated(raw("X-Note", "a")), "invalid header name"},
		{"host removed", mutated(nil, "host"), "removing host"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			problems := checkFuzzExchange(&fuzzCase{connector: "kv-shared-storage"}, &fuzzRecorder{events: tc.events, recvErr: io.EOF}, false)
			if tc.want == "" {
				if len(problems) > 0 {
					t.Fatalf("problems in an exchange Envoy takes: %q", problems)
				}
				return
			}
			if !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, tc.want) }) {
				t.Fatalf("problems %q, want one mentioning %q", problems, tc.want)
			}
		})
	}
}
