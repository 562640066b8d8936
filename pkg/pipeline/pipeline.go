// Package pipeline runs the prefill/decode flow of one request: parse the body,
// decide P/D or decode-only, pick the endpoints, run or launch the prefill leg,
// and build the body Envoy forwards to the decode endpoint. It knows the engines
// only through kv connectors and never sees the ext_proc protocol.
package pipeline

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// Options are the pipeline's settings, taken from the config file.
type Options struct {
	PrefillTimeout time.Duration
	OnFailure      string // config.OnFailureDecodeOnly or config.OnFailureFail
	BootstrapPort  int
	MaxBodyBytes   int64
}

// Pipeline routes requests. It is safe for concurrent use.
type Pipeline struct {
	connector       kv.Connector
	prefill, decode *scheduling.Pool
	opts            Options
	client          *http.Client
	log             logr.Logger
	background      sync.WaitGroup // concurrent (SGLang) prefill legs still running

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
	p := &Pipeline{
		connector: c,
		prefill:   scheduling.NewPool("prefill", cfg.Pools.Prefill.Endpoints),
		decode:    scheduling.NewPool("decode", cfg.Pools.Decode.Endpoints),
		opts: Options{
			PrefillTimeout: cfg.Prefill.Timeout.D(),
			OnFailure:      cfg.Prefill.OnFailure,
			BootstrapPort:  cfg.Pools.Prefill.BootstrapPort,
			MaxBodyBytes:   cfg.Limits.MaxBodyBytes,
		},
		client:     newEngineClient(),
		log:        log,
		tracer:     noop.NewTracerProvider().Tracer(""),
		propagator: propagation.TraceContext{},
	}
	for _, o := range options {
		o(p)
	}
	return p, nil
}

// MaxBodyBytes is the largest request body accepted.
func (p *Pipeline) MaxBodyBytes() int64 { return p.opts.MaxBodyBytes }

// Pools returns the endpoint pools, for health and metrics to read.
func (p *Pipeline) Pools() (prefill, decode *scheduling.Pool) { return p.prefill, p.decode }

// Request is what the pipeline needs of one client request.
type Request struct {
	Path      string      // :path, query included
	RequestID string      // sent on both legs
	Forward   http.Header // client headers copied onto the prefill leg (e.g. Authorization)
	Body      []byte      // nil for a request without a body

	// Report is filled in by Route and RouteHeaders, whether they succeed or
	// fail, with what the caller logs and counts.
	Report Report
}

// Report is what routing one request did. On a failure it holds what was
// reached: a prefill failure under on_failure=fail keeps Mode pd.
type Report struct {
	Mode        string        // ModePD or ModeDecodeOnly; "" when no mode was chosen
	Reason      string        // why that mode: a metrics.Reason* value
	Decode      string        // decode endpoint
	Prefill     string        // prefill endpoint of the last attempt; "" when no prefill leg was sent
	PrefillTime time.Duration // time spent waiting on sequential prefill legs, retries included
}

// Modes of a routed request.
const (
	ModePD         = metrics.ModePD
	ModeDecodeOnly = metrics.ModeDecodeOnly
)

// APIOf names the OpenAI API a request path belongs to, as metrics and logs
// label it; the pipeline routes only chat and completions.
func APIOf(path string) string {
	path, _, _ = strings.Cut(path, "?")
	switch path {
	case "/v1/chat/completions":
		return metrics.APIChat
	case "/v1/completions":
		return metrics.APICompletions
	}
	return metrics.APIOther
}

// Decision is where a request goes and with which body.
type Decision struct {
	Endpoint string // decode endpoint, ip:port
	Body     []byte // the decode leg's body; nil when the request has none
	Mode     string
	release  func()
}

// Release frees the decode endpoint's slot; call it when the exchange ends.
func (d *Decision) Release() {
	if d != nil && d.release != nil {
		d.release()
	}
}

// RouteHeaders routes a request that has no body to a decode endpoint.
func (p *Pipeline) RouteHeaders(r *Request) (*Decision, error) {
	r.Report = Report{Mode: ModeDecodeOnly, Reason: metrics.ReasonNoBody}
	ep := p.decode.Pick()
	if ep == nil {
		return nil, noDecodeEndpoint()
	}
	r.Report.Decode = ep.Addr
	p.metrics.Decision(r.Report.Reason)
	return &Decision{Endpoint: ep.Addr, Mode: ModeDecodeOnly, release: ep.Acquire()}, nil
}

// Route runs the flow for a request with a body. Errors are *Error.
func (p *Pipeline) Route(ctx context.Context, r *Request) (*Decision, error) {
	r.Report = Report{}
	if APIOf(r.Path) == metrics.APIOther {
		path, _, _ := strings.Cut(r.Path, "?")
		return nil, notFound(path)
	}
	if int64(len(r.Body)) > p.opts.MaxBodyBytes {
		return nil, TooLarge(p.opts.MaxBodyBytes)
	}
	obj, err := body.Parse(r.Body)
	if err != nil {
		return nil, badRequest("%v", err)
	}
	if model, ok := obj.String("model"); !ok || model == "" {
		return nil, badRequest("the request has no \"model\" string")
	}
	decode := p.decode.Pick()
	if decode == nil {
		return nil, noDecodeEndpoint()
	}
	r.Report.Decode = decode.Addr
	d := &Decision{Endpoint: decode.Addr, release: decode.Acquire()}
	d.Body, err = p.legs(ctx, r, obj)
	if err != nil {
		d.Release()
		return nil, err
	}
	d.Mode = r.Report.Mode
	p.metrics.Decision(r.Report.Reason)
	return d, nil
}

