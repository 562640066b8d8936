package handlers

import (
	"context"
	"slices"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// Exchange is one stream's exchange driven by a test without gRPC: each
// message goes through the phases as Process hands it over, and the replies go
// to the sink it was opened with.
type Exchange struct {
	s *Server
	x *exchange
}

// Open starts an exchange as Process does for a new stream.
func (s *Server) Open(ctx context.Context, out interface {
	Send(*extprocv3.ProcessingResponse) error
}) *Exchange {
	return &Exchange{s: s, x: s.open(ctx, out)}
}

// Handle answers one message; done, or an error, is where Process returns.
func (e *Exchange) Handle(m *extprocv3.ProcessingRequest) (done bool, err error) {
	return e.x.handle(m)
}

// Close ends the exchange as the end of its stream does.
func (e *Exchange) Close() { e.s.close(e.x) }

// Phase is the reply the exchange answers m with, unsent: its messages in
// order, whether the request is concluded as routed once they are sent, and
// whether the stream is done. The exchange's state moves on as Handle's would.
func (e *Exchange) Phase(m *extprocv3.ProcessingRequest) (msgs []*extprocv3.ProcessingResponse, routed, done bool) {
	e.x.mu.Lock()
	defer e.x.mu.Unlock()
	r := e.x.phase(m)
	return slices.Collect(r.messages), r.routed, r.done
}
