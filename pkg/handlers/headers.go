package handlers

import (
	"net/http"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/google/uuid"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
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
		case "content-length":
			if n, err := strconv.ParseInt(headerValue(h), 10, 64); err == nil && n >= 0 {
				x.contentLength = n
			}
		case "authorization":
			x.req.Forward = http.Header{"Authorization": {headerValue(h)}}
		}
	}
	if x.req.RequestID == "" {
		x.req.RequestID = uuid.NewString()
	}
	if logged != nil {
		x.obs.log.V(2).Info("request headers", "requestID", x.req.RequestID, "headers", logged)
	}
}

// headerValue is a header's value: Envoy sends it in raw_value, and value only
// when its raw_value guard is off.
func headerValue(h *corev3.HeaderValue) string {
	if raw := h.GetRawValue(); len(raw) > 0 {
		return string(raw)
	}
	return h.GetValue()
}

// subsetHint reads the endpoint-picker subset hint Envoy may forward in the
// envoy.lb.subset_hint metadata namespace; nil when there is none.
func subsetHint(md *corev3.Metadata) any {
	ns, ok := md.GetFilterMetadata()[SubsetHintNamespace]
	if !ok {
		return nil
	}
	v, ok := ns.GetFields()[SubsetHintKey]
	if !ok {
		return nil
	}
	return v.AsInterface()
}

// onResponseHeaders reads the decode engine's answer: its status tells
// scheduling how the endpoint is doing (a 5xx ejects it like a refused
// connection), and its status and content headers tell a rewrite whether the
// body can be rewritten, which needs the body in FULL_DUPLEX.
func (x *exchange) onResponseHeaders(hm *corev3.HeaderMap) {
	status := 0
	var contentType, contentEncoding string
	for _, h := range hm.GetHeaders() {
		switch h.GetKey() {
		case ":status":
			status, _ = strconv.Atoi(headerValue(h))
		case "content-type":
			contentType = headerValue(h)
		case "content-encoding":
			contentEncoding = headerValue(h)
		}
	}
	if status != 0 {
		x.decision.Observe(status)
	}
	switch {
	case !x.rewriting():
	case x.responseMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		x.decision.Rewrite.Skip(metrics.UsageNotFullDuplex)
		x.obs.notDuplex.Do(func() {
			x.obs.log.Info("response.rewrite_usage is on, but Envoy does not send response bodies in FULL_DUPLEX_STREAMED: "+
				"answers are passed on unchanged; set the ext_proc filter's response_body_mode (with response_trailer_mode: SEND)",
				"responseBodyMode", x.responseMode().String())
		})
	default:
		x.decision.Rewrite.Start(status, contentType, contentEncoding)
	}
}
