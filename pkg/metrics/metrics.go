// Package metrics is the one place where pd-extproc's Prometheus metrics are
// named: every metric, label and label value it exports is defined here and
// described in docs/metrics.md. Label values come from the constants below only,
// so every label set is bounded: no request ids, no model names.
//
// A *Metrics owns its registry (never the global default), so a binary and each
// test get their own. A nil *Metrics records nothing, which keeps callers free of
// "is metrics on" checks.
package metrics

import (
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/version"
)

const namespace = "pd_extproc"

// Mode is how a request was routed, the mode label. ModeNone, the zero
// value, marks a request rejected before the pipeline chose a mode (bad
// JSON, unknown path, body too large, ...).
type Mode uint8

// Modes of a request.
const (
	ModeNone Mode = iota
	ModePD
	ModeDecodeOnly
)

// String is the mode's label value.
func (m Mode) String() string { return [...]string{"none", "pd", "decode_only"}[m] }

// Values of requests_total{outcome}: how the request path of one ext_proc stream ended.
const (
	OutcomeRouted    = "routed"    // a decode endpoint was chosen and Envoy was told
	Outcome4xx       = "4xx"       // rejected with a 4xx local reply (ours, or the prefill engine's own 4xx)
	Outcome5xx       = "5xx"       // rejected with a 5xx local reply (no decode endpoint, prefill failed under on_failure=fail, ...)
	OutcomeCancelled = "cancelled" // the stream ended before the request was routed or rejected (client or Envoy gave up)
	OutcomeAnswered  = "answered"  // answered by pd-extproc itself, a 200 (GET /v1/models of a pool of several models), mode none
)

// Reason is why a routed request got its mode: String is its
// pd_decisions_total{reason} label, which nothing else reads. The first seven
// and CachedPrefix, PrefillBusy and DecodeBusy are the P/D decider's; the
// zero value is no decision yet.
type Reason uint8

const (
	ReasonAlways         Reason = iota + 1 // P/D: pd.mode always
	ReasonLongPrompt                       // P/D: auto, prompt at or above pd.min_prompt_tokens
	ReasonNever                            // decode-only: pd.mode never
	ReasonShortPrompt                      // decode-only: auto, prompt below pd.min_prompt_tokens
	ReasonNGT1                             // decode-only: n > 1 cannot be handed off
	ReasonBatch                            // decode-only: several prompts in one completions request
	ReasonNoPrefill                        // decode-only: no healthy prefill endpoint
	ReasonPrefillFailed                    // the prefill leg failed (decode-only under on_failure decode-only)
	ReasonNoBody                           // decode-only: a request without a body (GET /v1/models, body mode NONE)
	ReasonPassthrough                      // decode-only: a request of the pass-through list (routes.passthrough)
	ReasonUnpairedAPI                      // decode-only: an API the deployment does not disaggregate (routes.messages_decode_only, routes.responses_decode_only)
	ReasonPromptLogprobs                   // decode-only: the request asks for the prompt's logprobs
	ReasonStoredResponse                   // decode-only: a Responses request that continues a stored response or runs in the background
	ReasonBuiltinTools                     // decode-only: a Responses request with a built-in tool (routes.pair_builtin_tools pairs it)
	ReasonInvalidLimits                    // decode-only: the engine refuses the output limit or stream_options the prefill leg would overwrite
	ReasonBeamSearch                       // decode-only: vLLM's beam search, which hands no KV over
	ReasonCachedPrefix                     // decode-only: the decode endpoint is estimated to hold all but a few of the prompt's tokens
	ReasonPrefillBusy                      // decode-only: the prefill pool is busy and the decode endpoint is not (pd.load)
	ReasonDecodeBusy                       // P/D: decode-only was vetoed, the decode endpoint being busy (pd.load)
	ReasonTruncation                       // decode-only: vLLM cuts the prompt by the output limit, which the prefill leg's differs from
	ReasonUnservedModel                    // decode-only: the prefill engines asked answered that they do not serve the model or adapter named (404)
)

