package metrics

import "github.com/prometheus/client_golang/prometheus"

// EndpointState is one engine endpoint as seen at one moment.
type EndpointState struct {
	Pool     string // pool name: prefill or decode
	Endpoint string // ip:port, from the configuration, so the label set stays bounded
	InFlight int64
	Healthy  bool
	// CacheTrusted is false while a decode endpoint's answers have lately
	// belied what the router estimated it caches (pd.min_uncached_tokens).
	CacheTrusted bool
}

// WatchEndpoints exports endpoint_inflight and endpoint_healthy, read from src
// at every scrape rather than pushed, so they are never stale and cost nothing
// between scrapes. Call it once.
func (m *Metrics) WatchEndpoints(src func() []EndpointState) {
	m.registry.MustRegister(&endpointCollector{src: src})
}

var (
	inflightDesc = prometheus.NewDesc(prometheus.BuildFQName(namespace, "", "endpoint_inflight"),
		"Requests currently holding an endpoint: prefill legs in progress, or routed decode legs whose ext_proc stream is open.",
		[]string{"pool", "endpoint"}, nil)
	healthyDesc = prometheus.NewDesc(prometheus.BuildFQName(namespace, "", "endpoint_healthy"),
		"1 when the endpoint is eligible for new requests, 0 when it is not.",
		[]string{"pool", "endpoint"}, nil)
	cacheTrustedDesc = prometheus.NewDesc(prometheus.BuildFQName(namespace, "", "endpoint_cache_trusted"),
		"0 while a decode endpoint's answers have lately belied the prefix it was estimated to cache (evicted, restarted): "+
			"the cache rule (cached_prefix) is off for it; else 1.",
		[]string{"pool", "endpoint"}, nil)
)

type endpointCollector struct{ src func() []EndpointState }

func (c *endpointCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- inflightDesc
	ch <- healthyDesc
	ch <- cacheTrustedDesc
}

func (c *endpointCollector) Collect(ch chan<- prometheus.Metric) {
	for _, e := range c.src() {
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(e.InFlight), e.Pool, e.Endpoint)
		ch <- prometheus.MustNewConstMetric(healthyDesc, prometheus.GaugeValue, one(e.Healthy), e.Pool, e.Endpoint)
		ch <- prometheus.MustNewConstMetric(cacheTrustedDesc, prometheus.GaugeValue, one(e.CacheTrusted), e.Pool, e.Endpoint)
	}
}
