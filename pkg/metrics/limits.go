package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Values of limit_refusals_total{limit}: the limit a refused request met.
const (
	LimitStreams    = "max_concurrent_streams" // 429: limits.max_concurrent_streams
	LimitBodyTime   = "body_timeout"           // 408: the body took longer than limits.body_timeout
	LimitBuffered   = "max_buffered_bytes"     // 503: the bodies held at once would pass limits.max_buffered_bytes
	LimitBackground = "max_background"         // 503: prefill.max_background kv-sglang legs already run
	// LimitSaturated: 429, a request of an objective of negative priority
	// while a pool it would use was saturated (admission.objectives).
	LimitSaturated = "saturated"
)

var limitNames = []string{LimitStreams, LimitBodyTime, LimitBuffered, LimitBackground, LimitSaturated}

// limits counts what the service's resource limits hold and refuse.
type limits struct {
	refusals   *prometheus.CounterVec
	bodyBytes  prometheus.Gauge
	background prometheus.Gauge
	inForce    *prometheus.GaugeVec
	held       *prometheus.HistogramVec
}

// Values of held_seconds{outcome}: how a request's time in the hold ended.
const (
	HeldReleased  = "released"  // the pool had room for it
	HeldRefused   = "refused"   // admission.hold ran out (429), or the server shut down (503)
	HeldCancelled = "cancelled" // its client left
)

var heldOutcomes = []string{HeldReleased, HeldRefused, HeldCancelled}

func newLimits() limits {
	return limits{
		refusals: counterVec("limit_refusals_total",
			"Requests refused by a resource limit, by limit (max_concurrent_streams, body_timeout, max_buffered_bytes, max_background, saturated).",
			"limit"),
		bodyBytes: gauge("request_body_buffered_bytes",
			"Bytes of request bodies held now, all streams together, as counted against limits.max_buffered_bytes."),
		background: gauge("prefill_background_legs",
			"kv-sglang prefill legs running in the background now, as counted against prefill.max_background."),
		inForce: gaugeVec("limit_configured",
			"The limits in force, by limit (max_concurrent_streams, max_buffered_bytes, max_background), for alerts on what is held against them.",
			"limit"),
		held: histogramVec("held_seconds",
			"Time requests of a negative priority were held for room (admission.hold), by pool and how it ended (released, refused, cancelled).",
			[]float64{.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300}, "pool", "outcome"),
	}
}

func (l limits) collectors() []prometheus.Collector {
	return []prometheus.Collector{l.refusals, l.bodyBytes, l.background, l.inForce, l.held}
}

func (l limits) initSeries() {
	for _, n := range limitNames {
		l.refusals.WithLabelValues(n)
	}
	for _, pool := range []string{"prefill", "decode"} {
		for _, o := range heldOutcomes {
			l.held.WithLabelValues(pool, o)
		}
	}
}

// LimitRefused counts a request refused by limit, a Limit* value.
func (m *Metrics) LimitRefused(limit string) {
	if m != nil {
		m.limits.refusals.WithLabelValues(limit).Inc()
	}
}

// Held records how long a request was held for room in pool and how it
// ended (a Held* value).
func (m *Metrics) Held(pool, outcome string, d time.Duration) {
	if m != nil {
		m.limits.held.WithLabelValues(pool, outcome).Observe(d.Seconds())
	}
}

// BodyBytesHeld adds delta bytes to the request bodies held.
func (m *Metrics) BodyBytesHeld(delta int64) {
	if m != nil {
		m.limits.bodyBytes.Add(float64(delta))
	}
}

// BackgroundLeg adds delta to the background prefill legs running.
func (m *Metrics) BackgroundLeg(delta int) {
	if m != nil {
		m.limits.background.Add(float64(delta))
	}
}

// Limits records the limits in force: limits.max_concurrent_streams,
// limits.max_buffered_bytes and prefill.max_background (all restart-only).
func (m *Metrics) Limits(streams int, bufferedBytes int64, background int) {
	if m != nil {
		m.limits.inForce.WithLabelValues(LimitStreams).Set(float64(streams))
		m.limits.inForce.WithLabelValues(LimitBuffered).Set(float64(bufferedBytes))
		m.limits.inForce.WithLabelValues(LimitBackground).Set(float64(background))
	}
}

// WatchHeld exports held_requests{pool}: the requests that may be shed held
// now, waiting for room in that pool (admission.hold), read from held at
// every scrape. Call it once.
func (m *Metrics) WatchHeld(held func() (prefill, decode int)) {
	for pool, of := range map[string]func() int{
		"prefill": func() int { n, _ := held(); return n },
		"decode":  func() int { _, n := held(); return n },
	} {
		m.registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: namespace, Name: "held_requests",
			Help:        "Requests of an objective of negative priority held now, waiting for room in the pool (admission.hold).",
			ConstLabels: prometheus.Labels{"pool": pool}}, func() float64 { return float64(of()) }))
	}
}
