// Package handlers speaks Envoy's ext_proc protocol: one Process stream per HTTP
// request, a small state machine per direction, each body mode answered exactly
// as Envoy drives it (docs/envoy.md; section numbers (§) in this package refer
// to it). What to do with a request is the pipeline's business; this package
// only knows Envoy.
package handlers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
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

	// Metrics counts streams and requests; nil counts nothing.
	Metrics *metrics.Metrics
	// TracerProvider gives each request a span, joined to the trace of the
	// caller's traceparent header as read by Propagator; nil traces nothing.
	TracerProvider trace.TracerProvider
	// Propagator reads the caller's trace context from the request headers;
	// nil means W3C Trace Context.
	Propagator propagation.TextMapPropagator
	// LogPrompts adds the request body to the per-request log line. Off by
	// default: prompts are user data.
	LogPrompts bool
	// MaxStreams bounds the streams (requests) in progress, each counted from
	// its first message; past it a request gets 429 with Retry-After
	// (RetryAfter). 0 means no bound.
	MaxStreams int
	RetryAfter time.Duration
	// BodyTimeout bounds the time from a stream's first message until its
	// request body is complete; past it the request gets 408 and gives back
	// its slot and buffer. 0 means no bound.
	BodyTimeout time.Duration
	// MaxBufferedBytes bounds the request bodies held at once, all streams
	// together; a body that would pass it gets 503 with Retry-After. 0 means
	// no bound.
	MaxBufferedBytes int64
}

// Server implements envoy.service.ext_proc.v3.ExternalProcessor.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	streams atomic.Int64 // streams holding a slot of Options.MaxStreams
	bodies  budget       // the request bodies held, against Options.MaxBufferedBytes
	router  Router
	opts    Options
	obs     observer
}

// NewServer returns an ext_proc server routing with r.
func NewServer(r Router, opts Options, log logr.Logger) *Server {
	if opts.TracerProvider == nil {
		opts.TracerProvider = noop.NewTracerProvider()
	}
	if opts.Propagator == nil {
		opts.Propagator = propagation.TraceContext{}
	}
	s := &Server{router: r, opts: opts, obs: observer{
		metrics:     opts.Metrics,
		log:         log,
		tracer:      opts.TracerProvider.Tracer("github.com/pd-extproc/pd-extproc/pkg/handlers"),
		propagator:  opts.Propagator,
		traceFields: map[string]bool{},
		logPrompts:  opts.LogPrompts,
	}}
	for _, f := range opts.Propagator.Fields() {
		s.obs.traceFields[f] = true
	}
	s.bodies.limit, s.bodies.metrics = opts.MaxBufferedBytes, opts.Metrics
	return s
}

// Process handles the messages of one HTTP request until Envoy closes the
// stream. It alone reads the stream; the exchange answers each message.
//
// A panic in its handling is a bug: it ends this stream with INTERNAL (Envoy
// answers its request 500) and is logged with its stack and counted, and the
// replica's other streams go on, as net/http does for a handler. gRPC does
// not, and every generation this replica holds would end with it.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) (err error) {
	x := s.open(stream.Context(), stream)
	defer s.close(x)
	defer func() {
		if p := recover(); p != nil {
			s.obs.log.Error(nil, "a bug: handling a stream panicked; the stream ends with INTERNAL", "requestID", x.req.RequestID, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			s.opts.Metrics.Panicked()
			x.mu.Lock() // the request's line and count say 5xx, as Envoy answers, not cancelled
			x.obs.panicked(&x.req, p, x.body.bytes())
			x.mu.Unlock()
			err = status.Error(codes.Internal, "pd-extproc: internal error")
		}
	}()
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

// open starts the exchange of a new stream, whose replies go to out. It
// takes a slot of Options.MaxStreams only at the stream's first message.
func (s *Server) open(ctx context.Context, out sink) *exchange {
	s.opts.Metrics.StreamOpened()
	x := &exchange{router: s.router, opts: &s.opts, out: newReplies(out), ctx: ctx, obs: observation{observer: &s.obs}}
	x.lim.streams, x.body.budget = &s.streams, &s.bodies
	return x
}

// close ends the exchange of a stream that ended.
func (s *Server) close(x *exchange) {
	defer s.opts.Metrics.StreamClosed()
	x.end()
}
