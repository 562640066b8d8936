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
	"github.com/pd-extproc/pd-extproc/pkg/enginehttp"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// Parts are what a pipeline routes with, ready made (pkg/server assembles
// them from the config file).
type Parts struct {
	Connector kv.Connector
	Table     *api.Table // what is routed: the built-in APIs and routes.passthrough
	Pools     *scheduling.Pools
	Client    *http.Client // of prefill legs
	Scheme    string       // of prefill legs: http, or https
	// DecodeKey is the decode engines' API key, set on the decode leg; nil
	// leaves the client's Authorization.
	DecodeKey *enginehttp.Key
}

// Options are the pipeline's settings.
type Options struct {
	PrefillTimeout time.Duration // the whole prefill phase of a request, retries included
	AttemptTimeout time.Duration // one prefill attempt
	Attempts       int           // prefill endpoints one request may try
	// FailClosed answers a failed prefill phase with its error
	// (prefill.on_failure: fail) instead of sending the request to decode alone.
	FailClosed   bool
	MaxBodyBytes int64
	Connector    string // its name, for the errors that name it
	// RewriteUsage gives P/D answers the prefill engine's cached tokens,
	// holding at most MaxResponseBytes of an answer for it.
	RewriteUsage     bool
	MaxResponseBytes int64
	// MaxBackground bounds the concurrent prefill legs (kv-sglang,
	// kv-mooncake) running at once; past it a request gets 503 with RetryAfter.
	MaxBackground int
	RetryAfter    time.Duration
	// PairBuiltinTools disaggregates Responses requests with built-in tools
	// too (routes.pair_builtin_tools).
	PairBuiltinTools bool
	Shedding         Shedding
}

// Shedding holds back, then turns away with 429 and Retry-After, the
// requests whose objective has a negative priority while every endpoint of
// a pool they would use is saturated (admission.*): the engines' capacity
// goes to the others. Priorities nil: none is.
type Shedding struct {
	Priorities map[string]int   // by objective
	Lines      scheduling.Lines // an endpoint's saturation lines (scheduling.Pool.Saturated)
	Hold       time.Duration    // how long such a request waits for room before it is refused; 0: not at all
	MaxHeld    int              // the requests held at once, past which one is refused at once; 0: no bound
	RetryAfter time.Duration    // the 429's
}

// shedder is the pipeline's side of Shedding: its settings as reloaded, and
// a hold per pool, which outlives reloads as the pools do.
type shedder struct {
	settings        atomic.Pointer[Shedding]
	prefill, decode *scheduling.Hold
	waiting         counter // requests in either hold's Wait, against MaxHeld
}

// counter counts what is under way against a bound: background legs,
// requests in the holds.
type counter struct{ n atomic.Int64 }

// take counts one more, unless bound are under way already (0: no bound).
func (c *counter) take(bound int) bool {
	if n := c.n.Add(1); bound > 0 && n > int64(bound) {
		c.n.Add(-1)
		return false
	}
	return true
}

// give counts one fewer.
func (c *counter) give() { c.n.Add(-1) }

// Pipeline routes requests. It is safe for concurrent use.
type Pipeline struct {
	connector  kv.Connector
	table      *api.Table // what is routed: the built-in APIs and routes.passthrough
	pools      *scheduling.Pools
	opts       Options
	client     *http.Client
	scheme     string // of prefill legs: http, or https with prefill.tls
	decodeKey  *enginehttp.Key
	shedding   shedder
	log        logr.Logger
	background backgroundLegs
	suspects   sync.Map // prefill endpoints already logged for an unreachable remote_host

	metrics    *metrics.Metrics // nil records nothing
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
}

// Option adds an optional collaborator to New.
type Option func(*Pipeline)

// WithMetrics records prefill attempts and missing KV params in m.
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

// New returns a pipeline that routes with parts.
func New(parts Parts, opts Options, log logr.Logger, options ...Option) *Pipeline {
	p := &Pipeline{
		connector:  parts.Connector,
		table:      parts.Table,
		pools:      parts.Pools,
		opts:       opts,
		client:     parts.Client,
		scheme:     parts.Scheme,
		decodeKey:  parts.DecodeKey,
		log:        log,
		tracer:     noop.NewTracerProvider().Tracer(""),
		propagator: propagation.TraceContext{},
	}
	for _, o := range options {
		o(p)
	}
	p.background.end, p.background.stop = context.WithCancel(context.Background())
	p.shedding.prefill, p.shedding.decode = scheduling.NewHold(p.pools.Prefill), scheduling.NewHold(p.pools.Decode)
	p.SetShedding(opts.Shedding)
	return p
}

// MaxBodyBytes is the largest request body accepted.
func (p *Pipeline) MaxBodyBytes() int64 { return p.opts.MaxBodyBytes }

// Pools returns the endpoint pools, for health and metrics to read.
func (p *Pipeline) Pools() (prefill, decode *scheduling.Pool) { return p.pools.Prefill, p.pools.Decode }

// Paired reports whether the connector's decode engines serve only
// prefill/decode pairs: no request the API table pairs goes decode-only,
// so none is served without a prefill endpoint.
func (p *Pipeline) Paired() bool { return p.connector.Paired() }

// Run does the pools' background work (health checks, load scrapes, DNS) until
// ctx is done.
func (p *Pipeline) Run(ctx context.Context) { p.pools.Run(ctx) }

// Reload applies new pools, policies and P/D thresholds, and the parallel
// sampling switch. Requests in flight keep their endpoints. Whether legs are
// paired stays the running connector's: a new connector takes effect on
// restart only.
func (p *Pipeline) Reload(spec scheduling.Spec) {
	spec.Paired = p.connector.Paired()
	p.pools.Update(spec)
}

// Held is how many requests wait for room in each pool (admission.hold).
func (p *Pipeline) Held() (prefill, decode int) {
	return p.shedding.prefill.Len(), p.shedding.decode.Len()
}

// SetShedding applies reloaded admission.* keys to the requests routed from
// now on, and its saturation lines and hold to those held too: those of an
// objective it sheds no more go on at once.
func (p *Pipeline) SetShedding(s Shedding) {
	p.shedding.settings.Store(&s)
	p.shedding.prefill.Set(s.Lines, s.Hold, s.Priorities)
	p.shedding.decode.Set(s.Lines, s.Hold, s.Priorities)
}

// Wait blocks until every background prefill leg has ended.
func (p *Pipeline) Wait() { p.background.running.Wait() }

// Stop cuts short the background prefill legs still running (a shutdown's
// grace is over: their streams are gone, and so are the decode requests
// they were to pair with); Wait then returns once they have noticed.
func (p *Pipeline) Stop() { p.background.stop() }

// Drain answers at once, with a 503 and Retry-After, the requests held for
// room (admission.hold) and those that would be held from now on: at
// shutdown no room comes before the grace runs out and cuts their streams.
func (p *Pipeline) Drain() {
	p.shedding.prefill.Close()
	p.shedding.decode.Close()
}

// backgroundLegs are the concurrent prefill legs (kv-sglang, kv-mooncake)
// still running after their streams.
type backgroundLegs struct {
	running sync.WaitGroup
	count   counter         // how many, against Options.MaxBackground
	end     context.Context // done once Stop cuts them short
	stop    context.CancelFunc
}
