package handlers

import (
	"net/http"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/google/uuid"
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

// observeStatus tells scheduling how the decode engine answered, so that an
// endpoint answering 5xx is ejected.
func (x *exchange) observeStatus(hm *corev3.HeaderMap) {
	for _, h := range hm.GetHeaders() {
		if h.GetKey() == ":status" {
			if status, err := strconv.Atoi(headerValue(h)); err == nil {
				x.decision.Observe(status)
			}
			return
		}
	}
}
