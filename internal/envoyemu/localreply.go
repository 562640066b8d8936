package envoyemu

import (
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"unicode"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// immediateResponse is §4: status <200 becomes 200, headers through the
// filter's mutation rules (a failing mutation is only logged), body as given,
// the stream closed and later messages ignored.
func (x *exchange) immediateResponse(ir *extprocv3.ImmediateResponse) {
	code := int(ir.GetStatus().GetCode())
	if code < 200 {
		code = 200
	}
	if code > 999 {
		code = 500
	}
	h := &headerMap{}
	if _, err := applyHeaderMutation(ir.GetHeaders(), h, x.p.headers, x.limits(), mutationOptions{}); err != nil {
		x.logf("immediate response header mutation failed: %v", err)
	}
	h.remove("content-length")
	x.sendLocalReply(code, "", ir.GetBody(), h, noSpaces(ir.GetDetails()))
}

// noSpaces replaces whitespace in response code details with '_', as Envoy
// does (StringUtil::replaceAllEmptySpace).
func noSpaces(details string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsSpace(r) {
			return '_'
		}
		return r
	}, details)
}

// localReply is one of Envoy's own replies; flag is the response flag it
// adds to the stream's (UH, UF, ...), "" for none.
func (x *exchange) localReply(code int, flag, body, details string) {
	x.sendLocalReply(code, flag, []byte(body), &headerMap{}, details)
}

// sendLocalReply ends the exchange with an Envoy-generated response, or a
// reset when the response already started downstream (§4). Local replies do
// not go through ext_proc (§9 skip_ext_proc_on_local_reply). The connection
// manager's local_reply_config rewrites it first (§15); a body then gets
// the format's content type unless the reply's headers name one and the
// body is the reply's own (Utility::prepareLocalReply).
func (x *exchange) sendLocalReply(code int, flag string, body []byte, h *headerMap, details string) {
	if x.finished {
		return
	}
	x.logf("local reply %d (%s)", code, details)
	x.proc.complete = true
	x.closeStream()
	x.dec.timer.stop()
	x.enc.timer.stop()
	x.rt.cancelUpstream()
	x.finished = true
	if x.down.started {
		x.abort = true
		return
	}
	hdr := x.down.w.Header()
	for k := range hdr {
		delete(hdr, k)
	}
	x.setFlag(flag)
	f := replyFacts{body: string(body), code: code, details: details, flags: x.flags, request: x.dec.src.headers}
	if contentType := x.cfg.LocalReplies.rewrite(&f); f.body != "" {
		if _, ok := h.get("content-type"); !ok || f.body != string(body) {
			h.set("content-type", contentType)
		}
	}
	h.toHTTPHeader(hdr)
	if _, ok := hdr["Content-Type"]; !ok {
		hdr["Content-Type"] = nil // no sniffing: Envoy sends none for an empty body
	}
	hdr.Set("Content-Length", strconv.Itoa(len(f.body)))
	if details != "" {
		hdr.Set(DetailsHeader, details)
	}
	x.down.started = true
	x.down.w.WriteHeader(f.code)
	_, _ = io.WriteString(x.down.w, f.body)
}

// upstreamOverflow is the router's answer when the route cluster's circuit
// breakers refuse the request (onUpstreamReset/onUpstreamAbort in router.cc,
// reset reason Overflow): 503, x-envoy-overloaded unless the router
// suppresses Envoy's headers, response flag UO (§12).
func (x *exchange) upstreamOverflow() {
	h := &headerMap{}
	if !x.cfg.SuppressEnvoyHeaders {
		h.set(x.cfg.Mutations.HeaderPrefix+"-overloaded", "true")
	}
	x.sendLocalReply(http.StatusServiceUnavailable, "UO", []byte(errOverflow.Error()), h, "upstream_reset_before_response_started{overflow}")
}

// bufferOverflow: a BUFFERED body over the buffer limit is a 413 on the
// request path, a 500 (or reset) on the response path (§2.3).
func (x *exchange) bufferOverflow(d *direction) {
	if d.response {
		x.localReply(http.StatusInternalServerError, "", "Internal Server Error", "response_payload_too_large")
		return
	}
	x.localReply(http.StatusRequestEntityTooLarge, "", "Payload Too Large", "request_payload_too_large")
}

// resetReply is the router's 503 for an attempt that failed before its
// headers (Filter::onUpstreamReset in source/common/router/router.cc): the
// body names the reset reason, the transport's failure reason after it, and
// "retried and the latest" once a retry was made. A refused connection is a
// remote connection failure whose reason is the connect error's strerror
// text (ConnectionImpl::onWriteReady in source/common/network/connection_impl.cc;
// Go's text with a capital, as glibc writes it); a connection closed after
// connecting is a connection termination (CodecClient::onEvent).
func resetReply(err error, retried bool) (flag, body, details string) {
	flag, reason, transport := "UC", "connection termination", ""
	var op *net.OpError
	var errno syscall.Errno
	switch {
	case errors.As(err, &op) && op.Op == "dial" && op.Timeout():
		flag, reason = "UF", "connection timeout"
	case errors.As(err, &op) && op.Op == "dial":
		flag, reason = "UF", "remote connection failure"
		if errors.As(err, &errno) {
			text := errno.Error()
			transport = "delayed connect error: " + strings.ToUpper(text[:1]) + text[1:]
		}
	}
	body = "upstream connect error or disconnect/reset before headers. "
	if retried {
		body += "retried and the latest "
	}
	body += "reset reason: " + reason
	details = reason
	if transport != "" {
		body += ", transport failure reason: " + transport
		details += "|" + transport
	}
	return flag, body, noSpaces("upstream_reset_before_response_started{" + details + "}")
}
