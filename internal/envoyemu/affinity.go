package envoyemu

import (
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strings"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
)

// Session affinity to ext_proc replicas (docs/envoy.md §14): the filter's
// gRPC client sends grpc_service.initial_metadata on every stream, its
// values evaluated against the client's request, and a RING_HASH or MAGLEV
// ext_proc cluster hashes the headers its hash_policy names to pick the
// replica.

// MetadataValue is one entry of grpc_service.initial_metadata. Value is a
// literal with %REQ(header)% commands, each replaced by the client's header
// (empty when absent); an entry whose value comes out empty is not sent, as
// Envoy's header parser skips empty values.
type MetadataValue struct{ Key, Value string }

// command is a substitution command of Envoy's formatter: %NAME% or
// %NAME(arg)%, possibly with a :length suffix.
var command = regexp.MustCompile(`%([A-Z_]+)(\(([^)]*)\))?(:[0-9]+)?%`)

func metadataFromProto(hvs []*corev3.HeaderValue) ([]MetadataValue, error) {
	var out []MetadataValue
	for _, hv := range hvs {
		if hv.GetRawValue() != nil {
			return nil, errors.New("grpc_service.initial_metadata raw_value is not emulated")
		}
		for _, m := range command.FindAllStringSubmatch(strings.ReplaceAll(hv.GetValue(), "%%", ""), -1) {
			if m[1] != "REQ" || m[3] == "" || m[4] != "" || strings.Contains(m[3], "?") {
				return nil, fmt.Errorf("grpc_service.initial_metadata %q: only %%REQ(header)%% is emulated, not %s", hv.GetKey(), m[0])
			}
		}
		out = append(out, MetadataValue{Key: strings.ToLower(hv.GetKey()), Value: hv.GetValue()})
	}
	return out, nil
}

// evaluate is the entry's value for the client's request headers h.
func (m MetadataValue) evaluate(h http.Header) string {
	var b strings.Builder
	for i := 0; i < len(m.Value); {
		if strings.HasPrefix(m.Value[i:], "%%") {
			b.WriteByte('%')
			i += 2
			continue
		}
		if loc := command.FindStringSubmatchIndex(m.Value[i:]); loc != nil && loc[0] == 0 {
			b.WriteString(h.Get(m.Value[i+loc[6] : i+loc[7]])) // the first value, as %REQ% reads it
			i += loc[1]
			continue
		}
		b.WriteByte(m.Value[i])
		i++
	}
	return b.String()
}

// hashHeadersFromProto is the headers a cluster hashes: those its
// HttpProtocolOptions.hash_policy names, when its load balancer is a hash's.
// Envoy ignores a hash policy under another load balancer.
func hashHeadersFromProto(c *clusterv3.Cluster, hps []*routev3.RouteAction_HashPolicy) ([]string, error) {
	if lb := c.GetLbPolicy(); lb != clusterv3.Cluster_RING_HASH && lb != clusterv3.Cluster_MAGLEV {
		return nil, nil
	}
	var out []string
	for _, hp := range hps {
		if hp.GetHeader() == nil || hp.GetHeader().GetRegexRewrite() != nil {
			return nil, errors.New("hash_policy: only plain header policies are emulated")
		}
		out = append(out, strings.ToLower(hp.GetHeader().GetHeaderName()))
	}
	return out, nil
}
