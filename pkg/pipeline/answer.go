package pipeline

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/response"
)

// prefillAnswer is what the decode leg and the client's answer take from a
// sequential prefill engine's (non-streamed) answer.
type prefillAnswer struct {
	// params is the raw kv_transfer_params, which only a connector that
	// hands them back (kv-nixl) reads.
	params []byte
	// cached is the prompt tokens the engine found in its cache, a raw JSON
	// integer; nil when it reports none (vLLM without
	// --enable-prompt-tokens-details) or the usage is not rewritten.
	// uncached is the rest of the prompt's, where the API reports them
	// apart (api.Shape.UncachedTokens), else nil.
	cached, uncached []byte
}

// readAnswer reads a prefill engine's answer to r without decoding it; one
// that is not a JSON object is errMalformed, but for a connector whose legs
// hand nothing back (kv-sglang) any JSON will do: SGLang answers a batch
// (text or input_ids a list) with an array, one answer per prompt
// (TokenizerManager._handle_batch_request, python/sglang/srt/managers/tokenizer_manager.py).
// One without the kv_transfer_params its connector hands back is errNoParams.
func (p *Pipeline) readAnswer(answer []byte, r *Request) (prefillAnswer, error) {
	o, err := body.Parse(answer)
	if err != nil {
		if !p.connector.HandsBackParams() && json.Valid(answer) {
			return prefillAnswer{}, nil
		}
		return prefillAnswer{}, fmt.Errorf("%w: %v", errMalformed, err)
	}
	var a prefillAnswer
	if p.connector.HandsBackParams() { // else none is read: a kv-shared-storage decode engine finds the KV by the prompt
		raw, ok := o.Raw("kv_transfer_params")
		if !ok || raw[0] != '{' || !kv.HasParams(raw) {
			if stop := stoppedBy(o); stop != "" {
				return prefillAnswer{}, fmt.Errorf("%w: its one token was a stop token (%s), for which a NixlConnector "+
					"that hands out KV only for an answer cut by its length gives none", errNoParams, stop)
			}
			return prefillAnswer{}, errNoParams
		}
		a.params = raw
	}
	paths := cachedTokens(r)
	if !p.opts.RewriteUsage || paths.JSON == nil {
		return a, nil
	}
	a.cached = countAt(o, answer, paths.JSON)
	if paths.Uncached == nil {
		if a.cached == nil && response.NoneCached(answer, paths.JSON) {
			a.cached = []byte("0")
		}
		return a, nil
	}
	switch a.uncached = countAt(o, answer, paths.Uncached); {
	case a.uncached == nil:
		a.cached = nil // the two are written together or not at all
	case a.cached == nil:
		// vLLM's Anthropic handler writes cache_read_input_tokens only where
		// the chat answer it converts had prompt_tokens_details
		// (vllm-project/vllm#40912): for a cold prompt, on many releases.
		a.cached = []byte("0")
	}
	return a, nil
}

// stoppedBy is what in a one-token answer says its token ended it rather
// than its length cap, "" when nothing does: chat's and completions'
// finish_reason "stop", Messages' stop_reason "end_turn" or "stop_sequence",
// the Responses API's status "completed" (a cut one is "incomplete").
func stoppedBy(o *body.Object) string {
	if s, _ := o.String("stop_reason"); s == "end_turn" || s == "stop_sequence" {
		return "stop_reason " + s
	}
	if s, _ := o.String("status"); s == "completed" {
		return "status " + s
	}
	raw, _ := o.Raw("choices")
	for choice := range body.Items(raw) {
		if c, err := body.Parse(choice); err == nil {
			if s, _ := c.String("finish_reason"); s == "stop" {
				return "finish_reason " + s
			}
		}
		break // the leg asks for one choice
	}
	return ""
}

// countAt is the token count at path in answer (parsed as o), nil when
// there is none.
func countAt(o *body.Object, answer []byte, path []string) []byte {
	if start, end, ok := o.Locate(path...); ok && isCount(answer[start:end]) {
		return answer[start:end]
	}
	return nil
}

