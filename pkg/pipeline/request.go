package pipeline

import (
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/response"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// Request is what the pipeline needs of one client request.
type Request struct {
	Method      string      // :method
	Path        string      // :path, query included
	RequestID   string      // sent on both legs
	Forward     http.Header // client headers copied onto the prefill leg (e.g. Authorization)
	ContentType string      // the client's Content-Type, "" when absent
	Body        []byte      // nil for a request without a body
	// Keep, when set, is told when a leg will read Body after Route has
	// returned (a concurrent prefill leg, launched in the background): Hold
	// is called before Route returns, and the release it returns once that
	// leg has ended. The caller keeps Body's memory counted until then.
	Keep interface{ Hold() (release func()) }
	// Subset is the endpoint-picker subset hint Envoy sent in metadata
	// (envoy.lb.subset_hint): nil when absent, else its entries, each an
	// ip:port, a bare IP or several comma-separated; empty, it names none.
	// Decode endpoints outside it are never picked.
	Subset []string
	// Session says the client named its session in a header Envoy's session
	// hash reads (handlers.SessionHeaders): scheduling.Request.Session.
	Session bool
	// Client is the client's address as Envoy put it on the ext_proc stream
	// (handlers.ClientAddressHeader), "" when absent:
	// scheduling.Request.Client.
	Client string
	// Objective is the objective the request names (handlers.ObjectiveHeader),
	// whose priority Options.Shedding gives; "" when none.
	Objective string
	// Fairness is the flow the request names (handlers.FairnessHeader),
	// whose held requests take turns with other flows'; "" when none.
	Fairness string

	// Report is filled in by Route and RouteHeaders, whether they succeed or
	// fail, with what the caller logs and counts.
	Report Report

	scan body.Scanner // what has been validated of Body while it arrived
	api  *api.API     // the matched API; nil until then
}

// Arrived passes the body received so far, while the rest is on its way: it
// is validated now, so that Route has only the tail left to scan. Each call's
// body must begin with the previous one's bytes, and Body must begin with them all.
func (r *Request) Arrived(sofar []byte) { r.scan.Scan(sofar) }

// Routed drops what only routing reads, once the caller has passed the
// decode leg's body on: Body and what was scanned of it. The caller keeps
// the Request while the stream lasts (for its log line and the response
// path), which for a generation is its whole life. A background prefill leg
// still running reads only the request's path, id, Forward and matched API,
// never these.
func (r *Request) Routed() { r.Body, r.scan = nil, body.Scanner{} }

// URLPath is Path without its query, which may carry a credential: the path
// spans may show.
func (r *Request) URLPath() string {
	path, _, _ := strings.Cut(r.Path, "?")
	return path
}

// BodyHeld reports whether a request to an engine may read Body after Route
// returned: net/http may still be writing a prefill leg when the engine has
// answered, a concurrent leg runs on its own, and a render round trip that
// failed may still be written (lent). Until Route returns, only Route and
// its requests read Body.
func (r *Request) BodyHeld() bool { return r.Report.Prefill != "" || r.Report.lent }

// Report is what routing one request did. On a failure it holds what was
// reached: a prefill failure under on_failure=fail keeps Mode pd.
type Report struct {
	Mode        metrics.Mode   // ModePD or ModeDecodeOnly; ModeNone when no mode was chosen
	Reason      metrics.Reason // why that mode
	Decode      string         // decode endpoint
	Prefill     string         // prefill endpoint of the last attempt; "" when no prefill leg was sent
	PrefillTime time.Duration  // time spent waiting on sequential prefill legs, retries included
	HeldTime    time.Duration  // time spent held for room (admission.hold)
	// UsageMissing: under response.rewrite_usage, the prefill engine's answer
	// stated no cached tokens, so the decode engine's stand.
	UsageMissing bool
	// lent: Body went out as a request of its own (the render round trip
	// for its token ids) that failed, which net/http may still be writing:
	// a transport closes a request's body after Do returns (BodyHeld).
	lent bool
}

// APIOf labels a request as metrics and logs do: by the API Route or
// RouteHeaders matched, or, for one refused before routing, by its path.
func APIOf(r *Request) string {
	if r.api != nil {
		return r.api.Name
	}
	return api.LabelOf(r.Method, r.Path)
}

// Decision is where a request goes and with which body.
type Decision struct {
	// Endpoints are the decode endpoint, ip:port, then the fallbacks of
	// pools.decode.fallbacks when configured, in order; none for a decode
	// leg that pulls blocks the prefill engine handed out (legs).
	Endpoints []string
	Body      body.Spliced // the decode leg's body; nil when the request has none
	// Headers is what Envoy changes of the client's headers for the decode leg.
	Headers HeaderEdit
	// Rewrite fixes the decode engine's answer on its way back (the usage
	// under response.rewrite_usage), or reads it (what a cached_prefix
	// decision's engine held: heldReader); nil when it is passed on unread.
	Rewrite *response.Rewriter
	// LegFailed gives the client's error when the concurrent prefill leg
	// (kv-sglang, kv-mooncake) fails, and is closed when the leg ends: a decode request
	// whose leg failed waits for KV that never comes, so the caller answers
	// the client with the error and has Envoy reset the decode request. nil
	// when no leg runs beside the decode.
	LegFailed <-chan *Error
	// Answer, when set, is the whole answer, JSON, which the caller gives
	// the client itself with a 200, routing nothing: the model list of a
	// decode pool of several models (modelList).
	Answer []byte
	decode scheduling.Taken
	// prefill is the engine whose KV the decode engine pulls (a sequential
	// leg that handed out kv_transfer_params), nil otherwise. Its answer
	// was a 200, but whether it served the request is the decode engine's
	// answer: a pull that fails (an engine that cannot be reached at the
	// address it hands out, blocks it freed) fails the request there. So
	// its health is reported with the pair's outcome (settle), and until
	// then it takes no other request if this one is its probe.
	prefill *scheduling.Slot
	release func()
	// elsewhere: the answer may come from another endpoint than the pick, so
	// it judges none of them (health, cached tokens): Envoy was offered
	// fallbacks and the gateway has not said which served (ServedBy), or it
	// names another.
	elsewhere bool
	// partner is what a failure at the decode engine is weighed against.
	partner partner
	// settled: the outcome has been reported to the endpoints' health.
	settled atomic.Bool
	// watch reads the opening of a streamed answer that began with a 2xx
	// for its verdict (Observe); nil otherwise. choices is the request's n,
	// api its API, which says how its streams open (opening).
	watch   *response.Opening
	choices int
	api     *api.API
}

// HeaderEdit is what Envoy changes of the client's request headers before
// it sends the decode leg.
type HeaderEdit struct {
	// Authorization replaces the client's: "Bearer " and the decode
	// engines' API key (pools.decode.api_key_file); empty keeps the client's.
	Authorization string
	// Remove are the client's headers through which the decode engine
	// could be steered past the service (the connector's reserved headers):
	// Envoy must not forward them. Shared: do not modify.
	Remove []string
}

// probeVerdictWait is how long a prefill endpoint's probe holds it waiting
// for the decode engine's verdict. A pull that fails does so when the decode
// engine schedules the request, seconds at most, and its error comes at
// once; a pull that worked is told only when the answer's status or first
// token comes, which a long answer that is not streamed brings at its end.
// Past this the endpoint takes requests again, its health still waiting for
// the verdict.
var probeVerdictWait = 10 * time.Second

// Release frees the decode endpoint's slot; call it when the exchange ends.
// An outcome not reported by then is a success: the answer was a 2xx and
// showed no error, or Envoy's response path is off, and the prefill engine
// answered.
func (d *Decision) Release() {
	if d == nil {
		return
	}
	d.settle(true, d.watch != nil)
	if d.release != nil {
		d.release()
	}
}

// Unsent cuts short the concurrent prefill leg of a decision whose routing
// the caller could not pass on (the ext_proc stream broke as it was sent):
// no decode leg will pair with it, and it would otherwise hold its prefill
// engine, and a slot of prefill.max_background, until prefill.timeout.
func (d *Decision) Unsent() {
	if d != nil {
		d.partner.cutShort()
	}
}

// Sent drops the decode leg's body once the caller has passed it on (a reply
// sent over gRPC is a copy): its pieces are the client's body and, in P/D,
// the prefill engine's answer that kv_transfer_params was spliced from, which
// the response path does not read. Endpoint, Rewrite, Observe and Release
// keep working.
func (d *Decision) Sent() {
	if d != nil {
		d.Body = nil
	}
}

// ServedBy takes the endpoint that the gateway reports serving the request
// (the endpoint-picker protocol's x-gateway-destination-endpoint-served, on
// the response path), "" when it reports none: the answer then judges the
// pick if the pick served it, and no endpoint otherwise. It reports whether
// the endpoint was one of those offered (or none was named); call it before
// Observe.
func (d *Decision) ServedBy(addr string) (offered bool) {
	if d == nil || addr == "" || len(d.Endpoints) == 0 {
		return true
	}
	d.elsewhere = !sameEndpoint(addr, d.Endpoints[0])
	return !d.elsewhere || slices.ContainsFunc(d.Endpoints[1:], func(e string) bool { return sameEndpoint(addr, e) })
}

// Observe reports the decode engine's response status, so that an endpoint
// answering 5xx is ejected like one that refuses connections. A 2xx event
// stream (streamed, its chunks given to Watch) is judged by its opening
// instead: an engine that fails a request after its headers went out says
// so before the first token, in an error event or, on SGLang's /generate
// stream, an abort chunk (response.Opening).
func (d *Decision) Observe(status int, streamed bool) {
	switch {
	case d == nil || d.decode.Endpoint == nil:
	case streamed && status >= 200 && status <= 299:
		d.watch = d.opening()
	default:
		d.settle(status < 500, true)
		if status >= 300 { // the decode request is over, unserved
			d.partner.decodeOver(status < 500)
		}
	}
}

// Watch reads the next chunk of a streamed answer that Observe is judging.
// A stream that ends without a verdict served its request (Release).
func (d *Decision) Watch(chunk []byte) {
	if d == nil || d.watch == nil || d.settled.Load() {
		return
	}
	switch d.watch.Scan(chunk) {
	case response.Failed:
		d.settle(false, true)
		d.partner.decodeOver(false)
	case response.Served:
		d.settle(true, true)
	}
}

// StreamFailed reports whether the answer's stream, begun with a 2xx,
// said a 5xx failure before its first token (Watch).
func (d *Decision) StreamFailed() bool {
	return d != nil && d.watch != nil && d.watch.Verdict() == response.Failed
}

// settle reports the request's outcome, once, to the decode endpoint and,
// in P/D, the prefill endpoint whose KV it pulled. A failure is the pair's:
// each endpoint's consecutive failures then single out the one that fails
// with every partner, as a healthy one's run of failures is broken by its
// requests through other partners. A decode failure that a failed or
// misconfigured prefill engine caused spares the decode endpoint
// (partner). seen says whether the decode engine's answer was: without it
// (no response path) only the prefill engine, which answered, is told.
func (d *Decision) settle(ok, seen bool) {
	if !d.settled.CompareAndSwap(false, true) {
		return
	}
	switch {
	case !seen || d.elsewhere:
	case ok:
		d.decode.Served()
	default:
		d.partner.decodeFailed(&d.decode)
	}
	if d.prefill != nil {
		d.prefill.Report(ok)
	}
	d.partner.decodeSettled(ok)
}
