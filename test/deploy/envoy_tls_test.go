package deploy

import (
	"slices"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
	"google.golang.org/protobuf/proto"
)

// checkExtProcTLS: the ext_proc port lets its caller hold stream slots, send prefill legs with
// any Authorization and eject endpoints, so Envoy reaches it over mTLS only: a client
// certificate, and pd-extproc's certificate checked against a CA and its SAN (docs/envoy.md §13).
// The client certificate comes by SDS (file-based for a static bootstrap, from Envoy Gateway for
// its proxies), so that a renewal reaches Envoy without a restart. Each endpoint is
// checked with the transport socket Envoy picks for it: the first transport_socket_matches entry
// its envoy.transport_socket_match metadata matches (how Envoy Gateway attaches a
// BackendTLSPolicy), else the cluster's transport_socket.
func checkExtProcTLS(c *clusterv3.Cluster, cla *endpointv3.ClusterLoadAssignment, r *report) {
	if cla == nil {
		cla = c.GetLoadAssignment()
	}
	seen := map[*corev3.TransportSocket]bool{}
	for _, lle := range cla.GetEndpoints() {
		for _, le := range lle.GetLbEndpoints() {
			ts := socketFor(c, le.GetMetadata(), lle.GetMetadata())
			if !seen[ts] {
				seen[ts] = true
				checkSocket(c.GetName(), ts, r)
			}
		}
	}
	if len(seen) == 0 {
		checkSocket(c.GetName(), c.GetTransportSocket(), r)
	}
}

// socketFor is Envoy's choice of transport socket for an endpoint (cluster.proto,
// transport_socket_matches): the first match whose fields all equal the endpoint's
// envoy.transport_socket_match metadata (the endpoint's, else its locality's).
func socketFor(c *clusterv3.Cluster, mds ...*corev3.Metadata) *corev3.TransportSocket {
	for _, md := range mds {
		fields := md.GetFilterMetadata()["envoy.transport_socket_match"].GetFields()
		if fields == nil {
			continue
		}
		for _, m := range c.GetTransportSocketMatches() {
			ok := true
			for k, v := range m.GetMatch().GetFields() {
				if !proto.Equal(fields[k], v) {
					ok = false
				}
			}
			if ok {
				return m.GetTransportSocket()
			}
		}
	}
	return c.GetTransportSocket()
}

func checkSocket(name string, ts *corev3.TransportSocket, r *report) {
	var utc tlsv3.UpstreamTlsContext
	if ts == nil || !ts.GetTypedConfig().MessageIs(&utc) || ts.GetTypedConfig().UnmarshalTo(&utc) != nil {
		r.errorf("ext_proc cluster %q is plaintext: give it a transport_socket with an UpstreamTlsContext (mTLS), or anyone who reaches pd-extproc's port can use it", name)
		return
	}
	ctc := utc.GetCommonTlsContext()
	if len(ctc.GetTlsCertificates()) == 0 && len(ctc.GetTlsCertificateSdsSecretConfigs()) == 0 {
		r.errorf("ext_proc cluster %q sends no client certificate: pd-extproc (--tls-client-ca-file) refuses the handshake", name)
	}
	if len(ctc.GetTlsCertificates()) > 0 {
		r.errorf("ext_proc cluster %q names its client certificate's files in the bootstrap: Envoy reads them once, so a renewed "+
			"certificate needs a restart, and without one every request fails when the old one expires; take it by SDS "+
			"(tls_certificate_sds_secret_configs with a path_config_source whose secret has a watched_directory)", name)
	}
	vc := ctc.GetValidationContext()
	if cvc := ctc.GetCombinedValidationContext(); cvc != nil {
		vc = cvc.GetDefaultValidationContext()
	}
	hasCA := vc.GetTrustedCa() != nil || ctc.GetValidationContextSdsSecretConfig() != nil || ctc.GetCombinedValidationContext() != nil
	if !hasCA {
		r.errorf("ext_proc cluster %q does not verify pd-extproc's certificate (no trusted_ca): Envoy would talk to any server", name)
	}
	sanOK := slices.ContainsFunc(vc.GetMatchTypedSubjectAltNames(), func(m *tlsv3.SubjectAltNameMatcher) bool {
		return m.GetSanType() == tlsv3.SubjectAltNameMatcher_DNS && m.GetMatcher().GetExact() == testbed.ServerSAN
	})
	if !sanOK {
		r.errorf("ext_proc cluster %q does not require the SAN %s of pd-extproc's certificate (match_typed_subject_alt_names): any certificate of the CA would do", name, testbed.ServerSAN)
	}
	if alpn := ctc.GetAlpnProtocols(); len(alpn) > 0 && !slices.Contains(alpn, "h2") {
		r.errorf("ext_proc cluster %q offers ALPN %v without h2: pd-extproc's gRPC server refuses the handshake", name, alpn)
	}
}

// checkEdge: the connection manager in front of pd-extproc is the edge. It appends the client's
// address to x-forwarded-for and keeps the client's x-request-id (pd-extproc validates it).
func checkEdge(u hcmUse, r *report) {
	if !u.hcm.GetUseRemoteAddress().GetValue() {
		r.errorf("%s: use_remote_address is not true: Envoy trusts the client's own x-forwarded-for and x-envoy-* headers", u.where)
	}
	if !u.hcm.GetPreserveExternalRequestId() {
		r.errorf("%s: preserve_external_request_id is not true: clients' request ids are replaced", u.where)
	}
}

// checkLink holds the security rules of the link to pd-extproc for every connection manager
// that runs it: the edge headers, and mTLS on its ext_proc cluster.
func (m *envoyModel) checkLink(r *report) {
	seen := map[string]bool{}
	for _, u := range m.hcms {
		eps := extProcFilters(u.hcm)
		if len(eps) == 0 {
			continue
		}
		checkEdge(u, r)
		for _, ep := range eps {
			name := ep.config.GetGrpcService().GetEnvoyGrpc().GetClusterName()
			if c, ok := m.clusters[name]; ok && !seen[name] {
				seen[name] = true
				checkExtProcTLS(c, m.endpoints[name], r)
			}
		}
	}
}
