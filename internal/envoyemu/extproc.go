package envoyemu

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
)

// The exchange's side of the ext_proc stream: what goes to the server, what
// its replies and its end do to the exchange.

// send queues a message on the stream, opening it lazily (§1.1). The first
// message carries protocol_config (§1.2), every message the forwarded
// metadata (§1.4).
func (x *exchange) send(req *extprocv3.ProcessingRequest) {
	if x.proc.complete || x.finished {
		return
	}
	if !x.proc.firstSent {
		x.proc.firstSent = true
		req.ProtocolConfig = &extprocv3.ProtocolConfiguration{
			RequestBodyMode:                         x.cfg.Modes.Request.Body,
			ResponseBodyMode:                        x.cfg.Modes.Response.Body,
			SendBodyWithoutWaitingForHeaderResponse: x.cfg.Modes.SendBodyWithoutWaitingForHeaderResponse,
		}
	}
	if len(x.cfg.Metadata.ForwardingNamespaces) > 0 {
		req.MetadataContext = x.metadataContext()
	}
	if x.proc.stream == nil {
		x.proc.stream = openStream(x)
	}
	x.proc.stream.push(req)
}

// closeStream resets the gRPC stream: Envoy's default close is a reset, so
// the server sees codes.Canceled (§1 "How the stream ends").
func (x *exchange) closeStream() {
	if x.proc.stream != nil {
		x.proc.stream.close()
	}
}

func (x *exchange) onStreamEnd(err error) {
	if x.finished || x.proc.complete || x.proc.stream == nil || x.proc.stream.closed {
		return
	}
	if errors.Is(err, io.EOF) {
		// §7.2: a clean close means "continue without me", both directions.
		x.logf("ext_proc server closed the stream with OK")
		x.completeProcessing()
		return
	}
	st := status.Convert(err)
	if x.failureModeAllow() {
		x.logf("ext_proc stream error %v: failure_mode_allow, continuing", st)
		x.completeProcessing()
		return
	}
	// onGrpcError answers through sendImmediateResponse, which puts
	// underscores for the whitespace of the details (§10.10).
	x.localReply(x.cfg.Failure.StatusOnError, "", "", noSpaces(fmt.Sprintf("ext_proc_error_gRPC_error_%d{%s}", st.Code(), st.Message())))
}

// failureModeAllow is Filter::failureModeAllow: never once FULL_DUPLEX body
// data went to the server (§5).
func (x *exchange) failureModeAllow() bool {
	return x.cfg.Failure.FailureModeAllow && !x.proc.fdBodySeen
}

// completeProcessing stops consulting the server and lets both directions
// continue unmodified.
func (x *exchange) completeProcessing() {
	x.proc.complete = true
	x.proc.rules.Close("processing completed")
	x.closeStream()
	x.dec.clearAsyncState()
	x.enc.clearAsyncState()
}

// onMessage is Filter::onReceiveMessage: the rules judge each reply against
// its direction's state (§1.7, §7.3), then the direction applies it.
func (x *exchange) onMessage(resp *extprocv3.ProcessingResponse) {
	if x.finished || x.proc.complete {
		return // §7.2: late replies are dropped
	}
	v := x.proc.rules.Reply(resp)
	if ot := resp.GetOverrideMessageTimeout(); ot != nil {
		// §5: handled alone; every other field of the message is ignored.
		x.onOverrideTimeout(ot.AsDuration(), v)
		return
	}
	switch resp.GetResponse().(type) {
	case nil, *extprocv3.ProcessingResponse_StreamedImmediateResponse:
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		if v.Outcome == rules.Accepted {
			x.applyMetadata(resp)
		}
	default:
		// Envoy takes a reply's dynamic metadata before it judges the reply.
		x.applyMetadata(resp)
	}
	switch v.Outcome {
	case rules.Accepted:
	case rules.Spurious:
		x.onProcessingError(spurious("%s", v.Reason))
		return
	default:
		x.logf("reply %s: %s", v.Outcome, v.Reason)
		return
	}
	for _, part := range v.Dropped {
		x.logf("ignored: %s", part)
	}
	var err error
	switch r := resp.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		err = x.dec.onHeadersResponse(r.RequestHeaders)
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		err = x.enc.onHeadersResponse(r.ResponseHeaders)
	case *extprocv3.ProcessingResponse_RequestBody:
		err = x.dec.onBodyResponse(r.RequestBody, v.Answered)
	case *extprocv3.ProcessingResponse_ResponseBody:
		err = x.enc.onBodyResponse(r.ResponseBody, v.Answered)
	case *extprocv3.ProcessingResponse_RequestTrailers:
		err = x.dec.onTrailersResponse(r.RequestTrailers)
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		err = x.enc.onTrailersResponse(r.ResponseTrailers)
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		x.immediateResponse(r.ImmediateResponse)
		return
	}
	if err != nil {
		x.onProcessingError(err)
		return
	}
	if _, ok := resp.GetResponse().(*extprocv3.ProcessingResponse_ResponseHeaders); ok && x.enc.bodyMode == extprocfilterv3.ProcessingMode_NONE && !x.enc.sendTrailers {
		// closeGrpcStreamIfLastRespReceived: nothing of the response is
		// sent after its headers, so their reply is the last.
		x.closeStream()
		return
	}
	x.maybeCloseStream()
}

