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
	"sync/atomic"
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

// maxModelBytes bounds a model name: real ones are tens of bytes, and a longer
// one would only cost a prefill leg to be refused (and echoed back) by the engine.
const maxModelBytes = 1024

// Options are the pipeline's settings, taken from the config file.
type Options struct {
	PrefillTimeout time.Duration // the whole prefill phase of a request, retries included
	AttemptTimeout time.Duration // one prefill attempt
	Attempts       int           // prefill endpoints one request may try
	OnFailure      string        // config.OnFailureDecodeOnly or config.OnFailureFail
	BootstrapPort  int
	MaxBodyBytes   int64
}

// Pipeline routes requests. It is safe for concurrent use.
type Pipeline struct {
	connector  kv.Connector
	pools      *scheduling.Pools
	opts       Options
	client     *http.Client
	scheme     string // of prefill legs: http, or https with prefill.tls
	log        logr.Logger
	background sync.WaitGroup // concurrent (SGLang) prefill legs still running

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
	p := &Pipeline{
		connector: c,
		pools:     scheduling.NewPools(schedulingSpec(cfg, c), scheduling.Deps{Log: log.WithName("scheduling")}),
		opts: Options{
			PrefillTimeout: cfg.Prefill.Timeout.D(),
			AttemptTimeout: cfg.Prefill.AttemptTimeout.D(),
			Attempts:       cfg.Prefill.Attempts,
			OnFailure:      cfg.Prefill.OnFailure,
			BootstrapPort:  cfg.Pools.Prefill.BootstrapPort,
			MaxBodyBytes:   cfg.Limits.MaxBodyBytes,
		},
		client:     client,
		scheme:     scheme,
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

// Reload applies a new configuration's pools, policies and P/D thresholds.
// Requests in flight keep their endpoints; other keys take effect on restart.
func (p *Pipeline) Reload(cfg *config.Config) { p.pools.Update(schedulingSpec(cfg, p.connector)) }

// Request is what the pipeline needs of one client request.
type Request struct {
	Path      string      // :path, query included
	RequestID string      // sent on both legs
	Forward   http.Header // client headers copied onto the prefill leg (e.g. Authorization)
	Body      []byte      // nil for a request without a body
	// Subset is the endpoint-picker subset hint as Envoy sent it in metadata
	// (envoy.lb.subset_hint): nil when absent, else a list of ip:port or a
	// comma-separated string. Decode endpoints outside it are never picked.
	Subset any

	// Report is filled in by Route and RouteHeaders, whether they succeed or
	// fail, with what the caller logs and counts.
	Report Report

	scan body.Scanner // what has been validated of Body while it arrived
}

// Arrived passes the body received so far, while the rest is on its way: it
// is validated now, so that Route has only the tail left to scan. Each call's
// body must begin with the previous one's bytes, and Body must begin with them all.
func (r *Request) Arrived(sofar []byte) { r.scan.Scan(sofar) }

// BodyHeld reports whether a prefill leg may read Body after Route returned:
// net/http may still be writing a leg when the engine has answered, and a
// concurrent leg runs on its own. Until Route returns, only Route reads Body.
func (r *Request) BodyHeld() bool { return r.Report.Prefill != "" }

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
	// Endpoint is the decode endpoint, ip:port, followed by the fallbacks of
	// pools.decode.fallbacks when configured (comma-separated, in order).
	Endpoint string
	Body     body.Spliced // the decode leg's body; nil when the request has none
	decode   *scheduling.Endpoint
	release  func()
	// partnerFailed is set when a concurrent prefill leg failed: the decode
	// engine's 5xx is then the pair's failure, not the decode endpoint's.
	partnerFailed atomic.Bool
}

// Release frees the decode endpoint's slot; call it when the exchange ends.
func (d *Decision) Release() {
	if d != nil && d.release != nil {
		d.release()
	}
}

// Observe reports the decode engine's response status, so that an endpoint
// answering 5xx is ejected like one that refuses connections.
func (d *Decision) Observe(status int) {
	switch {
	case d == nil || d.decode == nil:
	case status >= 500 && d.partnerFailed.Load():
	case status >= 500:
		d.decode.ReportFailure()
	default:
		d.decode.ReportSuccess()
	}
}

// pickDecode chooses the decode endpoint (and fallbacks) and takes its slot.
func (p *Pipeline) pickDecode(req *scheduling.Request) (*Decision, error) {
	eps, err := p.pools.Decode.SelectN(req, 1+p.pools.Decode.Fallbacks())
	if err != nil {
		return nil, noDecodeEndpoint(err)
	}
	addrs := make([]string, len(eps))
	for i, e := range eps {
		addrs[i] = e.Addr
	}
	return &Decision{Endpoint: strings.Join(addrs, ","), decode: eps[0], release: eps[0].Acquire()}, nil
}

// RouteHeaders routes a request that has no body to a decode endpoint.
func (p *Pipeline) RouteHeaders(r *Request) (*Decision, error) {
	r.Report = Report{Mode: ModeDecodeOnly, Reason: metrics.ReasonNoBody}
	d, err := p.pickDecode(&scheduling.Request{N: 1, Prompts: 1, Subset: scheduling.ParseSubset(r.Subset)})
	if err != nil {
		return nil, err
	}
	r.Report.Decode = d.Endpoint
	p.metrics.Decision(r.Report.Reason)
	return d, nil
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
	obj, err := r.scan.Object(r.Body)
	if err != nil {
		return nil, badRequest("%v", err)
	}
	model, ok := obj.String("model")
	switch {
	case !ok || model == "":
		return nil, badRequest("the request has no \"model\" string")
	case len(model) > maxModelBytes:
		return nil, badRequest("\"model\" is %d bytes long; model names are at most %d", len(model), maxModelBytes)
	}
	sreq := scheduling.NewRequest(obj)
	sreq.Subset = scheduling.ParseSubset(r.Subset)
	d, err := p.pickDecode(sreq)
	if err != nil {
		return nil, err
	}
	r.Report.Decode = d.Endpoint
	d.Body, err = p.legs(ctx, r, obj, sreq, d)
	if err != nil {
		d.Release()
		return nil, err
	}
	p.metrics.Decision(r.Report.Reason)
	return d, nil
}

// legs decides P/D or decode-only, runs or launches the prefill leg, and returns
// the decode leg's body. It records the decision in r.Report.
func (p *Pipeline) legs(ctx context.Context, r *Request, obj *body.Object, sreq *scheduling.Request, d *Decision) (body.Spliced, error) {
	rep := &r.Report
	decision := p.pools.Decide(sreq)
	rep.Reason = decision.Reason
	switch {
	case decision.PD:
	case p.connector.Paired():
		return nil, noPrefillEndpoint()
	default:
		rep.Mode = ModeDecodeOnly
		return kv.Scrubbed(obj), nil
	}
	rep.Mode = ModePD
	h := &kv.Handoff{
		Body:          obj,
		BootstrapPort: p.opts.BootstrapPort,
		Room:          rand.Uint64() >> 1, // 0..2^63-1, as SGLang's routers draw it
	}
	if p.connector.Dispatch() == kv.Concurrent {
		prefill, err := p.pools.Prefill.Select(sreq)
		if err != nil {
			return nil, noPrefillEndpoint()
		}
		rep.Prefill = prefill.Addr
		h.PrefillHost = bootstrapHost(prefill.Addr)
		p.launch(ctx, prefill, r, kv.PrefillBody(p.connector, h), d)
		return kv.DecodeBody(p.connector, h), nil
	}
	params, err := p.runPrefill(ctx, sreq, r, h)
	if err != nil {
		return p.withoutPrefill(r, obj, err)
	}
	if params == nil && p.connector.HandsBackParams() {
		p.metrics.KVParamsMissing()
		p.log.Info("prefill returned no kv_transfer_params; decode will recompute the prompt",
			"requestID", r.RequestID, "prefill", rep.Prefill)
	}
	h.PrefillKV = params
	return kv.DecodeBody(p.connector, h), nil
}

// withoutPrefill applies prefill.on_failure once the prefill leg could not be
// had: the decode engine recomputes the prompt, or the client gets the error.
// An engine's own 4xx (about the request) and a client that left always end here.
func (p *Pipeline) withoutPrefill(r *Request, obj *body.Object, err error) (body.Spliced, error) {
	r.Report.Reason = metrics.ReasonPrefillFailed
	if last := lastAttempt(err); p.opts.OnFailure == config.OnFailureFail || last != nil && (last.aboutRequest() || last.clientLeft()) {
		return nil, prefillFailed(err)
	}
	r.Report.Mode = ModeDecodeOnly
	p.log.Info("prefill failed; decode will recompute the prompt", "requestID", r.RequestID, "error", err.Error())
	return kv.Scrubbed(obj), nil
}

// runPrefill sends the sequential prefill leg to one endpoint after another
// until one answers, within prefill.attempts and prefill.timeout. An engine 4xx
// ends it at once: another endpoint would refuse the same request.
func (p *Pipeline) runPrefill(ctx context.Context, sreq *scheduling.Request, r *Request, h *kv.Handoff) ([]byte, error) {
	start := time.Now()
	defer func() { r.Report.PrefillTime = time.Since(start) }()
	ctx, cancel := context.WithTimeout(ctx, p.opts.PrefillTimeout)
	defer cancel()
	attempts := p.pools.Prefill.Attempts(sreq, p.opts.Attempts)
	var last error
	for {
		ep, err := attempts.Next()
		if err != nil {
			return nil, errors.Join(last, err)
		}
		r.Report.Prefill = ep.Addr
		h.PrefillHost = bootstrapHost(ep.Addr)
		release := ep.Acquire()
		params, failed := p.attempt(ctx, ep.Addr, r, kv.PrefillBody(p.connector, h))
		release()
		if failed == nil {
			ep.ReportSuccess()
			return params, nil
		}
		switch {
		case failed.blames(false):
			ep.ReportFailure()
		case failed.aboutRequest():
			ep.ReportSuccess() // the engine is fine; the request is not
		}
		if !failed.retryable() {
			return nil, failed
		}
		last = failed
		p.log.V(1).Info("prefill attempt failed", "requestID", r.RequestID, "prefill", ep.Addr, "error", failed.Error())
	}
}

// launch sends a concurrent prefill leg in the background. It runs on its own
// deadline: Envoy closes the ext_proc stream as soon as its last reply is in,
// which must not cancel a leg the decode engine is waiting to pair with.
//
// The legs fail together: a prefill whose decode never connects answers 5xx,
// and a decode whose prefill failed does too. So only a leg that got no answer
// counts against the prefill endpoint, and a failed leg spares its decode
// endpoint the blame for the 5xx that follows (Decision.Observe).
func (p *Pipeline) launch(ctx context.Context, ep *scheduling.Endpoint, r *Request, leg body.Spliced, d *Decision) {
	release := ep.Acquire()
	ctx = context.WithoutCancel(ctx)
	p.background.Go(func() {
		defer release()
		ctx, cancel := context.WithTimeout(ctx, p.opts.PrefillTimeout)
		defer cancel()
		if _, failed := p.attempt(ctx, ep.Addr, r, leg); failed != nil {
			d.partnerFailed.Store(true)
			if failed.blames(true) {
				ep.ReportFailure()
			}
			p.log.Info("concurrent prefill leg failed", "requestID", r.RequestID, "prefill", ep.Addr, "error", failed.Error())
			return
		}
		ep.ReportSuccess()
	})
}

// Wait blocks until every background prefill leg has ended.
func (p *Pipeline) Wait() { p.background.Wait() }

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
