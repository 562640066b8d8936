package handlers

import (
	"cmp"
	"net/http"
	"slices"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/google/uuid"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/response"
)

// SessionHeaders are the headers in which clients name their session, which
// the shipped Envoy configs copy onto the ext_proc stream and hash to pick a
// replica (docs/envoy.md §14): ours, Claude Code's, Codex's and Open
// WebUI's. A request carrying one is counted apart (pipeline.Request.Session).
var SessionHeaders = []string{"x-session-id", "x-claude-code-session-id", "session-id", "x-openwebui-chat-id"}

// ClientAddressHeader is the ext_proc stream's metadata in which the shipped
// Envoy configs put the client's address, which they hash to pick a replica
// for a request that names no session (docs/envoy.md §14). Such requests
// are counted per address (pipeline.Request.Client).
const ClientAddressHeader = "x-pd-client-address"

// ObjectiveHeader names the request's objective, as the Gateway API Inference
// Extension's clients and authorization filters set it (an InferenceObjective's
// name): its priority is admission.objectives'. llm-d's name for it,
// LLMDObjectiveHeader, is read too; where both are sent, this one counts,
// unless it is empty, which names none.
const (
	ObjectiveHeader     = "x-gateway-inference-objective"
	LLMDObjectiveHeader = "x-llm-d-inference-objective"
)

// FairnessHeader names the flow a request belongs to (a tenant, a client),
// whose held requests take turns with the other flows' of its priority
// (admission.hold), as the Inference Extension's flow control reads it;
// llm-d's name for it, LLMDFairnessHeader, too: where both come, this one
// wins, unless it is empty.
const (
	FairnessHeader     = "x-gateway-inference-fairness-id"
	LLMDFairnessHeader = "x-llm-d-inference-fairness-id"
)

// readHeaders takes what routing needs (begin reads what the observation does). Envoy sends values in raw_value; value is
// read only as a fallback for Envoys with the raw_value guard off.
func (x *exchange) readHeaders(hm *corev3.HeaderMap) {
	x.contentLength = -1
	var logged map[string]string // protocol-detail logging only
	if x.obs.log.V(2).Enabled() {
		logged = make(map[string]string, len(hm.GetHeaders()))
	}
	for _, h := range hm.GetHeaders() {
		key := h.GetKey()
		if logged != nil {
			logged[key] = redact(key, headerValue(h))
		}
		switch key {
		case ":method":
			x.req.Method = headerValue(h)
		case ":path":
			x.req.Path = headerValue(h)
		case RequestIDHeader:
			x.req.RequestID = headerValue(h)
		case "content-type":
			x.req.ContentType = headerValue(h)
		case "content-length":
			if n, err := strconv.ParseInt(headerValue(h), 10, 64); err == nil && n >= 0 {
				x.contentLength = n
			}
		case "authorization", "x-vllm-priority":
			x.forward(key, headerValue(h))
		case ObjectiveHeader: // an empty value names none: llm-d's, whenever it came, stands
			x.req.Objective = cmp.Or(headerValue(h), x.req.Objective)
		case LLMDObjectiveHeader:
			x.req.Objective = cmp.Or(x.req.Objective, headerValue(h))
		case FairnessHeader:
			x.req.Fairness = cmp.Or(headerValue(h), x.req.Fairness)
		case LLMDFairnessHeader:
			x.req.Fairness = cmp.Or(x.req.Fairness, headerValue(h))
		default:
			if slices.Contains(SessionHeaders, key) && headerValue(h) != "" {
				x.req.Session = true
			}
			if key == "x-session-id" {
				x.forward(key, headerValue(h))
			}
		}
	}
	if a := metadata.ValueFromIncomingContext(x.ctx, ClientAddressHeader); len(a) > 0 {
		x.req.Client = a[0]
	}
	if id := x.req.RequestID; !validRequestID(id) {
		x.req.RequestID = uuid.NewString()
		if id != "" {
			x.obs.log.V(1).Info("replacing the client's x-request-id: not 1 to 128 bytes of A-Z a-z 0-9 . _ : -",
				"requestID", x.req.RequestID, "bytes", len(id), "got", strconv.Quote(truncate([]byte(id), 64)))
		}
	}
	if logged != nil {
		x.obs.log.V(2).Info("request headers", "requestID", x.req.RequestID, "headers", logged)
	}
}

// forward copies a client header onto the prefill leg: its Authorization,
// and what vLLM reads for the request's scheduling, which the decode leg
// carries as Envoy forwards it (X-Vllm-Priority, which overrides the body's
// priority, and X-Session-ID: vllm/entrypoints/generate/base/serving.py).
func (x *exchange) forward(key, value string) {
	if x.req.Forward == nil {
		x.req.Forward = http.Header{}
	}
	x.req.Forward.Set(key, value)
}

// maxRequestIDBytes bounds a client's request id: a UUID is 36 bytes, and
// the id goes into every log line and onto both legs.
const maxRequestIDBytes = 128

