package metrics

import "github.com/prometheus/client_golang/prometheus"

// Values of usage_rewrites_total{outcome}: what became of the usage a decode
// engine reported for one P/D answer, with response.rewrite_usage on.
const (
	UsageRewritten      = "rewritten"       // cached_tokens now says the prefill engine's value
	UsageAbsent         = "absent"          // the answer has no such field (a stream without include_usage, decode without --enable-prompt-tokens-details)
	UsagePrefillMissing = "prefill_missing" // the prefill's answer had none: the decode's is left as it is
	UsageTooLarge       = "too_large"       // over response.max_body_bytes: passed on unchanged
	UsageNotRewritable  = "not_rewritable"  // an error status, an encoded body, or neither JSON nor SSE: passed on unchanged
	UsageNotFullDuplex  = "not_full_duplex" // Envoy does not send the response body in FULL_DUPLEX_STREAMED: passed on unchanged
	UsageUnseen         = "unseen"          // the stream ended before the answer's headers came: Envoy sends none (response_header_mode SKIP), or the client left first
	UsageCancelled      = "cancelled"       // the stream ended before the answer's end and its usage: the client left
)

var usageOutcomes = []string{UsageRewritten, UsageAbsent, UsagePrefillMissing, UsageTooLarge, UsageNotRewritable, UsageNotFullDuplex,
	UsageUnseen, UsageCancelled}

// answers counts what the engines answered that the service checks or fixes.
type answers struct {
	usageRewrites   *prometheus.CounterVec
	kvParamsSuspect prometheus.Counter
	streamErrors    *prometheus.CounterVec
}

func newAnswers() answers {
	return answers{
		usageRewrites: counterVec("usage_rewrites_total",
			"P/D answers whose cached tokens (usage.prompt_tokens_details.cached_tokens, the Responses API's input_tokens_details.cached_tokens, the Messages API's cache_read_input_tokens) were to be replaced by the prefill engine's, by outcome.",
			"outcome"),
		kvParamsSuspect: counter("kv_params_suspect_total",
			"Prefill answers whose kv_transfer_params.remote_host is a loopback or unspecified address while the decode endpoint is on another host."),
		streamErrors: counterVec("stream_errors_total",
			"Decode answers that began as a 2xx event stream and sent an error event with a 5xx code before their first token, by mode.",
			"mode"),
	}
}

func (a answers) collectors() []prometheus.Collector {
	return []prometheus.Collector{a.usageRewrites, a.kvParamsSuspect, a.streamErrors}
}

func (a answers) initSeries() {
	for _, o := range usageOutcomes {
		a.usageRewrites.WithLabelValues(o)
	}
	for _, m := range []Mode{ModePD, ModeDecodeOnly} {
		a.streamErrors.WithLabelValues(m.String())
	}
}

// UsageRewrite counts how one answer's usage fared: outcome is a Usage*
// value; "" counts nothing (a reader's, which rewrites nothing).
func (m *Metrics) UsageRewrite(outcome string) {
	if m != nil && outcome != "" {
		m.answers.usageRewrites.WithLabelValues(outcome).Inc()
	}
}

// KVParamsSuspect counts a prefill answer whose remote_host the decode engine
// cannot reach.
func (m *Metrics) KVParamsSuspect() {
	if m != nil {
		m.answers.kvParamsSuspect.Inc()
	}
}

// StreamError counts a decode answer that failed after its 2xx: an error
// event before its first token, in the request's mode (ModeNone counts
// nothing).
func (m *Metrics) StreamError(mode Mode) {
	if m != nil && mode != ModeNone {
		m.answers.streamErrors.WithLabelValues(mode.String()).Inc()
	}
}
