package pipeline

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/response"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// maxModelBytes bounds a model name: real ones are tens of bytes, and a longer
// one would only cost a prefill leg to be refused (and echoed back) by the engine.
const maxModelBytes = 1024

// pickDecode chooses the decode endpoint (and fallbacks) and takes its slot.
// A request whose response id names the pick (named: responseID) gets no
// fallbacks, on which the response would be stored under an id leading elsewhere.
func (p *Pipeline) pickDecode(req *scheduling.Request, named bool) (*Decision, error) {
	n := 1 + p.pools.Decode.Fallbacks()
	if named {
		n = 1
	}
	eps, slot, err := p.pools.Decode.Claim(req, n)
	if err != nil {
		return nil, noDecodeEndpoint(err)
	}
	addrs := make([]string, len(eps))
	for i, e := range eps {
		addrs[i] = e.Addr
	}
	edit := HeaderEdit{Remove: p.connector.ReservedHeaders()}
	if p.decodeKey != nil {
		edit.Authorization = p.decodeKey.Authorization()
	}
	return &Decision{Endpoints: addrs, Headers: edit,
		decode: slot.Taken(), release: slot.Release, elsewhere: len(eps) > 1}, nil
}

// opening reads the opening of the decode engine's streamed answer
// (Observe): an API's data events before the tokens (api.API.Leading), or
// SGLang's /generate chunks, whose abort is a chunk like the others. A
// request without a body (RouteHeaders) has none before the tokens.
func (d *Decision) opening() *response.Opening {
	switch {
	case d.api == nil:
		return response.NewOpening(d.choices, 0)
	case d.api.Name == api.NameSGLangGenerate:
		return response.NewGenerateOpening(d.choices)
	}
	return response.NewOpening(d.choices, d.api.Leading)
}

// RouteHeaders routes a request that has no body: one the pass-through list
// admits goes to a decode endpoint (the model list of a pool of several
// models is answered with Decision.Answer); an API that needs a body is
// refused, and so is every path and method the table does not admit.
func (p *Pipeline) RouteHeaders(r *Request) (*Decision, error) {
	r.Report = Report{}
	a, err := p.match(r)
	if err != nil {
		return nil, err
	}
	if !a.IsPassthrough() {
		return nil, noBody(a)
	}
	list, model := api.Models(r.Method, r.URLPath())
	if list {
		if answer := p.modelList(); answer != nil {
			return &Decision{Answer: answer}, nil
		}
	}
	sreq := &scheduling.Request{N: 1, Prompts: 1, Subset: scheduling.ParseSubset(r.Subset), Model: model,
		Response: api.StoredResponseID(a, r.URLPath(), nil)}
	r.Report.Mode, r.Report.Reason = metrics.ModeDecodeOnly, metrics.ReasonNoBody
	d, err := p.pickDecode(sreq, false)
	if err != nil {
		return nil, err
	}
	r.Report.Decode = d.Endpoints[0]
	return d, nil
}

// match finds the request's API in the table and labels the request with it.
func (p *Pipeline) match(r *Request) (*api.API, error) {
	a, err := p.table.Match(r.Method, r.Path)
	if err != nil {
		return nil, notFound(err)
	}
	r.api = a
	return a, nil
}

