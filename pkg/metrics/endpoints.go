package metrics

import "github.com/prometheus/client_golang/prometheus"

// EndpointState is one engine endpoint as seen at one moment.
type EndpointState struct {
	Pool     string // pool name: prefill or decode
	Endpoint string // ip:port, from the configuration, so the label set stays bounded
	InFlight int64
	// Healthy says the endpoint is in rotation: no ejection runs and the
	// active checks do not find it down (one back from an ejection is, while
	// its probe request runs).
	Healthy bool
	// CheckedDown says the active checks find it down; an endpoint that only
	// failed requests is not Healthy but not CheckedDown.
	CheckedDown bool
	// AwaitsCheck says the pool's active checks are on and none has judged
	// the endpoint yet (it is taken healthy meanwhile).
	AwaitsCheck bool
	Ejections   uint64 // times taken out of rotation since the endpoint was added
	// Scraped says the engine's own load below is fresh (pools.<pool>.metrics).
	Scraped bool
	Waiting float64 // requests queued in the engine
	KVUsage float64 // KV cache in use, 0..1
	// CacheTrusted is false while a decode endpoint's answers have lately
	// belied what the router estimated it caches (pd.min_uncached_tokens).
	CacheTrusted bool
	// BootstrapPort is the SGLang bootstrap port a kv-sglang prefill
	// endpoint's requests name; 0 elsewhere.
	BootstrapPort int
	// EngineRanks is, for a kv-mooncake prefill endpoint, how many
	// data-parallel ranks its bootstrap server listed with their engine ids
	// (0: none read yet); -1 elsewhere.
	EngineRanks int
	// Models is how many models and adapters the engine listed at its last
	// answer to GET /v1/models; 0 before one.
	Models int
	// ScrapeFailures counts the failed scrapes of the engine's /metrics by
	// reason; a reason without one may be left out.
	ScrapeFailures map[string]uint64
}

// WatchEndpoints exports the endpoint_* metrics, read from src at every
// scrape rather than pushed, so they are never stale and cost nothing
// between scrapes. Call it once.
func (m *Metrics) WatchEndpoints(src func() []EndpointState) {
	m.registry.MustRegister(&endpointCollector{src: src})
}

var (
	inflightDesc = endpointDesc("endpoint_inflight",
		"Requests currently holding an endpoint: prefill legs in progress, or routed decode legs whose ext_proc stream is open.")
	healthyDesc = endpointDesc("endpoint_healthy",
		"1 while the endpoint is in rotation, 0 while it is ejected after failures or failing active checks. "+
			"One whose ejection ran out is back (1), and takes one probe request before any other.")
	ejectionsDesc = endpointDesc("endpoint_ejections_total",
		"Times the endpoint was taken out of rotation: ejected after consecutive failures, or failing an active check while up.")
	waitingDesc = endpointDesc("endpoint_engine_waiting",
		"Requests queued in the engine, as its /metrics said at the last scrape (only while that scrape is fresh).")
	kvUsageDesc = endpointDesc("endpoint_engine_kv_usage",
		"The engine's KV cache in use, 0 to 1, as its /metrics said at the last scrape (only while that scrape is fresh).")
	cacheTrustedDesc = endpointDesc("endpoint_cache_trusted",
		"0 while a decode endpoint's answers have lately belied the prefix it was estimated to cache (evicted, restarted): "+
			"the cache rule (cached_prefix) is off for it; else 1.")
	bootstrapPortDesc = endpointDesc("endpoint_bootstrap_port",
		"kv-sglang prefill endpoints: the bootstrap port their requests name, as the engine reports it in its server info, "+
			"else as its pod's sglang.ai/bootstrap-port annotation or pools.prefill.bootstrap_port says.")
	engineRanksDesc = endpointDesc("endpoint_engine_ranks",
		"kv-mooncake prefill endpoints: the data-parallel ranks whose engine ids the engine's Mooncake bootstrap server "+
			"listed (GET /query); 0 until it answers, and until then the endpoint takes no P/D request.")
	modelsDesc = endpointDesc("endpoint_models",
		"Models and LoRA adapters the engine listed at its last answer to GET /v1/models (0 before one): "+
			"a request naming one of them goes only to endpoints of its pool that list it.")
)

var scrapeFailuresDesc = prometheus.NewDesc(prometheus.BuildFQName(namespace, "", "endpoint_scrape_failures_total"),
	"Failed scrapes of the engine's /metrics (pools.<pool>.metrics), by reason (docs/metrics.md); a reason's series starts at its first failure.",
	[]string{"pool", "endpoint", "reason"}, nil)

// endpointDesc describes a series per pool and endpoint.
func endpointDesc(name, help string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(namespace, "", name), help, []string{"pool", "endpoint"}, nil)
}

type endpointCollector struct{ src func() []EndpointState }

func (c *endpointCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{inflightDesc, healthyDesc, ejectionsDesc, waitingDesc, kvUsageDesc, cacheTrustedDesc, bootstrapPortDesc, engineRanksDesc, modelsDesc, scrapeFailuresDesc} {
		ch <- d
	}
}

func (c *endpointCollector) Collect(ch chan<- prometheus.Metric) {
	for _, e := range c.src() {
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(e.InFlight), e.Pool, e.Endpoint)
		ch <- prometheus.MustNewConstMetric(healthyDesc, prometheus.GaugeValue, one(e.Healthy), e.Pool, e.Endpoint)
		ch <- prometheus.MustNewConstMetric(ejectionsDesc, prometheus.CounterValue, float64(e.Ejections), e.Pool, e.Endpoint)
		ch <- prometheus.MustNewConstMetric(cacheTrustedDesc, prometheus.GaugeValue, one(e.CacheTrusted), e.Pool, e.Endpoint)
		ch <- prometheus.MustNewConstMetric(modelsDesc, prometheus.GaugeValue, float64(e.Models), e.Pool, e.Endpoint)
		if e.BootstrapPort > 0 {
			ch <- prometheus.MustNewConstMetric(bootstrapPortDesc, prometheus.GaugeValue, float64(e.BootstrapPort), e.Pool, e.Endpoint)
		}
		if e.EngineRanks >= 0 {
			ch <- prometheus.MustNewConstMetric(engineRanksDesc, prometheus.GaugeValue, float64(e.EngineRanks), e.Pool, e.Endpoint)
		}
		for reason, n := range e.ScrapeFailures {
			ch <- prometheus.MustNewConstMetric(scrapeFailuresDesc, prometheus.CounterValue, float64(n), e.Pool, e.Endpoint, reason)
		}
		if e.Scraped {
			ch <- prometheus.MustNewConstMetric(waitingDesc, prometheus.GaugeValue, e.Waiting, e.Pool, e.Endpoint)
			ch <- prometheus.MustNewConstMetric(kvUsageDesc, prometheus.GaugeValue, e.KVUsage, e.Pool, e.Endpoint)
		}
	}
}
