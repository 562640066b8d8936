package envoyemu

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
)

// clientConfig reads the files and builds what the gRPC client dials with,
// verifying the server as Envoy's default certificate validator does
// (default_validator.cc): the chain against trusted_ca for the ssl_server
// purpose, then the SAN matchers, and no host name check. Without trusted_ca
// nothing is verified.
func (t *UpstreamTLS) clientConfig() (*tls.Config, error) {
	cfg := &tls.Config{
		MinVersion: orVersion(t.MinVersion), MaxVersion: orVersion(t.MaxVersion),
		ServerName: t.SNI, NextProtos: t.ALPN,
		// Verification is Envoy's, below, not Go's (which would also check
		// the host name).
		InsecureSkipVerify: true, //nolint:gosec // VerifyConnection verifies
	}
	if len(cfg.NextProtos) == 0 {
		cfg.NextProtos = []string{"h2"}
	}
	if t.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("client certificate %s, %s: %w", t.CertFile, t.KeyFile, err)
		}
		// BoringSSL sends the configured certificate whatever CAs the server
		// names; Go's default choice would send none for a foreign CA.
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }
	}
	if t.CAFile == "" {
		return cfg, nil
	}
	pem, err := os.ReadFile(t.CAFile)
	if err != nil {
		return nil, fmt.Errorf("Failed to load trusted CA certificates from %s: %w", t.CAFile, err) //nolint:staticcheck // Envoy's words
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("Failed to load trusted CA certificates from %s", t.CAFile) //nolint:staticcheck // Envoy's words
	}
	cfg.VerifyConnection = func(cs tls.ConnectionState) error { return t.verify(cs.PeerCertificates, roots) }
	return cfg, nil
}

func orVersion(v uint16) uint16 {
	if v == 0 {
		return tls.VersionTLS12
	}
	return v
}

func (t *UpstreamTLS) verify(chain []*x509.Certificate, roots *x509.CertPool) error {
	if len(chain) == 0 {
		return errors.New("verify cert failed: empty cert chain")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		return fmt.Errorf("verify cert failed: %w", err)
	}
	if len(t.SubjectAltNames) > 0 && !slices.ContainsFunc(t.SubjectAltNames, func(m SANMatcher) bool { return m.matches(chain[0]) }) {
		return fmt.Errorf("verify cert failed: SAN matcher, certificate SANs are %v", sans(chain[0]))
	}
	return nil
}

// matches reports whether any SAN of c of the matcher's type matches: for
// DNS with exact, as Envoy's dnsNameMatch (a wildcard SAN covers one label).
func (m SANMatcher) matches(c *x509.Certificate) bool {
	var names []string
	switch m.Type {
	case "DNS":
		names = c.DNSNames
	case "EMAIL":
		names = c.EmailAddresses
	case "URI":
		for _, u := range c.URIs {
			names = append(names, u.String())
		}
	case "IP_ADDRESS":
		for _, ip := range c.IPAddresses {
			names = append(names, ip.String())
		}
	}
	return slices.ContainsFunc(names, func(name string) bool {
		if m.Type == "DNS" && m.Op == "exact" {
			return dnsNameMatch(m.Value, name)
		}
		v := m.Value
		if m.IgnoreCase {
			name, v = strings.ToLower(name), strings.ToLower(v)
		}
		switch m.Op {
		case "exact":
			return name == v
		case "prefix":
			return strings.HasPrefix(name, v)
		case "suffix":
			return strings.HasSuffix(name, v)
		}
		return strings.Contains(name, v)
	})
}

// dnsNameMatch is Envoy's Utility::dnsNameMatch: case-insensitive, and a
// SAN "*.example.com" matches exactly one label in its place.
func dnsNameMatch(want, san string) bool {
	want, san = strings.ToLower(want), strings.ToLower(san)
	if want == san {
		return true
	}
	rest, ok := strings.CutPrefix(san, "*.")
	if !ok {
		return false
	}
	label, tail, ok := strings.Cut(want, ".")
	return ok && label != "" && tail == rest
}

func sans(c *x509.Certificate) []string {
	out := slices.Clone(c.DNSNames)
	for _, u := range c.URIs {
		out = append(out, u.String())
	}
	for _, ip := range c.IPAddresses {
		out = append(out, ip.String())
	}
	return append(out, c.EmailAddresses...)
}
