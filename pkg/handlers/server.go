// Package handlers speaks Envoy's ext_proc protocol: one Process stream per HTTP
// request, a small state machine per direction, each body mode answered exactly
// as Envoy drives it (see shared/reference/envoy-ext-proc.md). What to do with a
// request is the pipeline's business; this package only knows Envoy.
package handlers

import (
	"context"
	"errors"
	"io"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// Router decides where each request goes; *pipeline.Pipeline implements it.
type Router interface {
	Route(ctx context.Context, r *pipeline.Request) (*pipeline.Decision, error)
	RouteHeaders(r *pipeline.Request) (*pipeline.Decision, error)
	MaxBodyBytes() int64
}

// Options tune the protocol side.
type Options struct {
	// In BUFFERED mode Envoy's message timer runs while we route; when routing
	// (a prefill leg) takes longer than OverrideAfter we send one
	// override_message_timeout of OverrideTimeout. Envoy honours it only up to its
	// max_message_timeout, and at most once per message.
	OverrideAfter   time.Duration
	OverrideTimeout time.Duration
}

// Server implements envoy.service.ext_proc.v3.ExternalProcessor.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	router Router
	opts   Options
	log    logr.Logger
}

// NewServer returns an ext_proc server routing with r.
func NewServer(r Router, opts Options, log logr.Logger) *Server {
	return &Server{router: r, opts: opts, log: log}
}

// Process handles the messages of one HTTP request until Envoy closes the stream.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	x := &exchange{Server: s, stream: stream, ctx: stream.Context()}
	defer x.decision.Release()
	for {
		req, err := stream.Recv()
		switch {
		case err == nil:
		case errors.Is(err, io.EOF), status.Code(err) == codes.Canceled, x.ctx.Err() != nil:
			// Envoy resets the stream once it has every reply it expects (or the
			// client left); a half-close arrives as EOF. Both are normal ends, and
			// every message is answered before the next is read, so nothing is pending.
			return nil
		default:
			return err
		}
		done, err := x.handle(req)
		if err != nil || done {
			return err
		}
	}
}
