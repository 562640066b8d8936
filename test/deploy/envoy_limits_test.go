package deploy

import (
	"net/http"
	"net/netip"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/pd-extproc/pd-extproc/pkg/server"
)

// The sizing every shipped Envoy config promises (README "Sizing", docs/envoy.md §12).
const (
	// minGenerations is how many generations one Envoy must hold at once: each holds a
	// request on the ORIGINAL_DST cluster and an ext_proc stream on the ext_proc cluster.
	minGenerations = 10000
	// Envoy's circuit-breaker defaults (ResourceManagers::load in upstream_impl.cc) and its
	// HTTP/2 stream limit when http2_protocol_options leaves it unset.
	envoyDefaultThreshold = 1024
	envoyDefaultH2Streams = 1<<31 - 1
	statsPath             = "/stats/prometheus"
)

// breakers are a cluster's circuit-breaker thresholds for priority DEFAULT, each
// unset field at Envoy's default.
type breakers struct{ connections, pending, requests uint64 }

func defaultPriorityBreakers(c *clusterv3.Cluster) (b breakers, explicit bool) {
	b = breakers{envoyDefaultThreshold, envoyDefaultThreshold, envoyDefaultThreshold}
	for _, t := range c.GetCircuitBreakers().GetThresholds() {
		if t.GetPriority() != corev3.RoutingPriority_DEFAULT {
			continue
		}
		for _, f := range []struct {
			dst *uint64
			v   *wrapperspb.UInt32Value
		}{{&b.connections, t.GetMaxConnections()}, {&b.pending, t.GetMaxPendingRequests()}, {&b.requests, t.GetMaxRequests()}} {
			if f.v != nil {
				*f.dst = uint64(f.v.GetValue())
			}
		}
		return b, true // Envoy uses the first thresholds entry of a priority
	}
	return b, false
}

// checkBreakers: the clusters every generation holds a slot on must admit minGenerations
// at once, and the ext_proc cluster more streams than pd-extproc admits, so that past its
// limit the client gets pd-extproc's 429 rather than Envoy's 500.
func checkBreakers(c *clusterv3.Cluster, role string, limits serviceLimits, r *report) {
	b, explicit := defaultPriorityBreakers(c)
	if !explicit {
		r.errorf("%s cluster %q sets no circuit_breakers: Envoy's defaults admit %d requests, far below %d concurrent generations", role, c.GetName(), envoyDefaultThreshold, minGenerations)
		return
	}
	for _, f := range []struct {
		name string
		v    uint64
	}{{"max_connections", b.connections}, {"max_pending_requests", b.pending}, {"max_requests", b.requests}} {
		if f.v < minGenerations {
			r.errorf("%s cluster %q: circuit_breakers %s %d is below %d concurrent generations", role, c.GetName(), f.name, f.v, minGenerations)
		}
	}
	if role != "ext_proc" {
		return
	}
	if b.requests <= uint64(limits.maxConcurrentStreams) {
		r.errorf("ext_proc cluster %q: max_requests %d is not above limits.max_concurrent_streams %d: Envoy answers 500 before pd-extproc's 429", c.GetName(), b.requests, limits.maxConcurrentStreams)
	}
	if streams := http2MaxStreams(c); streams*b.connections < b.requests {
		r.errorf("ext_proc cluster %q: %d connections of %d HTTP/2 streams cannot carry max_requests %d", c.GetName(), b.connections, streams, b.requests)
	}
}

// checkKeepalive: Envoy pings pd-extproc, so that the streams to a replica it can no longer
// reach (a partition, a frozen node) end within a minute rather than stall until
// stream_idle_timeout (FULL_DUPLEX has no message timer), and no more often than pd-extproc
// takes pings, which answers faster ones with GOAWAY too_many_pings and so cuts every stream.
func checkKeepalive(c *clusterv3.Cluster, r *report) {
	k := http2Options(c).GetConnectionKeepalive()
	interval, timeout := k.GetInterval().AsDuration(), k.GetTimeout().AsDuration()
	switch {
	case interval <= 0 || timeout <= 0:
		r.errorf("ext_proc cluster %q sets no http2_protocol_options.connection_keepalive interval and timeout: streams to a replica Envoy cannot reach stall until stream_idle_timeout", c.GetName())
	case interval < server.DefaultKeepalive.MinPeerPing:
		r.errorf("ext_proc cluster %q pings every %v, more often than pd-extproc takes pings (%v, --keepalive-min-peer-ping): it answers GOAWAY too_many_pings", c.GetName(), interval, server.DefaultKeepalive.MinPeerPing)
	case interval+timeout > time.Minute:
		r.errorf("ext_proc cluster %q finds a replica it cannot reach only after %v (connection_keepalive interval and timeout); keep it within a minute", c.GetName(), interval+timeout)
	}
}