// Route runs the flow for a request with a body. Errors are *Error.
func (p *Pipeline) Route(ctx context.Context, r *Request) (*Decision, error) {
	r.Report = Report{}
	a, err := p.match(r)
	if err != nil {
		return nil, err
	}
	if int64(len(r.Body)) > p.opts.MaxBodyBytes {
		return nil, TooLarge(p.opts.MaxBodyBytes)
	}
	if err := checkMediaType(a, r.ContentType); err != nil {
		return nil, err
	}
	obj, err := r.scan.Object(r.Body)
	if err != nil {
		return nil, badRequest("%v", err)
	}
	if err := checkModel(a, obj); err != nil {
		return nil, err
	}
	alone, err := p.admit(a, obj)
	if err != nil {
		return nil, err
	}
	prompt := a.PromptOf(obj, p.connector.Family())
	if prompt.MixedN != nil {
		return nil, mixedSamples(prompt.MixedN)
	}
	sreq := scheduling.NewRequest(prompt)
	sreq.Subset = scheduling.ParseSubset(r.Subset)
	sreq.Alone, sreq.Session, sreq.Client = alone, r.Session, r.Client
	sreq.Response = api.StoredResponseID(a, r.URLPath(), obj)
	if err := p.parallelSamples(sreq); err != nil {
		return nil, err
	}
	// Before the token ids and the pick: a request shed costs no round trip.
	if err := p.shed(ctx, r, sreq, p.shedding.decode); err != nil {
		return nil, err
	}
	p.tokenize(ctx, r, sreq, a, obj)
	d, err := p.pickDecode(sreq, api.ChoosesResponseID(a, obj))
	if err != nil {
		return nil, err
	}
	r.Report.Decode, d.choices, d.api = d.Endpoints[0], sreq.N, a
	defer func() {
		if v := recover(); v != nil { // a bug: free what the request holds, or a probe's endpoint stays out for good
			d.Release()
			panic(v)
		}
	}()
	h := &kv.Handoff{Body: obj, Shape: &a.Shape, Named: responseID(a, obj, d.decode.Endpoint)}
	d.Body, err = p.legs(ctx, r, h, sreq, d)
	if err != nil {
		d.Release()
		return nil, err
	}
	return d, nil
}

// legs decides P/D or decode-only, runs or launches the prefill leg, and returns
// the decode leg's body. It records the decision in r.Report.
func (p *Pipeline) legs(ctx context.Context, r *Request, h *kv.Handoff, sreq *scheduling.Request, d *Decision) (body.Spliced, error) {
	rep := &r.Report
	split, err := p.fitsContext(r.api, h.Body, sreq, d.decode.Endpoint, p.pools.Decide(sreq, d.decode.Endpoint))
	if err != nil {
		return nil, err
	}
	rep.Reason = split.Reason
	if split.PD {
		if err := p.shed(ctx, r, sreq, p.shedding.prefill); err != nil {
			return nil, err
		}
	}
	switch {
	case split.PD:
	case split.Reason == metrics.ReasonNoPrefill && (p.connector.Paired() || p.opts.FailClosed):
		// The decode engines serve only pairs, or the operator prefers errors
		// to the decode engine computing the prompt.
		return nil, p.noPrefillEndpoint()
	default:
		rep.Mode = metrics.ModeDecodeOnly
		if split.Reason == metrics.ReasonCachedPrefix {
			d.Rewrite = p.heldReader(r, d, split.Held)
		}
		return kv.Scrubbed(p.connector, h.Body, h.Shape, h.Named...), nil
	}
	rep.Mode = metrics.ModePD
	// 0..2^62-1: SGLang's routers draw up to 2^63-1, but a batch's prompts
	// take room + i (_normalize_bootstrap_params), which must stay an int64.
	h.Room = rand.Uint64() >> 2
	if p.connector.Dispatch() == kv.Concurrent {
		return p.concurrentLegs(ctx, r, h, sreq, d)
	}
	answer, prefill, err := p.runPrefill(ctx, sreq, r, h)
	if err != nil {
		return p.withoutPrefill(r, h, err)
	}
	if p.connector.HandsBackParams() { // readAnswer gave its params, or failed
		d.prefill = prefill // served, if the decode engine can pull what it handed out (Decision.settle)
		prefill.JudgedWithin(probeVerdictWait)
		// The blocks are freed once read: a fallback would read them reused.
		d.Endpoints, d.elsewhere = d.Endpoints[:1], false
		if p.checkRemoteHost(answer.params, rep.Prefill, d.decode.Addr, r.RequestID) {
			d.partner.fails() // the decode engine's failed pull is the prefill engine's fault
		}
	} else {
		prefill.Report(true)
	}
	d.Rewrite = p.usageRewriter(r, answer)
	h.PrefillKV = answer.params
	return kv.DecodeBody(p.connector, h), nil
}

