package metrics

import "github.com/prometheus/client_golang/prometheus"

// Values of discovery_errors_total{reason}: why a list or watch of the
// Kubernetes API failed.
const (
	DiscoveryUnreachable = "unreachable" // no answer, or the stream broke: the last endpoints stay
	DiscoveryDenied      = "denied"      // Forbidden or Unauthorized: RBAC or credentials
	DiscoveryMissing     = "missing"     // the resource is not served: the InferencePool CRD is not installed
)

var discoveryReasons = []string{DiscoveryUnreachable, DiscoveryDenied, DiscoveryMissing}

// DiscoveryState is one pool's Kubernetes discovery at one moment.
type DiscoveryState struct {
	Pool      string // prefill or decode
	Synced    bool   // every informer has delivered its first list
	Refused   bool   // the API server refuses what discovery needs
	Reachable bool   // the API server answered the last call
	Endpoints int    // endpoints discovered, as the pool has them (one an address)
}

var (
	discoverySyncedDesc    = poolDesc("discovery_synced", "1 once every Kubernetes informer of the pool has delivered its first list; readiness waits for it.")
	discoveryRefusedDesc   = poolDesc("discovery_refused", "1 while the API server refuses a list or watch the pool needs (RBAC, a CRD not installed): not ready, unless the pool was followed before, which then serves its last endpoints.")
	discoveryReachableDesc = poolDesc("discovery_api_reachable", "1 when the Kubernetes API server answered the pool's last list or watch; 0 while the last endpoints are served without it.")
	discoveryEndpointsDesc = poolDesc("discovery_endpoints", "Endpoints the pool's Kubernetes discovery currently gives it, as it routes to them: two pods at one address are one.")
)

// poolDesc describes a series per pool.
func poolDesc(name, help string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(namespace, "", name), help, []string{"pool"}, nil)
}

// WatchDiscovery exports the discovery gauges of pools, read from src at
// every scrape, and returns the function that counts
// discovery_errors_total{pool, reason} (every pool and Discovery* reason at
// zero from the start). Call it once, only when some pool is discovered.
func (m *Metrics) WatchDiscovery(pools []string, src func() []DiscoveryState) (countError func(pool, reason string)) {
	errs := counterVec("discovery_errors_total",
		"Failed lists and watches of the Kubernetes API by pool and reason (unreachable, denied, missing).",
		"pool", "reason")
	for _, p := range pools {
		for _, r := range discoveryReasons {
			errs.WithLabelValues(p, r)
		}
	}
	m.registry.MustRegister(errs, &discoveryCollector{src: src})
	return func(pool, reason string) { errs.WithLabelValues(pool, reason).Inc() }
}

type discoveryCollector struct{ src func() []DiscoveryState }

func (c *discoveryCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- discoverySyncedDesc
	ch <- discoveryRefusedDesc
	ch <- discoveryReachableDesc
	ch <- discoveryEndpointsDesc
}

func (c *discoveryCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.src() {
		ch <- prometheus.MustNewConstMetric(discoverySyncedDesc, prometheus.GaugeValue, one(s.Synced), s.Pool)
		ch <- prometheus.MustNewConstMetric(discoveryRefusedDesc, prometheus.GaugeValue, one(s.Refused), s.Pool)
		ch <- prometheus.MustNewConstMetric(discoveryReachableDesc, prometheus.GaugeValue, one(s.Reachable), s.Pool)
		ch <- prometheus.MustNewConstMetric(discoveryEndpointsDesc, prometheus.GaugeValue, float64(s.Endpoints), s.Pool)
	}
}

func one(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