var reasonLabels = [...]string{
	ReasonAlways: "always", ReasonLongPrompt: "long_prompt", ReasonNever: "never", ReasonShortPrompt: "short_prompt",
	ReasonNGT1: "n_gt_1", ReasonBatch: "batch", ReasonNoPrefill: "no_prefill", ReasonPrefillFailed: "prefill_failed",
	ReasonNoBody: "no_body", ReasonPassthrough: "passthrough", ReasonUnpairedAPI: "unpaired_api",
	ReasonPromptLogprobs: "prompt_logprobs", ReasonStoredResponse: "stored_response", ReasonBuiltinTools: "builtin_tools",
	ReasonInvalidLimits: "invalid_limits", ReasonBeamSearch: "beam_search", ReasonCachedPrefix: "cached_prefix", ReasonPrefillBusy: "prefill_busy",
	ReasonDecodeBusy: "decode_busy", ReasonTruncation: "truncation", ReasonUnservedModel: "unserved_model",
}

func (r Reason) String() string { return label(reasonLabels[:], r) }

// Reasons are the labels of every Reason, in order.
func Reasons() []string { return reasonLabels[1:] }

// Values of prefill_duration_seconds{outcome}.
const (
	PrefillOK        = "ok"
	PrefillFailed    = "failed"
	PrefillCancelled = "cancelled"
)

// Failure is why one prefill attempt failed: String is its
// prefill_failures_total{reason} label, which nothing else reads. The zero
// value is an attempt that did not fail.
type Failure uint8

const (
	FailureConnect    Failure = iota + 1 // the engine could not be dialled
	FailureTimeout                       // prefill.attempt_timeout or prefill.timeout expired
	FailureStatus4xx                     // the engine rejected the request
	FailureStatus5xx                     // the engine answered with its own failure
	FailureRedirect                      // the engine answered with a redirect, which is not followed
	FailureTransport                     // the connection broke while sending or reading
	FailureCancelled                     // the client left (the ext_proc stream ended) while the leg ran
	FailureNotSent                       // net/http refused the leg before connecting (a header value or query of the client's that is not valid HTTP)
	FailureTooLarge                      // a 2xx answer longer than the 8 MiB read: its kv_transfer_params would be lost
	FailureMalformed                     // a 2xx answer that is not a JSON object (nor an event stream), or a 101: a broken engine or proxy
	FailureOverloaded                    // the engine answered 429: busy, not wrong; another may take the leg
	FailureNotFound                      // the engine answered 404 with an OpenAI error: it lacks the model, adapter or stored response the request names, which another may have
	FailureNoParams                      // a kv-nixl 2xx answer without kv_transfer_params: the decode engine would recompute the prompt
)

var failureLabels = [...]string{
	FailureConnect: "connect", FailureTimeout: "timeout", FailureStatus4xx: "status_4xx", FailureStatus5xx: "status_5xx",
	FailureRedirect: "redirect", FailureTransport: "transport", FailureCancelled: "cancelled", FailureNotSent: "not_sent",
	FailureTooLarge: "answer_too_large", FailureMalformed: "malformed", FailureOverloaded: "overloaded", FailureNotFound: "not_found",
	FailureNoParams: "no_kv_params",
}

func (f Failure) String() string { return label(failureLabels[:], f) }

// label is value's label in labels, "" for the zero value or one past them.
func label[V ~uint8](labels []string, value V) string {
	if int(value) < len(labels) {
		return labels[value]
	}
	return ""
}

// counter, counterVec, gauge, gaugeVec, histogram and histogramVec make the
// service's collectors, each named name under namespace.
func counter(name, help string) prometheus.Counter {
	return prometheus.NewCounter(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help})
}

func counterVec(name, help string, labels ...string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help}, labels)
}

func gauge(name, help string) prometheus.Gauge {
	return prometheus.NewGauge(prometheus.GaugeOpts{Namespace: namespace, Name: name, Help: help})
}

func gaugeVec(name, help string, labels ...string) *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: namespace, Name: name, Help: help}, labels)
}

func histogram(name, help string, buckets []float64) prometheus.Histogram {
	return prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: namespace, Name: name, Help: help, Buckets: buckets})
}

func histogramVec(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: namespace, Name: name, Help: help, Buckets: buckets}, labels)
}