// withoutPrefill applies prefill.on_failure once the prefill leg could not be
// had: the decode engine recomputes the prompt, or the client gets the error.
// An engine's own 4xx (about the request), a request no leg can carry and a
// client that left always end here.
func (p *Pipeline) withoutPrefill(r *Request, h *kv.Handoff, err error) (body.Spliced, error) {
	last := lastAttempt(err) // nil when no endpoint could be tried
	if last != nil && last.clientLeft() {
		// No engine failed, and nobody waits for a decision.
		return nil, prefillFailed(err, r.RequestID)
	}
	r.Report.Reason = metrics.ReasonPrefillFailed
	if p.opts.FailClosed || last != nil && (last.aboutRequest() || last.unsendable()) {
		return nil, prefillFailed(err, r.RequestID)
	}
	r.Report.Mode = metrics.ModeDecodeOnly
	if last != nil && last.reason == metrics.FailureNotFound {
		// No prefill engine asked has the model or adapter: the client's
		// doing as often as the engines' (a name no engine serves), which is
		// no prefill failure to warn of. The decode engine answers for itself.
		r.Report.Reason = metrics.ReasonUnservedModel
		p.log.V(1).Info("no prefill engine serves the model; decode alone", "requestID", r.RequestID, "error", err.Error())
	} else {
		p.log.Info("prefill failed; decode will recompute the prompt", "requestID", r.RequestID, "error", err.Error())
	}
	return kv.Scrubbed(p.connector, h.Body, h.Shape, h.Named...), nil
}

// runPrefill sends the sequential prefill leg to one endpoint after another
// until one answers, within prefill.attempts and prefill.timeout. An engine 4xx
// ends it at once: another endpoint would refuse the same request; but not a
// 404 for a model another may serve. It
// returns the slot of the endpoint that answered, whose health is the
// caller's to report, and then to judge.
func (p *Pipeline) runPrefill(ctx context.Context, sreq *scheduling.Request, r *Request, h *kv.Handoff) (prefillAnswer, *scheduling.Slot, error) {
	start := time.Now()
	defer func() { r.Report.PrefillTime = time.Since(start) }()
	ctx, cancel := context.WithTimeout(ctx, p.opts.PrefillTimeout)
	defer cancel()
	attempts := p.pools.Prefill.Attempts(sreq, p.opts.Attempts)
	var slot *scheduling.Slot // the attempt's
	defer func() {
		if v := recover(); v != nil { // a bug: free the slot, or a probe's endpoint stays out for good
			if slot != nil {
				slot.Release()
			}
			panic(v)
		}
	}()
	var last error
	for whole := true; ; whole = false {
		ep, claimed, err := attempts.Next()
		if err != nil {
			return prefillAnswer{}, nil, errors.Join(last, err)
		}
		slot = claimed
		r.Report.Prefill = ep.Addr
		leg, _ := p.pairWith(h, ep) // a sequential connector reads nothing more of the engine
		answer, failed := p.attempt(ctx, ep.Addr, r, leg, nil)
		slot.Leave()
		if failed == nil {
			return answer, slot, nil
		}
		switch {
		case failed.blames(kv.Sequential, whole):
			slot.Taken().Failed()
		case failed.refused():
			slot.Taken().Served() // the engine is fine; the request is not, here
		}
		slot.Judged()
		if !failed.retryable() {
			return prefillAnswer{}, nil, failed
		}
		last = failed
		p.log.V(1).Info("prefill attempt failed", "requestID", r.RequestID, "prefill", ep.Addr, "error", failed.Error())
	}
}

