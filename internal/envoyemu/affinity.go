package envoyemu

import (
	"errors"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strings"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"google.golang.org/grpc/metadata"
)

// Session affinity to ext_proc replicas (docs/envoy.md §14): the filter's
// gRPC client sends grpc_service.initial_metadata on every stream, its
// values evaluated against the client's request, and a RING_HASH or MAGLEV
// ext_proc cluster hashes the headers its hash_policy names to pick the
// replica.

// MetadataValue is one entry of grpc_service.initial_metadata. Value is a
// literal with %REQ(header)% commands, each replaced by the client's header
// (empty when absent), and %DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%, the
// client's address; an entry whose value comes out empty is not sent, as
// Envoy's header parser skips empty values.
type MetadataValue struct{ Key, Value string }

// command is a substitution command of Envoy's formatter at the start of a
// string: %NAME%, or %NAME(arg)% with an optional :length.
var command = regexp.MustCompile(`^%([A-Z0-9_]+)(?:\(([^)]*)\))?(:[0-9]+)?%`)

// part is a piece of a value: literal text, the header a %REQ()% names, or
// the client's address.
type part struct {
	text, header string
	remote       bool
}

// remoteAddress is the command for the client's address without its port:
// the connection's peer, as with use_remote_address and no trusted
// x-forwarded-for hop (configload.go refuses the command without the one and
// xff_num_trusted_hops).
const remoteAddress = "DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT"

// parts cuts a value into its pieces, left to right as Envoy's formatter
// reads it (%% is a literal %), and refuses what the emulator does not
// evaluate: every command but %REQ(header)% and the client's address,
// %REQ%'s alternative header (REQ(a?b)) and its length, and a % that starts
// no command.
func parts(value string) ([]part, error) {
	var out []part
	for rest := value; rest != ""; {
		i := strings.IndexByte(rest, '%')
		switch {
		case i < 0:
			return append(out, part{text: rest}), nil
		case strings.HasPrefix(rest[i:], "%%"):
			out, rest = append(out, part{text: rest[:i+1]}), rest[i+2:]
			continue
		}
		m := command.FindStringSubmatch(rest[i:])
		if m != nil && m[0] == "%"+remoteAddress+"%" {
			out, rest = append(out, part{text: rest[:i]}, part{remote: true}), rest[i+len(m[0]):]
			continue
		}
		if m == nil || m[1] != "REQ" || m[2] == "" || m[3] != "" || strings.Contains(m[2], "?") {
			bad := rest[i:]
			if m != nil {
				bad = m[0]
			}
			return nil, fmt.Errorf("only %%REQ(header)%% and %%%s%% are emulated, not %q", remoteAddress, bad)
		}
		out = append(out, part{text: rest[:i]}, part{header: m[2]})
		rest = rest[i+len(m[0]):]
	}
	return out, nil
}

// CarriesAddress says whether the entry's value has the client's address.
func (m MetadataValue) CarriesAddress() bool {
	ps, _ := parts(m.Value) // checked when the config was read
	return slices.ContainsFunc(ps, func(p part) bool { return p.remote })
}

func metadataFromProto(hvs []*corev3.HeaderValue) ([]MetadataValue, error) {
	var out []MetadataValue
	for _, hv := range hvs {
		if hv.GetRawValue() != nil {
			return nil, errors.New("grpc_service.initial_metadata raw_value is not emulated")
		}
		if _, err := parts(hv.GetValue()); err != nil {
			return nil, fmt.Errorf("grpc_service.initial_metadata %q: %w", hv.GetKey(), err)
		}
		out = append(out, MetadataValue{Key: strings.ToLower(hv.GetKey()), Value: hv.GetValue()})
	}
	return out, nil
}

// evaluate is the entry's value for the request headers h, as the HCM hands
// them to the filter chain (exchange.requestHeaders), from the client at
// remote (host:port): each %REQ()% its header's first value, host read as
// :authority.
func (m MetadataValue) evaluate(h *headerMap, remote string) string {
	ps, _ := parts(m.Value) // checked when the config was read
	var b strings.Builder
	for _, p := range ps {
		if p.remote {
			host, _, err := net.SplitHostPort(remote)
			if err != nil {
				host = remote
			}
			b.WriteString(host)
			continue
		}
		if p.header == "" {
			b.WriteString(p.text)
			continue
		}
		name := strings.ToLower(p.header)
		if name == "host" {
			name = ":authority"
		}
		v, _ := h.get(name)
		b.WriteString(v)
	}
	return b.String()
}

// initialMetadata is what a stream for request headers h carries: md, to
// pick the endpoint of a hash-balanced cluster (§14), and sent, the entries
// grpc-go can send (printable ASCII; Envoy's codec passes other bytes on).
func initialMetadata(ms []MetadataValue, h *headerMap, remote string) (md, sent metadata.MD) {
	md, sent = metadata.MD{}, metadata.MD{}
	for _, m := range ms {
		if v := m.evaluate(h, remote); v != "" {
			md.Append(m.Key, v)
			if printableASCII(v) {
				sent.Append(m.Key, v)
			}
		}
	}
	return md, sent
}

// HashBalanced reports whether a cluster picks its hosts by a hash: its
// lb_policy, or the typed load_balancing_policy that overrides it (as Envoy
// Gateway writes it).
func HashBalanced(c *clusterv3.Cluster) bool {
	if ps := c.GetLoadBalancingPolicy().GetPolicies(); len(ps) > 0 {
		name := ps[0].GetTypedExtensionConfig().GetName()
		return name == "envoy.load_balancing_policies.ring_hash" || name == "envoy.load_balancing_policies.maglev"
	}
	return c.GetLbPolicy() == clusterv3.Cluster_RING_HASH || c.GetLbPolicy() == clusterv3.Cluster_MAGLEV
}

// HashHeader is a header hash policy of a cluster: the header, and whether
// the policy is terminal (when there is a hash so far, the policies after it
// are not evaluated).
type HashHeader struct {
	Name     string
	Terminal bool
}

// hashHeadersFromProto is the headers a cluster hashes: those its
// HttpProtocolOptions.hash_policy names, when it is hash-balanced. Envoy
// ignores a hash policy under another load balancer.
func hashHeadersFromProto(c *clusterv3.Cluster, hps []*routev3.RouteAction_HashPolicy) ([]HashHeader, error) {
	if !HashBalanced(c) {
		return nil, nil
	}
	var out []HashHeader
	for _, hp := range hps {
		if hp.GetHeader() == nil || hp.GetHeader().GetRegexRewrite() != nil {
			return nil, errors.New("hash_policy: only plain header policies are emulated")
		}
		out = append(out, HashHeader{Name: strings.ToLower(hp.GetHeader().GetHeaderName()), Terminal: hp.GetTerminal()})
	}
	return out, nil
}
