package pipeline

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"strings"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// maxModelBytes bounds a model name: real ones are tens of bytes, and a longer
// one would only cost a prefill leg to be refused (and echoed back) by the engine.
const maxModelBytes = 1024

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
		h.BootstrapPort = prefill.BootstrapPort(p.opts.BootstrapPort)
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
	last := lastAttempt(err) // nil when no endpoint could be tried
	if p.opts.OnFailure == config.OnFailureFail || last != nil && (last.aboutRequest() || last.clientLeft()) {
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
		h.BootstrapPort = ep.BootstrapPort(p.opts.BootstrapPort)
		release := ep.Acquire()
		params, failed := p.attempt(ctx, ep.Addr, r, kv.PrefillBody(p.connector, h))
		release()
		if failed == nil {
			ep.ReportSuccess()
			return params, nil
		}
		switch {
		case failed.blames(kv.Sequential):
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
// and a decode whose prefill failed does too. So a failed leg spares its
// decode endpoint the blame for the 5xx that follows (Decision.Observe), and
// an answer spares its own (attemptError.blames).
func (p *Pipeline) launch(ctx context.Context, ep *scheduling.Endpoint, r *Request, leg body.Spliced, d *Decision) {
	release := ep.Acquire()
	ctx = context.WithoutCancel(ctx)
	p.background.Go(func() {
		defer release()
		ctx, cancel := context.WithTimeout(ctx, p.opts.PrefillTimeout)
		defer cancel()
		if _, failed := p.attempt(ctx, ep.Addr, r, leg); failed != nil {
			d.partnerFailed.Store(true)
			if failed.blames(kv.Concurrent) {
				ep.ReportFailure()
			}
			p.log.Info("concurrent prefill leg failed", "requestID", r.RequestID, "prefill", ep.Addr, "error", failed.Error())
			return
		}
		ep.ReportSuccess()
	})
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
