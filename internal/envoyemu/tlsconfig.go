package envoyemu

import (
	"crypto/tls"
	"errors"
	"fmt"
	"slices"
	"strings"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rawbufferv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/raw_buffer/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// UpstreamTLS is a cluster's transport_socket when it is Envoy's TLS socket
// with an UpstreamTlsContext (§13). The paths are the bootstrap's; a test
// points them at files of its own after LoadConfig. Start reads the files,
// as Envoy does when it loads the bootstrap: a missing file, or a key that
// does not match its certificate, refuses the config.
type UpstreamTLS struct {
	// CertFile and KeyFile are the client certificate (tls_certificates[0]):
	// sent whenever the server asks for one. Empty: none.
	CertFile, KeyFile string
	// CAFile is validation_context.trusted_ca. Empty: the server's
	// certificate is not verified at all, as in Envoy.
	CAFile string
	// SubjectAltNames is match_typed_subject_alt_names: the server's
	// certificate must carry a SAN one of them matches. Needs CAFile.
	SubjectAltNames []SANMatcher
	// SNI is sent in the ClientHello; empty: none.
	SNI string
	// ALPN is common_tls_context.alpn_protocols; empty: Envoy offers h2, the
	// protocol of an HTTP/2 cluster (conn_pool_base.cc, the ALPN fallback).
	ALPN []string
	// MinVersion and MaxVersion are tls_params' versions; 0: TLS 1.2, the
	// default of both for an upstream (ClientContextConfigImpl).
	MinVersion, MaxVersion uint16
	// CertSDS and CASDS, when set, give the client certificate and the
	// trusted CA by file-based SDS in place of CertFile/KeyFile and CAFile
	// (tls_certificate_sds_secret_configs, combined_validation_context): read
	// at Start, and again whenever a file is moved into a watched directory.
	CertSDS, CASDS *SDSSecret
}

// SANMatcher is one entry of match_typed_subject_alt_names.
type SANMatcher struct {
	Type       string // DNS, URI, EMAIL or IP_ADDRESS
	Op         string // exact, prefix, suffix or contains
	Value      string
	IgnoreCase bool
}

// validate applies the checks Envoy makes of a client TLS context at load.
func (t *UpstreamTLS) validate() error {
	switch {
	case t == nil:
		return nil
	case (t.CertFile == "") != (t.KeyFile == ""):
		return errors.New("incomplete client certificate: certificate_chain and private_key go together")
	case t.CertSDS != nil && t.CertFile != "", t.CASDS != nil && t.CAFile != "":
		return errors.New("a certificate both from a file and by SDS")
	case len(t.SubjectAltNames) > 0 && t.CAFile == "" && t.CASDS == nil:
		// CertificateValidationContextConfigImpl.
		return errors.New("SAN-based verification of peer certificates without trusted CA is insecure and not allowed")
	case t.MinVersion != 0 && t.MaxVersion != 0 && t.MinVersion > t.MaxVersion:
		return errors.New("tls_minimum_protocol_version is above tls_maximum_protocol_version")
	case strings.ContainsRune(t.SNI, 0):
		return errors.New("SNI names containing NULL-byte are not allowed")
	case len(t.ALPN) > 0 && !slices.Contains(t.ALPN, "h2"):
		return errors.New("alpn_protocols without h2 is not emulated (the gRPC client always offers h2)")
	}
	for _, m := range t.SubjectAltNames {
		if !slices.Contains([]string{"DNS", "URI", "EMAIL", "IP_ADDRESS"}, m.Type) ||
			!slices.Contains([]string{"exact", "prefix", "suffix", "contains"}, m.Op) {
			return fmt.Errorf("SAN matcher %+v is not emulated", m)
		}
	}
	return nil
}

// tlsFromCluster reads a cluster's transport socket: nil for plaintext (none,
// or raw_buffer), the TLS settings for an UpstreamTlsContext. What the
// emulator does not model is refused, field by field.
func tlsFromCluster(c *clusterv3.Cluster) (*UpstreamTLS, error) {
	if len(c.GetTransportSocketMatches()) > 0 {
		return nil, errors.New("transport_socket_matches is not emulated")
	}
	ts := c.GetTransportSocket()
	if ts == nil {
		return nil, nil
	}
	a := ts.GetTypedConfig()
	switch {
	case a == nil:
		return nil, errors.New("transport_socket without typed_config is not emulated")
	case a.MessageIs(&rawbufferv3.RawBuffer{}):
		return nil, nil
	case !a.MessageIs(&tlsv3.UpstreamTlsContext{}):
		return nil, fmt.Errorf("transport_socket %s is not emulated", a.GetTypeUrl())
	}
	utc := &tlsv3.UpstreamTlsContext{}
	if err := unpack(a, utc); err != nil {
		return nil, err
	}
	ctc := utc.GetCommonTlsContext()
	t := &UpstreamTLS{SNI: utc.GetSni(), ALPN: ctc.GetAlpnProtocols()}
	vc, err := t.sdsContext(ctc)
	if err != nil {
		return nil, fmt.Errorf("transport_socket: %w", err)
	}
	for _, part := range []struct {
		m       proto.Message
		handled []string
	}{
		{utc, []string{"common_tls_context", "sni"}},
		{ctc, []string{"tls_params", "tls_certificates", "validation_context", "alpn_protocols", "tls_certificate_sds_secret_configs", "combined_validation_context"}},
		{ctc.GetTlsParams(), []string{"tls_minimum_protocol_version", "tls_maximum_protocol_version"}},
		{vc, []string{"trusted_ca", "match_typed_subject_alt_names"}},
	} {
		if extra := setFields(part.m, part.handled...); len(extra) > 0 {
			return nil, fmt.Errorf("transport_socket: %s %v not emulated", part.m.ProtoReflect().Descriptor().Name(), extra)
		}
	}
	if t.MinVersion, err = tlsVersion(ctc.GetTlsParams().GetTlsMinimumProtocolVersion()); err != nil {
		return nil, err
	}
	if t.MaxVersion, err = tlsVersion(ctc.GetTlsParams().GetTlsMaximumProtocolVersion()); err != nil {
		return nil, err
	}
	if err := t.certificate(ctc.GetTlsCertificates()); err != nil {
		return nil, err
	}
	if t.CAFile, err = fileOf("trusted_ca", vc.GetTrustedCa()); err != nil {
		return nil, err
	}
	for _, m := range vc.GetMatchTypedSubjectAltNames() {
		sm, err := sanMatcher(m)
		if err != nil {
			return nil, err
		}
		t.SubjectAltNames = append(t.SubjectAltNames, sm)
	}
	return t, nil // Config.Validate checks it, as it checks a hand-made one
}

// certificate takes the client certificate: one at most, as Envoy allows for
// a client context; an entry with neither part set is skipped, as in Envoy.
func (t *UpstreamTLS) certificate(certs []*tlsv3.TlsCertificate) error {
	var set []*tlsv3.TlsCertificate
	for _, c := range certs {
		if proto.Size(c) > 0 {
			set = append(set, c)
		}
	}
	switch len(set) {
	case 0:
		return nil
	case 1:
	default:
		return errors.New("Multiple TLS certificates are not supported for client contexts") //nolint:staticcheck // Envoy's words
	}
	if extra := setFields(set[0], "certificate_chain", "private_key"); len(extra) > 0 {
		return fmt.Errorf("transport_socket: TlsCertificate %v not emulated", extra)
	}
	var err error
	if t.CertFile, err = fileOf("certificate_chain", set[0].GetCertificateChain()); err != nil {
		return err
	}
	t.KeyFile, err = fileOf("private_key", set[0].GetPrivateKey())
	return err
}

func sanMatcher(m *tlsv3.SubjectAltNameMatcher) (SANMatcher, error) {
	sm := m.GetMatcher()
	if extra := setFields(sm, "exact", "prefix", "suffix", "contains", "ignore_case"); len(extra) > 0 {
		return SANMatcher{}, fmt.Errorf("SAN matcher %v not emulated", extra)
	}
	out := SANMatcher{Type: m.GetSanType().String(), IgnoreCase: sm.GetIgnoreCase()}
	switch p := sm.GetMatchPattern().(type) {
	case *matcherv3.StringMatcher_Exact:
		out.Op, out.Value = "exact", p.Exact
	case *matcherv3.StringMatcher_Prefix:
		out.Op, out.Value = "prefix", p.Prefix
	case *matcherv3.StringMatcher_Suffix:
		out.Op, out.Value = "suffix", p.Suffix
	case *matcherv3.StringMatcher_Contains:
		out.Op, out.Value = "contains", p.Contains
	}
	return out, nil
}

// fileOf is a data source's file name; inline data is not emulated.
func fileOf(what string, ds *corev3.DataSource) (string, error) {
	if extra := setFields(ds, "filename"); len(extra) > 0 {
		return "", fmt.Errorf("%s: only a filename data source is emulated, not %v", what, extra)
	}
	return ds.GetFilename(), nil
}

func tlsVersion(v tlsv3.TlsParameters_TlsProtocol) (uint16, error) {
	switch v {
	case tlsv3.TlsParameters_TLS_AUTO:
		return 0, nil
	case tlsv3.TlsParameters_TLSv1_2:
		return tls.VersionTLS12, nil
	case tlsv3.TlsParameters_TLSv1_3:
		return tls.VersionTLS13, nil
	}
	return 0, fmt.Errorf("TLS version %s is not emulated", v)
}

// setFields names the fields set in m other than handled ones (a nil message
// has none).
func setFields(m proto.Message, handled ...string) []string {
	var out []string
	if m == nil || !m.ProtoReflect().IsValid() {
		return nil
	}
	m.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
		if !slices.Contains(handled, string(fd.Name())) {
			out = append(out, string(fd.Name()))
		}
		return true
	})
	return out
}
