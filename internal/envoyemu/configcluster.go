package envoyemu

import (
	"errors"
	"strings"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

const httpProtocolOptionsKey = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

// clusterFromProto reads what the emulator models of a static cluster: its
// circuit breakers and streams per connection (§12), and for an ORIGINAL_DST
// cluster its host choice, with Envoy's ORIGINAL_DST config checks (§8.1).
func clusterFromProto(c *clusterv3.Cluster) (*Cluster, error) {
	breakers, err := thresholdsFromProto(c.GetCircuitBreakers())
	if err != nil {
		return nil, err
	}
	hpo, err := httpProtocolOptions(c)
	if err != nil {
		return nil, err
	}
	hash, err := hashHeadersFromProto(c, hpo.GetHashPolicy())
	if err != nil {
		return nil, err
	}
	tls, err := tlsFromCluster(c)
	if err != nil {
		return nil, err
	}
	cl := &Cluster{Name: c.GetName(), Breakers: breakers, StreamsPerConnection: streamsPerConnection(c, hpo), TLS: tls, HashHeaders: hash}
	odc := c.GetOriginalDstLbConfig()
	if c.GetType() != clusterv3.Cluster_ORIGINAL_DST {
		if odc != nil {
			return nil, errors.New("original_dst_lb_config set on a cluster that is not ORIGINAL_DST")
		}
		return cl, nil
	}
	if c.GetLbPolicy() != clusterv3.Cluster_CLUSTER_PROVIDED {
		return nil, errors.New("ORIGINAL_DST cluster requires lb_policy CLUSTER_PROVIDED")
	}
	if c.GetLoadAssignment() != nil {
		return nil, errors.New("ORIGINAL_DST clusters must have no load_assignment")
	}
	od := &OriginalDst{HeaderName: defaultOriginalDstHeader}
	if odc != nil {
		if odc.GetHttpHeaderName() != "" && !odc.GetUseHttpHeader() {
			return nil, errors.New("original_dst_lb_config.http_header_name requires use_http_header")
		}
		od.UseHTTPHeader = odc.GetUseHttpHeader()
		if odc.GetHttpHeaderName() != "" {
			od.HeaderName = strings.ToLower(odc.GetHttpHeaderName())
		}
		od.PortOverride = odc.GetUpstreamPortOverride().GetValue()
		if mk := odc.GetMetadataKey(); mk != nil {
			od.MetadataNamespace = mk.GetKey()
			for _, seg := range mk.GetPath() {
				od.MetadataPath = append(od.MetadataPath, seg.GetKey())
			}
		}
	}
	cl.OriginalDst = od
	return cl, nil
}

// thresholdsFromProto takes the first thresholds entry for priority DEFAULT,
// as Envoy does, each field falling back to its default on its own. What the
// emulator does not model is refused rather than ignored.
func thresholdsFromProto(cb *clusterv3.CircuitBreakers) (Thresholds, error) {
	t := DefaultThresholds
	if len(cb.GetPerHostThresholds()) > 0 {
		return t, errors.New("circuit_breakers.per_host_thresholds is not emulated")
	}
	for _, th := range cb.GetThresholds() {
		if th.GetPriority() != corev3.RoutingPriority_DEFAULT {
			continue // routes here use the default priority
		}
		if th.GetRetryBudget() != nil {
			return t, errors.New("circuit_breakers retry_budget is not emulated")
		}
		t.MaxConnections = intOr(th.GetMaxConnections(), t.MaxConnections)
		t.MaxPendingRequests = intOr(th.GetMaxPendingRequests(), t.MaxPendingRequests)
		t.MaxRequests = intOr(th.GetMaxRequests(), t.MaxRequests)
		t.MaxRetries = intOr(th.GetMaxRetries(), t.MaxRetries)
		break
	}
	return t, nil
}

func intOr(v *wrapperspb.UInt32Value, def int) int {
	if v == nil {
		return def
	}
	return int(v.GetValue())
}

// httpProtocolOptions is the cluster's typed HttpProtocolOptions, nil
// without them.
func httpProtocolOptions(c *clusterv3.Cluster) (*upstreamhttpv3.HttpProtocolOptions, error) {
	opts, ok := c.GetTypedExtensionProtocolOptions()[httpProtocolOptionsKey]
	if !ok {
		return nil, nil
	}
	var hpo upstreamhttpv3.HttpProtocolOptions
	if err := unpack(opts, &hpo); err != nil {
		return nil, err
	}
	return &hpo, nil
}

// streamsPerConnection is 1 for an HTTP/1 upstream and the HTTP/2
// max_concurrent_streams (2^31 - 1 unless set) for an HTTP/2 one.
func streamsPerConnection(c *clusterv3.Cluster, hpo *upstreamhttpv3.HttpProtocolOptions) int {
	h2 := c.GetHttp2ProtocolOptions() //nolint:staticcheck // the deprecated form still works in Envoy
	if hpo != nil {
		h2 = hpo.GetExplicitHttpConfig().GetHttp2ProtocolOptions()
	}
	if h2 == nil {
		return 1
	}
	return intOr(h2.GetMaxConcurrentStreams(), defaultHTTP2Streams)
}
