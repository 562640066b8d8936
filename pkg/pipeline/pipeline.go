// Package pipeline runs the prefill/decode flow of one request: parse the body,
// decide P/D or decode-only, pick the endpoints, run or launch the prefill leg,
// and build the body Envoy forwards to the decode endpoint. It knows the engines
// only through kv connectors and never sees the ext_proc protocol.
package pipeline

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// Options are the pipeline's settings, taken from the config file.
type Options struct {
	PrefillTimeout time.Duration // the whole prefill phase of a request, retries included
	AttemptTimeout time.Duration // one prefill attempt
	Attempts       int           // prefill endpoints one request may try
	OnFailure      string        // config.OnFailureDecodeOnly or config.OnFailureFail
	BootstrapPort  int
	MaxBodyBytes   int64
	Connector      string // its name, for the errors that name it
	// RewriteUsage gives P/D answers the prefill engine's cached tokens,
	// holding at most MaxResponseBytes of an answer for it.
	RewriteUsage     bool
	MaxResponseBytes int64
	// MaxBackground bounds the concurrent (SGLang) prefill legs running at
	// once; past it a request gets 503 with RetryAfter.
	MaxBackground int
	RetryAfter    time.Duration
}

// Pipeline routes requests. It is safe for concurrent use.
type Pipeline struct {
	connector    kv.Connector
	table        *api.Table // what is routed: the built-in APIs and routes.passthrough
	pools        *scheduling.Pools
	opts         Options
	client       *http.Client
	scheme       string // of prefill legs: http, or https with prefill.tls
	log          logr.Logger
	background   sync.WaitGroup // concurrent (SGLang) prefill legs still running
	inBackground atomic.Int64   // how many, against Options.MaxBackground
	// parallelRooms: pd.sglang_parallel_sampling is rooms (it follows reloads).
	parallelRooms atomic.Bool
	suspects      sync.Map // prefill endpoints already logged for an unreachable remote_host

	metrics    *metrics.Metrics // nil records nothing
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
}

// Option adds an optional collaborator to New.
type Option func(*Pipeline)

// WithMetrics records prefill attempts, P/D decisions and missing KV params in m.
func WithMetrics(m *metrics.Metrics) Option { return func(p *Pipeline) { p.metrics = m } }

// WithTracing starts a span for each prefill attempt from tp and writes the
// trace context into the prefill request's headers with prop. Without it, the
// caller's W3C traceparent (already in the context) is still passed on.
func WithTracing(tp trace.TracerProvider, prop propagation.TextMapPropagator) Option {
	return func(p *Pipeline) {
		p.tracer = tp.Tracer("github.com/pd-extproc/pd-extproc/pkg/pipeline")
		p.propagator = prop
	}
}

// New builds a pipeline from a validated config.
func New(cfg *config.Config, log logr.Logger, options ...Option) (*Pipeline, error) {
	c, err := kv.Build(cfg.Connector)
	if err != nil {
		return nil, err
	}
	client, scheme, err := newEngineClient(cfg.Prefill)
	if err != nil {
		return nil, err
	}
	routes, err := api.ParseRoutes("routes.passthrough", cfg.Routes.Passthrough)
	if err != nil {
		return nil, err
	}
	// Each pool's health checks and scrapes speak as its engines serve: the
	// prefill pool as the prefill legs, the decode pool as pools.decode.tls says.
	deps := scheduling.Deps{Log: log.WithName("scheduling")}
	if deps.PrefillTLS, err = engineTLS("prefill.tls", cfg.Prefill.TLS); err != nil {
		return nil, err
	}
	if deps.DecodeTLS, err = engineTLS("pools.decode.tls", cfg.Pools.Decode.TLS); err != nil {
		return nil, err
	}
	p := &Pipeline{
		connector: c,
		table:     api.NewTable(routes),
		pools:     scheduling.NewPools(schedulingSpec(cfg, c), deps),
		opts: Options{
			PrefillTimeout:   cfg.Prefill.Timeout.D(),
			AttemptTimeout:   cfg.Prefill.AttemptTimeout.D(),
			Attempts:         cfg.Prefill.Attempts,
			OnFailure:        cfg.Prefill.OnFailure,
			BootstrapPort:    cfg.Pools.Prefill.BootstrapPort,
			MaxBodyBytes:     cfg.Limits.MaxBodyBytes,
			Connector:        cfg.Connector,
			RewriteUsage:     cfg.Response.RewriteUsage,
			MaxResponseBytes: cfg.Response.MaxBodyBytes,
			MaxBackground:    cfg.Prefill.MaxBackground,
			RetryAfter:       cfg.Limits.RetryAfter.D(),
		},
		client:     client,
		scheme:     scheme,
		log:        log,
		tracer:     noop.NewTracerProvider().Tracer(""),
		propagator: propagation.TraceContext{},
	}
	p.parallelRooms.Store(cfg.PD.SGLangParallelSampling == config.ParallelSamplingRooms)
	for _, o := range options {
		o(p)
	}
	return p, nil
}

// MaxBodyBytes is the largest request body accepted.
func (p *Pipeline) MaxBodyBytes() int64 { return p.opts.MaxBodyBytes }

// schedulingSpec is the part of cfg that scheduling follows, and that a config
// reload can change without a restart. Whether legs are paired is the running
// connector's: a new connector takes effect on restart only.
func schedulingSpec(cfg *config.Config, c kv.Connector) scheduling.Spec {
	return scheduling.Spec{
		Prefill: scheduling.PoolSpec{Endpoints: cfg.Pools.Prefill.Endpoints, PoolScheduling: cfg.Pools.Prefill.PoolScheduling},
		Decode:  scheduling.PoolSpec{Endpoints: cfg.Pools.Decode.Endpoints, PoolScheduling: cfg.Pools.Decode.PoolScheduling},
		PD:      cfg.PD,
		Paired:  c.Paired(),
	}
}

// Pools returns the endpoint pools, for health and metrics to read.
func (p *Pipeline) Pools() (prefill, decode *scheduling.Pool) { return p.pools.Prefill, p.pools.Decode }

// Run does the pools' background work (health checks, load scrapes, DNS) until
// ctx is done.
func (p *Pipeline) Run(ctx context.Context) { p.pools.Run(ctx) }

// Reload applies a new configuration's pools, policies and pd.* keys.
// Requests in flight keep their endpoints; other keys take effect on restart.
func (p *Pipeline) Reload(cfg *config.Config) {
	p.pools.Update(schedulingSpec(cfg, p.connector))
	p.parallelRooms.Store(cfg.PD.SGLangParallelSampling == config.ParallelSamplingRooms)
}

// Wait blocks until every background prefill leg has ended.
func (p *Pipeline) Wait() { p.background.Wait() }
