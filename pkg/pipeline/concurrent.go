package pipeline

import (
	"cmp"
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// concurrentLegs launches the prefill leg of a concurrent connector
// (kv-sglang, kv-mooncake) and returns the decode leg's body, which names
// that prefill engine. The decode leg goes out once the prefill leg is
// written: a leg that fails before (its engine refuses the connection, or
// is gone) is tried on another prefill endpoint within prefill.attempts, as
// no decode engine waits for it yet. Once written, the pair's fate is one
// (launch).
func (p *Pipeline) concurrentLegs(ctx context.Context, r *Request, h *kv.Handoff, sreq *scheduling.Request, d *Decision) (body.Spliced, error) {
	attempts := p.pools.Prefill.Attempts(sreq, p.opts.Attempts)
	// prefill.timeout bounds the phase, every leg tried included, as
	// runPrefill's: a leg not written in time leaves the next one less.
	end := time.Now().Add(p.opts.PrefillTimeout)
	var last error // the last leg that could not be sent, nil before one
	for {
		ep, slot, err := attempts.Next()
		if err != nil {
			return p.unsent(r, h, d, cmp.Or(last, err))
		}
		leg, ok := p.pairWith(h, ep)
		if !ok { // its engine ids went since the decision (an ejection)
			slot.Release()
			return p.unsent(r, h, d, cmp.Or(last, errNoEngineIDs))
		}
		if leg.rank != "" && !pinsRank(r.api) {
			slot.Release()
			r.Report.Mode, r.Report.Reason = metrics.ModeDecodeOnly, metrics.ReasonUnpairedAPI
			return kv.Scrubbed(p.connector, h.Body, h.Shape, h.Named...), nil
		}
		if !p.takeBackground() {
			slot.Release()
			return nil, backgroundFull(p.opts.MaxBackground, p.opts.RetryAfter)
		}
		r.Report.Prefill = ep.Addr
		failed, notSent := <-p.launch(ctx, end, slot, r, leg, d)
		if !notSent {
			return kv.DecodeBody(p.connector, h), nil
		}
		d.partner.legEnded(false, false) // no decode engine waits for it
		if last = failed; !failed.retryable() {
			return p.unsent(r, h, d, failed)
		}
		p.log.V(1).Info("concurrent prefill leg not sent; trying another endpoint", "requestID", r.RequestID, "prefill", ep.Addr, "error", failed.Error())
	}
}

// pinsRank says whether a's engine handler reads X-Data-Parallel-Rank.
// vLLM's Responses handler does not (_generate_with_builtin_tools passes no
// data_parallel_rank, vllm/entrypoints/openai/responses/serving.py @
// 0001948b): on an engine of several ranks its prefill leg would run on
// whichever rank the engine's balancer picks, and the decode leg, naming
// another rank's engine id, would wait for KV that never comes (up to
// VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT) and fail. Such a request goes
// decode-only (unpaired_api).
func pinsRank(a *api.API) bool { return a != api.Responses }

// errNoEngineIDs: the prefill endpoint claimed no longer has the engine ids
// its leg needs (it was ejected since the decision).
var errNoEngineIDs = errors.New("the prefill engine's ids are no longer known")

// unsent answers a request none of whose concurrent legs could be sent
// (cause: the last leg's failure, or why none could be started). No leg
// runs beside it. Under kv-sglang, whose decode engines serve only pairs,
// it is refused: with the leg's error, or as no prefill endpoint; else it
// goes as prefill.on_failure says (kv-mooncake's decode engine may compute
// the prompt itself: no decode leg was sent yet), as a sequential
// connector's does.
func (p *Pipeline) unsent(r *Request, h *kv.Handoff, d *Decision, cause error) (body.Spliced, error) {
	d.LegFailed = nil
	switch {
	case !p.connector.Paired():
		return p.withoutPrefill(r, h, cause)
	case lastAttempt(cause) == nil:
		return nil, p.noPrefillEndpoint()
	}
	return nil, prefillFailed(cause, r.RequestID)
}

// launch sends a concurrent prefill leg in the background, counted by
// takeBackground, and hands its failure on through d.LegFailed. Until it is
// written no decode engine waits for it, and a client that leaves takes it
// along (ctx); once written it runs on until end, the prefill phase's
// deadline, unless its routing never reached Envoy (Decision.Unsent) or
// its decode request ended unserved (Decision.Observe, partner.decodeOver):
// Envoy closes the ext_proc stream as soon as its last reply is in, which
// must not cancel a leg the decode engine is waiting to pair with.
//
// The channel it returns is closed once the leg is written; a leg that
// fails before gets its failure there instead, and leaves d as it was: the
// caller may try another endpoint.
//
// The legs fail together: a prefill whose decode never connects answers 5xx,
// and a decode whose prefill failed does too. So a leg that failed first,
// or got no answer, spares its decode endpoint the blame for its 5xx
// (partner), and an answer spares its own (attemptError.blames).
func (p *Pipeline) launch(ctx context.Context, end time.Time, slot *scheduling.Slot, r *Request, leg prefillLeg, d *Decision) <-chan *attemptError {
	ep, taken, unhold := slot.Endpoint(), slot.Taken(), func() {}
	if r.Keep != nil { // the leg reads the client's body after Route returns
		unhold = r.Keep.Hold()
	}
	legFailed := make(chan *Error, 1)
	d.LegFailed = legFailed
	unsent := make(chan *attemptError, 1)
	legCtx, drop := context.WithCancel(context.WithoutCancel(ctx))
	keep := context.AfterFunc(ctx, drop) // the client left before the leg was written
	written := sync.OnceFunc(func() { keep(); close(unsent) })
	stopped := context.AfterFunc(p.background.end, drop) // Stop
	d.partner.legStarted(drop, p.connector.Paired())     // Decision.Unsent, Observe
	p.background.running.Go(func() {
		defer stopped()
		defer drop()
		judged := true // by the leg's own outcome: the slot's probe is freed as it ends
		defer func() {
			close(legFailed)
			if slot.Leave(); judged {
				slot.Judged()
			}
			unhold()
			p.background.count.give()
			p.metrics.BackgroundLeg(-1)
		}()
		ctx, cancel := context.WithDeadline(legCtx, end)
		defer cancel()
		var sent atomic.Bool // set on the transport's goroutine
		_, failed := p.attempt(ctx, ep.Addr, r, leg, func() { sent.Store(true); written() })
		if failed != nil && failed.blames(kv.Concurrent, false) {
			taken.Failed()
		}
		if failed != nil && !sent.Load() {
			p.log.V(1).Info("concurrent prefill leg failed before it was sent", "requestID", r.RequestID, "prefill", ep.Addr, "error", failed.Error())
			unsent <- failed
			return
		}
		written() // an answer comes after the request is written; this is for form's sake
		if failed != nil && failed.clientLeft() && d.partner.wasCut() {
			p.log.V(1).Info("concurrent prefill leg cut short: its decode request ended unserved", "requestID", r.RequestID, "prefill", ep.Addr)
			failed = nil // a kv-mooncake leg is judged by its decode's outcome, as a served one
			if p.connector.Paired() {
				d.partner.legEnded(false, false)
				return
			}
		}
		// A leg that got no answer spares its decode, whether or not it is
		// held against the prefill endpoint.
		d.partner.legEnded(failed != nil, failed != nil && failed.counts() && failed.answer == nil)
		if failed != nil {
			p.log.Info("concurrent prefill leg failed", "requestID", r.RequestID, "prefill", ep.Addr, "error", failed.Error())
			legFailed <- prefillFailed(failed, r.RequestID)
			return
		}
		if p.connector.Paired() { // an SGLang pair fails together: its prefill engine waits for the decode's handshake
			taken.Served()
			return
		}
		judged = false
		slot.JudgedWithin(probeVerdictWait)
		d.partner.legServed(slot)
	})
	return unsent
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