var (
	apis          = api.Labels()
	modes         = []Mode{ModePD, ModeDecodeOnly, ModeNone}
	outcomes      = []string{OutcomeRouted, Outcome4xx, Outcome5xx, OutcomeCancelled, OutcomeAnswered}
	prefillStates = []string{PrefillOK, PrefillFailed, PrefillCancelled}
)

// Metrics holds pd-extproc's collectors and the registry they are on.
type Metrics struct {
	registry  *prometheus.Registry
	connector string

	requests        *prometheus.CounterVec
	processing      *prometheus.HistogramVec
	prefillDuration *prometheus.HistogramVec
	prefillFailures *prometheus.CounterVec
	kvParamsMissing prometheus.Counter
	decisions       *prometheus.CounterVec
	bodyBytes       prometheus.Histogram
	streams         prometheus.Gauge
	panics          prometheus.Counter
	tokenize        *prometheus.HistogramVec
	answers         answers
	limits          limits
	reloads         reloads
}

// New returns the metrics of a server using connector, on a new registry that
// also carries the Go runtime and process collectors.
func New(connector string) *Metrics {
	m := &Metrics{
		registry:  prometheus.NewRegistry(),
		connector: connector,
		requests: counterVec("requests_total",
			"Requests by engine API, P/D mode, KV connector and how their routing ended (routed, 4xx, 5xx, cancelled, answered).",
			"api", "mode", "connector", "outcome"),
		processing: histogramVec("request_processing_seconds",
			"Time the service adds to a routed request, from its first ext_proc message to the routing reply, excluding the prefill leg and the time held for room (admission.hold).",
			// Sub-millisecond for small bodies; FULL_DUPLEX includes Envoy streaming the body to us.
			[]float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5}, "mode"),
		prefillDuration: histogramVec("prefill_duration_seconds",
			"Duration of each prefill leg attempt the service sent, by outcome (ok, failed, cancelled).",
			[]float64{.01, .025, .05, .1, .25, .5, 1, 2, 2.5, 5, 10, 20, 30, 60}, "outcome"), // 2: the slow-prefill alert's line
		prefillFailures: counterVec("prefill_failures_total",
			"Failed prefill leg attempts by reason (connect, timeout, status_4xx, status_5xx, redirect, transport, cancelled, not_sent, answer_too_large, malformed, overloaded, not_found, no_kv_params).",
			"reason"),
		kvParamsMissing: counter("kv_params_missing_total",
			"kv-nixl prefill legs answered 2xx without kv_transfer_params: failed prefills (prefill_failures_total{reason=\"no_kv_params\"}), which prefill.on_failure decides."),
		decisions: counterVec("pd_decisions_total",
			"Routed requests by why they got their mode ("+strings.Join(Reasons(), ", ")+").",
			"reason"),
		bodyBytes: histogram("request_body_bytes", "Size of complete client request bodies received.",
			append(prometheus.ExponentialBuckets(256, 4, 9), 24<<20, 32<<20, 64<<20)), // 256 B .. 16 MiB, then the default limit's last quarter
		streams: gauge("streams_in_flight", "ext_proc Process streams currently open."),
		panics: counter("panics_total",
			"ext_proc streams whose handling panicked (a bug, logged with its stack): each ended with INTERNAL, the others went on."),
		tokenize: histogramVec("tokenize_seconds",
			"Round trips to an engine's /tokenize for a request's token ids (pools following KV events), by outcome: ok, or failed (the request went by estimates).",
			[]float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1}, "outcome"),
		answers: newAnswers(),
		limits:  newLimits(),
		reloads: newReloads(),
	}
	build := gaugeVec("build_info",
		"1, labelled with the build that runs: its version (git describe), revision (commit) and Go release.",
		"version", "revision", "goversion")
	b := version.Get()
	build.WithLabelValues(b.Version, b.Revision, b.GoVersion).Set(1)
	m.registry.MustRegister(
		build,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.requests, m.processing, m.prefillDuration, m.prefillFailures, m.kvParamsMissing,
		m.decisions, m.bodyBytes, m.streams, m.panics, m.tokenize,
	)
	m.registry.MustRegister(m.answers.collectors()...)
	m.registry.MustRegister(m.limits.collectors()...)
	m.registry.MustRegister(m.reloads.collectors()...)
	m.initSeries()
	return m
}