// legs decides P/D or decode-only, runs or launches the prefill leg, and returns
// the decode leg's body. It records the decision in r.Report.
func (p *Pipeline) legs(ctx context.Context, r *Request, obj *body.Object) ([]byte, error) {
	rep := &r.Report
	if n, ok := obj.Int("n"); ok && n > 1 {
		rep.Mode, rep.Reason = ModeDecodeOnly, metrics.ReasonNGT1 // vLLM cannot hand off n>1 sequences
		return kv.Scrubbed(obj), nil
	}
	prefill := p.prefill.Pick()
	if prefill == nil {
		rep.Mode, rep.Reason = ModeDecodeOnly, metrics.ReasonNoPrefillEndpoint
		return kv.Scrubbed(obj), nil
	}
	rep.Mode, rep.Reason, rep.Prefill = ModePD, metrics.ReasonPD, prefill.Addr
	h := &kv.Handoff{
		Body:          obj,
		PrefillHost:   bootstrapHost(prefill.Addr),
		BootstrapPort: p.opts.BootstrapPort,
		Room:          rand.Uint64() >> 1, // 0..2^63-1, as SGLang's routers draw it
	}
	if p.connector.Dispatch() == kv.Concurrent {
		p.launch(ctx, prefill, r, kv.PrefillBody(p.connector, h))
		return kv.DecodeBody(p.connector, h), nil
	}
	params, err := p.runPrefill(ctx, prefill, r, kv.PrefillBody(p.connector, h))
	if err != nil {
		rep.Reason = metrics.ReasonPrefillFailed
		var e *Error
		if errors.As(err, &e) || p.opts.OnFailure == config.OnFailureFail || ctx.Err() != nil {
			return nil, failure(err)
		}
		rep.Mode = ModeDecodeOnly
		p.log.Info("prefill failed; decode will recompute the prompt", "requestID", r.RequestID, "error", err.Error())
		return kv.Scrubbed(obj), nil
	}
	if params == nil && p.connector.Name() == kv.NIXL {
		p.metrics.KVParamsMissing()
		p.log.Info("prefill returned no kv_transfer_params; decode will recompute the prompt",
			"requestID", r.RequestID, "prefill", rep.Prefill)
	}
	h.PrefillKV = params
	return kv.DecodeBody(p.connector, h), nil
}

// runPrefill sends the prefill leg, retrying once on another endpoint after a
// failure another endpoint might not have. An engine 4xx comes back as *Error.
func (p *Pipeline) runPrefill(ctx context.Context, first *scheduling.Endpoint, r *Request, leg []byte) ([]byte, error) {
	start := time.Now()
	defer func() { r.Report.PrefillTime = time.Since(start) }()
	ep, tried := first, []string{}
	for {
		r.Report.Prefill = ep.Addr
		release := ep.Acquire()
		params, err := p.attempt(ctx, ep.Addr, r, leg)
		release()
		if err == nil {
			return params, nil
		}
		if se, ok := err.(*statusError); ok && !retryable(err) {
			return nil, engineError(se.status, se.body, se.contentType)
		}
		tried = append(tried, ep.Addr)
		if ctx.Err() != nil || len(tried) > 1 {
			return nil, err
		}
		if ep = p.prefill.Pick(tried...); ep == nil {
			return nil, err
		}
		p.log.V(1).Info("retrying prefill on another endpoint", "requestID", r.RequestID, "failed", tried[0], "error", err.Error())
	}
}

// launch sends a concurrent prefill leg in the background. It runs on its own
// deadline: Envoy closes the ext_proc stream as soon as its last reply is in,
// which must not cancel a leg the decode engine is waiting to pair with.
func (p *Pipeline) launch(ctx context.Context, ep *scheduling.Endpoint, r *Request, leg []byte) {
	release := ep.Acquire()
	ctx = context.WithoutCancel(ctx)
	p.background.Go(func() {
		defer release()
		if _, err := p.attempt(ctx, ep.Addr, r, leg); err != nil {
			p.log.Info("concurrent prefill leg failed", "requestID", r.RequestID, "prefill", ep.Addr, "error", err.Error())
		}
	})
}

// Wait blocks until every background prefill leg has ended.
func (p *Pipeline) Wait() { p.background.Wait() }

func failure(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return prefillFailed(err)
}

// bootstrapHost is the host part of ip:port, IPv6 in brackets as SGLang expects.
func bootstrapHost(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if strings.Contains(host, ":") {
		return "[" + host + "]"
	}
	return host
}