// isCount reports whether raw is a JSON integer that is a plausible token
// count: not negative (vLLM's placeholder for unknown is -1), at most 18 digits.
func isCount(raw []byte) bool {
	if len(raw) == 0 || len(raw) > 18 {
		return false
	}
	for _, c := range raw {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// usageRewriter is the rewriter of the decode engine's answer to r, or nil
// when it is passed on as it is: response.rewrite_usage is off, or the API
// reports no cached tokens, or (Report.UsageMissing: the decode engine's
// number then stands) the prefill engine's answer said nothing of them (no
// usage, or a placeholder).
func (p *Pipeline) usageRewriter(r *Request, a prefillAnswer) *response.Rewriter {
	if !p.opts.RewriteUsage || r.api.Shape.CachedTokens == nil {
		return nil
	}
	if a.cached == nil {
		r.Report.UsageMissing = true
		return nil
	}
	// Copies: a.cached and a.uncached point into the whole prefill answer,
	// and the rewriter lives as long as the stream.
	return response.New(cachedTokens(r), bytes.Clone(a.cached), bytes.Clone(a.uncached), int(p.opts.MaxResponseBytes))
}

// cachedTokens is where r's API answers with its cached tokens.
func cachedTokens(r *Request) response.Paths {
	s := r.api.Shape
	return response.Paths{JSON: s.CachedTokens, Event: s.CachedTokensInEvents, Uncached: s.UncachedTokens}
}

// heldReader reads the answer of d's decode engine, which got r decode-only
// being estimated to hold held of its prompt's tokens (cached_prefix), and
// tells scheduling how many it says it held: an endpoint whose answers keep
// belying the estimate stops being trusted with it for a while. An answer
// that may come from another endpoint (Decision.ServedBy) tells nothing.
// nil when the API reports no cached tokens. Without Envoy's response path
// it reads nothing, and the estimate stands.
func (p *Pipeline) heldReader(r *Request, d *Decision, held int) *response.Rewriter {
	if r.api.Shape.CachedTokens == nil {
		return nil
	}
	decode := d.decode.Endpoint
	return response.NewReader(cachedTokens(r), int(p.opts.MaxResponseBytes), func(raw []byte, stated bool) {
		if n, err := strconv.Atoi(string(raw)); err == nil && isCount(raw) && !d.elsewhere {
			if decode.ReportCached(held, n, stated) {
				p.log.Info("the decode endpoint's answers belie what the router estimated it caches (evicted, or restarted): "+
					"later turns sent to it go through a prefill leg for a while", "decode", decode.Addr, "estimated", held, "held", n,
					"requestID", r.RequestID)
			}
		}
	})
}

// checkRemoteHost warns when the prefill engine at prefill tells a decode
// engine at decode, on another host, to pull the KV from a loopback or
// unspecified address: vLLM's NIXL connector advertises
// VLLM_NIXL_SIDE_CHANNEL_HOST, which defaults to localhost, so the decode
// engine will fail to pull: under vLLM's kv_load_failure_policy "fail" (its
// default) it fails the request, under "recompute" it recomputes the prompt.
// Each such answer is counted; each prefill endpoint is logged once. It
// reports whether the answer is suspect.
func (p *Pipeline) checkRemoteHost(params []byte, prefill, decode, requestID string) (suspect bool) {
	if params == nil {
		return false
	}
	o, err := body.Parse(params)
	if err != nil {
		return false
	}
	host, ok := o.String("remote_host")
	if !ok || !unreachableFromElsewhere(host) || sameHost(prefill, decode) {
		return false
	}
	p.metrics.KVParamsSuspect()
	if _, logged := p.suspects.LoadOrStore(prefill, true); !logged {
		p.log.Info("the prefill engine hands out a kv_transfer_params.remote_host that the decode engine, on another host, cannot reach: "+
			"its pull fails, and the request with it (or the prompt is recomputed, under kv_load_failure_policy recompute); set VLLM_NIXL_SIDE_CHANNEL_HOST on the prefill engine to an address the decode engines reach (logged once per prefill endpoint)",
			"prefill", prefill, "remote_host", host, "decode", decode, "requestID", requestID)
	}
	return true
}

// unreachableFromElsewhere reports whether host names the machine it is
// read on: a loopback or unspecified address, or localhost.
func unreachableFromElsewhere(host string) bool {
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	if strings.EqualFold(host, "localhost") || strings.HasSuffix(strings.ToLower(host), ".localhost") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return false // a name: whether it resolves elsewhere is not ours to tell
	}
	ip = ip.Unmap()
	return ip.IsLoopback() || ip.IsUnspecified()
}

// sameHost reports whether two ip:port endpoints may be one machine: the same
// IP, or both loopback. When either cannot be read, it cannot tell, and says so.
func sameHost(a, b string) bool {
	apA, errA := netip.ParseAddrPort(a)
	apB, errB := netip.ParseAddrPort(b)
	if errA != nil || errB != nil {
		return true
	}
	ipA, ipB := apA.Addr().Unmap(), apB.Addr().Unmap()
	return ipA == ipB || ipA.IsLoopback() && ipB.IsLoopback()
}

// sameEndpoint reports whether two ip:port endpoints are one, however each
// spells its IP (an IPv4 address mapped into IPv6, zeros, case).
func sameEndpoint(a, b string) bool {
	apA, errA := netip.ParseAddrPort(a)
	apB, errB := netip.ParseAddrPort(b)
	if errA != nil || errB != nil {
		return a == b
	}
	return apA.Addr().Unmap() == apB.Addr().Unmap() && apA.Port() == apB.Port()
}