// onProcessingError applies the §5 failure table: spurious replies honour
// failure_mode_allow, invalid mutations never do.
func (x *exchange) onProcessingError(err error) {
	x.logf("ext_proc error: %v", err)
	if errors.Is(err, errSpurious) && x.failureModeAllow() {
		x.completeProcessing()
		return
	}
	x.localReply(x.cfg.Failure.StatusOnError, "", "", err.Error())
}

// onOverrideTimeout restarts the timers the rules say the override applies
// to (§5).
func (x *exchange) onOverrideTimeout(dur time.Duration, v rules.Verdict) {
	for _, part := range v.Dropped {
		x.logf("ignored: %s", part)
	}
	if v.Outcome != rules.Accepted {
		x.logf("%s", v.Reason)
		return
	}
	for _, r := range v.Restarted {
		d := x.dec
		if r == x.enc.rules {
			d = x.enc
		}
		d.restartTimer(dur)
	}
}

func (x *exchange) onMessageTimeout(d *direction) {
	if x.finished || x.proc.complete {
		return
	}
	if x.failureModeAllow() {
		x.logf("%s message timeout: failure_mode_allow, continuing", d.name())
		x.completeProcessing()
		return
	}
	// §5: 504, hard-coded (not status_on_error) since envoy#34856.
	x.localReply(http.StatusGatewayTimeout, "", "", "ext_proc_error_per-message_timeout_exceeded")
}

// maybeCloseStream mimics ext_proc_stream_close_optimization (§1): once the
// request side is done and the response side will never send, the stream is
// reset early.
func (x *exchange) maybeCloseStream() {
	enc := x.enc
	encSilent := !enc.sendHeaders && enc.bodyMode == extprocfilterv3.ProcessingMode_NONE && !enc.sendTrailers
	dec := x.dec
	decDone := dec.out.ended && dec.rules.Settled() && len(dec.buf.chunks) == 0
	if encSilent && decDone {
		x.closeStream()
	}
}

// applyMetadata keeps dynamic_metadata only for receiving namespaces (§3.7),
// merged per key into the stream's metadata.
func (x *exchange) applyMetadata(resp *extprocv3.ProcessingResponse) {
	for ns, v := range resp.GetDynamicMetadata().GetFields() {
		if !slices.Contains(x.cfg.Metadata.ReceivingNamespaces, ns) {
			x.logf("dynamic_metadata namespace %q dropped: not in receiving_namespaces", ns)
			continue
		}
		s := v.GetStructValue()
		if s == nil {
			x.logf("dynamic_metadata namespace %q dropped: not a Struct", ns)
			continue
		}
		cur := x.md.stream[ns]
		if cur == nil {
			cur = &structpb.Struct{Fields: map[string]*structpb.Value{}}
			x.md.stream[ns] = cur
		}
		for k, fv := range s.GetFields() {
			cur.Fields[k] = proto.Clone(fv).(*structpb.Value)
		}
	}
}

// snapshotRouting freezes the metadata the LB will consult (§2.11).
func (x *exchange) snapshotRouting() {
	x.md.routing = map[string]*structpb.Struct{}
	for ns, s := range x.md.stream {
		x.md.routing[ns] = proto.Clone(s).(*structpb.Struct)
	}
}

// maybeClearRouteCache: honoured only on the request path and only with a
// header mutation in the same reply (§3.6).
func (x *exchange) maybeClearRouteCache(d *direction, cr *extprocv3.CommonResponse) {
	if d.response || cr.GetHeaderMutation() == nil || x.cfg.Mutations.DisableClearRouteCache {
		return
	}
	switch x.cfg.Mutations.RouteCacheAction {
	case extprocfilterv3.ExternalProcessor_CLEAR:
		x.rt.reroute = true
	case extprocfilterv3.ExternalProcessor_DEFAULT:
		if cr.GetClearRouteCache() {
			x.rt.reroute = true
		}
	}
}

func (x *exchange) metadataContext() *corev3.Metadata {
	return buildMetadataContext(x.cfg.Metadata.ForwardingNamespaces, x.md.stream)
}

func (x *exchange) forwardAllowed(key string) bool {
	return headerForwardingAllowed(x.cfg.ForwardRules, key)
}