// initSeries creates every counter series at zero, so that rate() and increase()
// see the first event and alerts can tell "none yet" from "no data".
func (m *Metrics) initSeries() {
	for _, api := range apis {
		for _, mode := range modes {
			for _, outcome := range outcomes {
				if mode == ModeNone && outcome == OutcomeRouted || mode != ModeNone && outcome == OutcomeAnswered {
					continue // a routed request always has a mode, one answered here none
				}
				m.requests.WithLabelValues(api, mode.String(), m.connector, outcome)
			}
		}
	}
	for _, r := range Reasons() {
		m.decisions.WithLabelValues(r)
	}
	for _, f := range failureLabels[1:] {
		m.prefillFailures.WithLabelValues(f)
	}
	m.processing.WithLabelValues(ModePD.String())
	m.processing.WithLabelValues(ModeDecodeOnly.String())
	for _, s := range prefillStates {
		m.prefillDuration.WithLabelValues(s)
	}
	m.tokenize.WithLabelValues("ok")
	m.tokenize.WithLabelValues("failed")
	m.answers.initSeries()
	m.limits.initSeries()
	m.reloads.initSeries()
}

// Registry is the registry every collector is on.
func (m *Metrics) Registry() *prometheus.Registry { return m.registry }

// Handler serves the registry in the Prometheus exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{Registry: m.registry})
}

// StreamOpened counts an ext_proc stream as open until StreamClosed.
func (m *Metrics) StreamOpened() {
	if m != nil {
		m.streams.Inc()
	}
}

// StreamClosed ends what StreamOpened started.
func (m *Metrics) StreamClosed() {
	if m != nil {
		m.streams.Dec()
	}
}

// Panicked counts a stream whose handling panicked.
func (m *Metrics) Panicked() {
	if m != nil {
		m.panics.Inc()
	}
}

// Request is how the request path of one stream ended.
type Request struct {
	API     string // an API* value
	Mode    Mode   // ModeNone when no mode was chosen
	Reason  Reason // why the mode: a routed request's decision
	Outcome string // an Outcome* value
	// UsageMissing: the prefill engine's answer stated no cached tokens to
	// rewrite the decode engine's with.
	UsageMissing bool
	// Processing is the service's own time (prefill legs excluded); recorded for
	// routed requests only.
	Processing time.Duration
}

// ObserveRequest records one request's end.
func (m *Metrics) ObserveRequest(r Request) {
	if m == nil {
		return
	}
	m.requests.WithLabelValues(r.API, r.Mode.String(), m.connector, r.Outcome).Inc()
	// Counted with the routing, as the decision: one that never reached Envoy
	// got no answer, as any answer unseen.
	if r.UsageMissing {
		outcome := UsageUnseen
		if r.Outcome == OutcomeRouted {
			outcome = UsagePrefillMissing
		}
		m.UsageRewrite(outcome)
	}
	if r.Outcome != OutcomeRouted {
		return
	}
	m.processing.WithLabelValues(r.Mode.String()).Observe(r.Processing.Seconds())
	// Counted with the routing Envoy was told, not when the pipeline chose it:
	// a routing that never reached Envoy sent nothing to an engine.
	if r.Reason != 0 {
		m.decisions.WithLabelValues(r.Reason.String()).Inc()
	}
}

// RequestBody records the size of a complete request body.
func (m *Metrics) RequestBody(n int) {
	if m != nil {
		m.bodyBytes.Observe(float64(n))
	}
}

// PrefillAttempt records one prefill leg: failure is 0 when it succeeded.
func (m *Metrics) PrefillAttempt(d time.Duration, failure Failure) {
	if m == nil {
		return
	}
	outcome := PrefillOK
	switch failure {
	case 0:
	case FailureCancelled:
		outcome = PrefillCancelled
	default:
		outcome = PrefillFailed
	}
	if failure != 0 {
		m.prefillFailures.WithLabelValues(failure.String()).Inc()
	}
	if failure == FailureNoParams { // the counter alerts were written on before the failure reason
		m.kvParamsMissing.Inc()
	}
	m.prefillDuration.WithLabelValues(outcome).Observe(d.Seconds())
}