// checkHostRemoval: a replica that DNS stops listing must leave at once. With active health
// checks Envoy keeps a removed host while it passes them, unless ignore_health_on_host_removal
// is set, and a stopping pod passes them through its preStop sleep (README "Upgrading").
func checkHostRemoval(c *clusterv3.Cluster, r *report) {
	if len(c.GetHealthChecks()) > 0 && !c.GetIgnoreHealthOnHostRemoval() {
		r.errorf("ext_proc cluster %q has health_checks without ignore_health_on_host_removal: a pod being deleted keeps its new streams until it stops listening, and they fail", c.GetName())
	}
}

// engineKeepAlive is how long the engines keep an idle keep-alive connection: uvicorn's
// timeout_keep_alive, which vLLM sets from VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default 5) and SGLang
// to 5.
const engineKeepAlive = 5 * time.Second

// checkIdleTimeout: Envoy closes an idle connection to an engine before the engine does. Its
// default keeps one for an hour, and a request sent on one as the engine closes it fails.
func checkIdleTimeout(c *clusterv3.Cluster, r *report) {
	idle := httpProtocolOptions(c).GetCommonHttpProtocolOptions().GetIdleTimeout()
	if idle == nil || idle.AsDuration() <= 0 || idle.AsDuration() >= engineKeepAlive {
		r.errorf("%s cluster %q: idle connections kept %v, not closed before the engines close them (%v): a request sent on one as it closes fails",
			c.GetType(), c.GetName(), idle.AsDuration(), engineKeepAlive)
	}
}

// http2MaxStreams is the HTTP/2 max_concurrent_streams a cluster sets, or Envoy's default.
func http2MaxStreams(c *clusterv3.Cluster) uint64 {
	if v := http2Options(c).GetMaxConcurrentStreams(); v != nil {
		return uint64(v.GetValue())
	}
	return envoyDefaultH2Streams
}

// checkAdmin: the admin interface can drain and reconfigure Envoy, so it listens on
// loopback only; a cluster that reaches it may serve only GET /stats/prometheus.
func checkAdmin(b *bootstrapv3.Bootstrap, m *envoyModel, r *report) {
	sa := b.GetAdmin().GetAddress().GetSocketAddress()
	if sa == nil {
		return // no admin interface
	}
	ip, err := netip.ParseAddr(sa.GetAddress())
	if err != nil || !ip.IsLoopback() {
		r.errorf("admin listens on %q; bind it to 127.0.0.1 and scrape the stats listener instead", sa.GetAddress())
		return
	}
	for name, c := range m.clusters {
		if clusterReaches(c, ip, sa.GetPortValue()) {
			m.adminClusters[name] = true
		}
	}
}

func clusterReaches(c *clusterv3.Cluster, ip netip.Addr, port uint32) bool {
	for _, le := range c.GetLoadAssignment().GetEndpoints() {
		for _, lb := range le.GetLbEndpoints() {
			a := lb.GetEndpoint().GetAddress().GetSocketAddress()
			if got, err := netip.ParseAddr(a.GetAddress()); err == nil && got == ip && a.GetPortValue() == port {
				return true
			}
		}
	}
	return false
}

// checkAdminRoute: a route to the admin interface must be GET /stats/prometheus exactly.
func checkAdminRoute(rt *routev3.Route, where string, r *report) {
	m := rt.GetMatch()
	get := false
	for _, h := range m.GetHeaders() {
		if h.GetName() == ":method" && h.GetStringMatch().GetExact() == http.MethodGet {
			get = true
		}
	}
	if m.GetPath() != statsPath || !get {
		r.errorf("%s reaches the admin interface; it may serve only GET %s (match path %s with a :method GET header matcher)", where, statsPath, statsPath)
	}
}
