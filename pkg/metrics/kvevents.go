package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// KVEventsState is one pool's following of its engines' KV events, as it is
// at one moment: running totals, and the index's size.
type KVEventsState struct {
	Pool string
	// Batches applied; Gaps found in a publisher's sequence, Replayed from its
	// replay socket or not (ReplayFailed: the view was rebuilt); Restarts of a
	// publisher's sequence (an engine restarted).
	Batches, Gaps, Replayed, ReplayFailed, Restarts int64
	// Dropped messages and blocks, by why: a topic naming no endpoint of the
	// pool, a payload that is not a KV event batch, a message over
	// max_message_bytes (its connection hung up on), stored blocks whose
	// parent the view lacks, events of another medium, cache group or block
	// size, events of a type not known.
	UnknownTopics, Undecodable, TooLarge, Orphans, Skipped, UnknownEvents int64
	Publishers, Stale, Blocks                                             int
}

// WatchKVEvents exports the kv_events_* series of the pools that follow
// their engines' KV events, read from src at every scrape. Call it once.
func (m *Metrics) WatchKVEvents(src func() []KVEventsState) {
	m.registry.MustRegister(&kvEventsCollector{src: src})
}

func kvDesc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(namespace, "kv_events", name), help, append([]string{"pool"}, labels...), nil)
}

var (
	kvBatchesDesc    = kvDesc("batches_total", "KV event batches applied to the pool's view of its engines' caches.")
	kvGapsDesc       = kvDesc("gaps_total", "Gaps found in an engine's sequence of KV event batches.")
	kvReplaysDesc    = kvDesc("replays_total", "Gaps asked of the engine's replay socket, by outcome: replayed, or failed (the view was rebuilt).", "outcome")
	kvRestartsDesc   = kvDesc("restarts_total", "Engines whose sequence of KV event batches started over (a restart): their view starts empty.")
	kvDroppedDesc    = kvDesc("dropped_total", "KV event messages or blocks not indexed, by reason: unknown_topic, undecodable, too_large (over max_message_bytes: the connection is hung up on), orphan (a parent the view lacks), other_medium (another medium, KV cache group or block size), unknown_event (a type this release does not know).", "reason")
	kvPublishersDesc = kvDesc("publishers", "Engines (and data-parallel ranks) whose KV events the pool follows.")
	kvStaleDesc      = kvDesc("stale_publishers", "Publishers whose view routing may not trust now: requests that could reach them go by estimates.")
	kvBlocksDesc     = kvDesc("index_blocks", "KV blocks in the pool's view, over all its engines.")
)

type kvEventsCollector struct{ src func() []KVEventsState }

func (c *kvEventsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{kvBatchesDesc, kvGapsDesc, kvReplaysDesc, kvRestartsDesc, kvDroppedDesc, kvPublishersDesc, kvStaleDesc, kvBlocksDesc} {
		ch <- d
	}
}

func (c *kvEventsCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(d *prometheus.Desc, v int, pool string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), pool)
	}
	for _, s := range c.src() {
		counter(kvBatchesDesc, s.Batches, s.Pool)
		counter(kvGapsDesc, s.Gaps, s.Pool)
		counter(kvReplaysDesc, s.Replayed, s.Pool, "replayed")
		counter(kvReplaysDesc, s.ReplayFailed, s.Pool, "failed")
		counter(kvRestartsDesc, s.Restarts, s.Pool)
		counter(kvDroppedDesc, s.UnknownTopics, s.Pool, "unknown_topic")
		counter(kvDroppedDesc, s.Undecodable, s.Pool, "undecodable")
		counter(kvDroppedDesc, s.TooLarge, s.Pool, "too_large")
		counter(kvDroppedDesc, s.Orphans, s.Pool, "orphan")
		counter(kvDroppedDesc, s.Skipped, s.Pool, "other_medium")
		counter(kvDroppedDesc, s.UnknownEvents, s.Pool, "unknown_event")
		gauge(kvPublishersDesc, s.Publishers, s.Pool)
		gauge(kvStaleDesc, s.Stale, s.Pool)
		gauge(kvBlocksDesc, s.Blocks, s.Pool)
	}
}

// Tokenize records one request's token ids asked of an engine's /tokenize,
// for routing by KV events: how long it took and whether it answered.
func (m *Metrics) Tokenize(d time.Duration, ok bool) {
	if m == nil {
		return
	}
	outcome := "ok"
	if !ok {
		outcome = "failed"
	}
	m.tokenize.WithLabelValues(outcome).Observe(d.Seconds())
}