// takeBackground counts one more background leg, unless
// prefill.max_background of them run already: they outlive their streams, so
// limits.max_concurrent_streams does not bound them. launch gives it back.
func (p *Pipeline) takeBackground() bool {
	if !p.background.count.take(p.opts.MaxBackground) {
		p.metrics.LimitRefused(metrics.LimitBackground)
		return false
	}
	p.metrics.BackgroundLeg(1)
	return true
}

// prefillLeg is one prefill request: its body, and the data-parallel rank
// of the engine it is pinned to ("" for none).
type prefillLeg struct {
	body body.Spliced
	rank string
}

// pairWith points h's legs at prefill, and returns the prefill leg: the
// host and bootstrap port the decode leg names (SGLang's and Mooncake's;
// NIXL's read neither) and, under kv-mooncake, the engine id of the rank
// the leg is pinned to. An engine with one rank is not told it: it has no
// other to pick. It is false when a kv-mooncake engine has no ids: a decode
// leg naming none would wait for KV it never asks for.
func (p *Pipeline) pairWith(h *kv.Handoff, prefill *scheduling.Endpoint) (prefillLeg, bool) {
	h.PrefillHost, h.BootstrapPort = bootstrapHost(prefill.Addr), p.pools.Prefill.BootstrapPort(prefill)
	var rank string
	if p.connector.Rendezvous() == kv.MooncakeEngineIDs {
		var ranks int
		rank, h.EngineID, ranks = prefill.EngineID(h.Room)
		switch ranks {
		case 0:
			return prefillLeg{}, false
		case 1:
			rank = ""
		}
	}
	return prefillLeg{body: kv.PrefillBody(p.connector, h), rank: rank}, true
}

// heldOutcome is how a hold's Wait ended, as pd_extproc_held_seconds labels it.
func heldOutcome(err error) string {
	switch {
	case err == nil:
		return metrics.HeldReleased
	case errors.Is(err, scheduling.ErrStillSaturated), errors.Is(err, scheduling.ErrHoldClosed):
		return metrics.HeldRefused
	}
	return metrics.HeldCancelled
}

// shed holds r, then refuses it if it must, when its objective has a
// negative priority and hold's pool, one it would use, is saturated: Route
// asks of the decode pool, and of the prefill pool for P/D. A held request goes on
// once the pool has room for it, or a reload sheds its objective no more
// (scheduling.Hold); its client gone, it
// ends with its context's error. Hold bounds its time in both holds
// together: one held for the decode pool waits for the prefill pool only
// what is left of it. With MaxHeld requests in the holds (or just deciding
// whether to wait), one more is refused at once. At shutdown (Drain) one
// held, or to be held, gets a 503 at once.
func (p *Pipeline) shed(ctx context.Context, r *Request, sreq *scheduling.Request, hold *scheduling.Hold) error {
	s := p.shedding.settings.Load()
	priority := s.Priorities[r.Objective]
	if priority >= 0 {
		return nil
	}
	if s.Hold > r.Report.HeldTime && p.shedding.waiting.take(s.MaxHeld) {
		start := time.Now()
		held, err := hold.Wait(ctx, sreq, r.Objective, r.Fairness, r.Report.HeldTime)
		p.shedding.waiting.give()
		if held {
			d := time.Since(start)
			r.Report.HeldTime += d
			p.metrics.Held(hold.Pool.Name(), heldOutcome(err), d)
		}
		switch {
		case errors.Is(err, scheduling.ErrHoldClosed):
			return shuttingDown(s.RetryAfter)
		case !errors.Is(err, scheduling.ErrStillSaturated):
			return err
		}
	} else if !hold.Pool.Saturated(sreq, s.Lines) {
		return nil
	}
	p.metrics.LimitRefused(metrics.LimitSaturated)
	return saturated(r.Objective, hold.Pool.Name(), s.RetryAfter)
}
