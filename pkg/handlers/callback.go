package handlers

import (
	"context"
	"sync"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/trace"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// replies is a stream's way out. The stream's goroutine sends every reply,
// and one more goroutine may send one message out of turn: the call-back of
// a request whose concurrent prefill leg failed (watchLeg). gRPC takes one
// sender at a time.
type replies struct {
	mu  sync.Mutex
	out sink
	// closed: nothing more goes out. The call-back answered the request,
	// and Envoy consults the stream no more; or the stream ended, after
	// which gRPC takes no send.
	closed bool
	ended  chan struct{} // closed as the stream ends
}

func newReplies(out sink) *replies { return &replies{out: out, ended: make(chan struct{})} }

func (r *replies) Send(m *extprocv3.ProcessingResponse) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	return r.out.Send(m)
}

// over reports whether nothing more goes out.
func (r *replies) over() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

// close ends the sends as the stream ends, once.
func (r *replies) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	close(r.ended)
}

// callBack sends m, an ImmediateResponse, unless the stream's goroutine has
// seen the decode engine's answer begin (begun). An answer Envoy has sent
// and the stream's goroutine not yet read is not known: the call-back then
// ends it, which only a prefill leg failing as its decode answers can meet.
func (r *replies) callBack(m *extprocv3.ProcessingResponse, begun func() bool) (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || begun() {
		return false, nil
	}
	r.closed = true
	return true, r.out.Send(m)
}

// watchLeg watches a routed request's concurrent prefill leg
// (Decision.LegFailed) until the stream ends. A leg that fails leaves its
// decode request waiting for KV that will not come, holding the decode
// engine's slots until the engine's own timeout (docs/engines.md). So, while
// the decode engine has not answered, the request is called back: an
// ImmediateResponse with the leg's error, which Envoy takes at any time
// before processing is complete. Envoy then answers the client with it (or
// resets a stream whose 200 went out, none of whose tokens can come) and
// resets the decode request, which the engine aborts. It needs the response
// path: without it Envoy closes the stream once the request is routed. The
// request's span ends with the watch, and says the call-back's status.
func (x *exchange) watchLeg(failed <-chan *pipeline.Error) {
	id, anthropic, span := x.req.RequestID, api.AnthropicErrorsAt(x.req.Path), x.obs.leg
	if span == nil { // the observation ended before the routing (none begun)
		span = trace.SpanFromContext(context.Background())
	}
	go func() {
		defer span.End()
		var e *pipeline.Error
		select {
		case e = <-failed:
		case <-x.out.ended:
		}
		if e == nil { // the leg served, or the stream ended first
			return
		}
		sent, err := x.out.callBack(immediate(e, anthropic), x.answer.begun.Load)
		switch {
		case err != nil:
			x.obs.log.V(1).Info("calling back a request whose prefill leg failed", "requestID", id, "error", err.Error())
		case sent:
			answeredWith(span, e.Status, e.Message)
			x.obs.log.Info("the prefill leg failed before the decode engine answered: the request is answered with its error and its decode request reset",
				"requestID", id, "status", e.Status, "error", e.Message)
		}
	}()
}