// validRequestID reports whether id may be kept: 1 to 128 bytes of
// [A-Za-z0-9._:-]. Anything else is replaced, not passed on: Go's HTTP client
// refuses control bytes in a header (the prefill leg would fail before it is
// sent), and the engines take the id as their own request id (vLLM's
// X-Request-Id), where it lands in their logs.
func validRequestID(id string) bool {
	if id == "" || len(id) > maxRequestIDBytes {
		return false
	}
	for i := 0; i < len(id); i++ {
		switch c := id[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '.', c == '_', c == ':', c == '-':
		default:
			return false
		}
	}
	return true
}

// headerValue is a header's value: Envoy sends it in raw_value, and value only
// when its raw_value guard is off.
func headerValue(h *corev3.HeaderValue) string {
	if raw := h.GetRawValue(); len(raw) > 0 {
		return string(raw)
	}
	return h.GetValue()
}

// servedEndpoint is the endpoint that the gateway reports serving the
// request (DestinationServedKey), "" when it reports none.
func servedEndpoint(md *corev3.Metadata) string {
	return md.GetFilterMetadata()[DestinationMetadata].GetFields()[DestinationServedKey].GetStringValue()
}

// subsetHint reads the endpoint-picker subset hint Envoy may forward in the
// envoy.lb.subset_hint metadata namespace: nil when there is none; else a
// list's strings, or a string (a header-to-metadata filter makes one), as
// entries. A hint of another shape names no endpoint (not nil, empty): a
// hint we cannot read must not widen the choice.
func subsetHint(md *corev3.Metadata) []string {
	ns, ok := md.GetFilterMetadata()[SubsetHintNamespace]
	if !ok {
		return nil
	}
	v, ok := ns.GetFields()[SubsetHintKey]
	if !ok {
		return nil
	}
	if s, ok := v.GetKind().(*structpb.Value_StringValue); ok {
		return []string{s.StringValue}
	}
	entries := []string{}
	for _, x := range v.GetListValue().GetValues() {
		s, ok := x.GetKind().(*structpb.Value_StringValue)
		if !ok {
			return []string{}
		}
		entries = append(entries, s.StringValue)
	}
	return entries
}

// servedBy tells the decision which endpoint the gateway reports serving
// the request (addr, "" for none), before its answer is judged. One that
// the service did not offer is a gateway that does not follow
// DestinationHeader: said once per process.
func (x *exchange) servedBy(addr string) {
	if x.decision.ServedBy(addr) {
		return
	}
	x.obs.notFollowed.Do(func() {
		x.obs.log.Info("the gateway reports serving a request from an endpoint pd-extproc did not pick: its route does not follow "+
			DestinationHeader+" (an ORIGINAL_DST cluster that reads it); such answers judge no endpoint",
			"requestID", x.req.RequestID, "served", addr, "picked", strings.Join(x.decision.Endpoints, ","))
	})
}

// onResponseHeaders reads the decode engine's answer: its status tells
// scheduling how the endpoint is doing (a 5xx ejects it like a refused
// connection; a 2xx event stream whose body Envoy sends is judged when it
// ends), and its status and content headers tell a rewrite (or a reader)
// whether the body can be read, which needs the body in FULL_DUPLEX. ends:
// the headers end the answer (an empty body), which the rewrite is told.
func (x *exchange) onResponseHeaders(hm *corev3.HeaderMap, ends bool) {
	status, rewriting := 0, x.rewriting()
	var contentType, contentEncoding string
	for _, h := range hm.GetHeaders() {
		switch key := h.GetKey(); key {
		case ":status":
			status, _ = strconv.Atoi(headerValue(h))
		case "content-type":
			contentType = headerValue(h)
		case "content-encoding":
			contentEncoding = headerValue(h)
		}
	}
	streamed := x.responseMode() != filterv3.ProcessingMode_NONE && response.IsEventStream(contentType, contentEncoding)
	x.answer.begun.Store(!streamed || status < 200 || status > 299)
	if status != 0 {
		x.decision.Observe(status, streamed)
	}
	switch {
	case !rewriting:
	case x.responseMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		x.decision.Rewrite.Skip(metrics.UsageNotFullDuplex)
		if !x.decision.Rewrite.Writes() {
			break // a reader of the answer: nothing the user asked for is lost
		}
		x.obs.notDuplex.Do(func() {
			x.obs.log.Info("response.rewrite_usage is on, but Envoy does not send response bodies in FULL_DUPLEX_STREAMED: "+
				"answers are passed on unchanged; set the ext_proc filter's response_body_mode (with response_trailer_mode: SEND)",
				"responseBodyMode", x.responseMode().String())
		})
	default:
		x.decision.Rewrite.Start(status, contentType, contentEncoding)
		if ends { // an empty answer: no body follows to end the rewrite
			x.answer.done = true
			x.decision.Rewrite.Body(nil, true)
		}
	}
}
