package handlers_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

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
