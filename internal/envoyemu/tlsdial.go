package envoyemu

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/fsnotify/fsnotify"
)

// material is what a handshake uses: the client certificate and the CAs the
// server is checked against, swapped whole when the files rotate.
type material struct {
	cert  *tls.Certificate // nil: none is sent
	roots *x509.CertPool   // nil: no CA configured
}

// load reads the files (through open, which maps the bootstrap's paths to the
// host), the SDS files first, and says where Envoy watches them for moves.
func (t *UpstreamTLS) load(open func(string) string) (*material, []watch, error) {
	certFile, keyFile, caFile := t.CertFile, t.KeyFile, t.CAFile
	var watches []watch
	for _, sds := range []*SDSSecret{t.CertSDS, t.CASDS} {
		if sds == nil {
			continue
		}
		f, err := sds.read(open)
		if err != nil {
			return nil, nil, err
		}
		if sds == t.CertSDS {
			certFile, keyFile = f.cert, f.key
		} else {
			caFile = f.ca
		}
		watches = append(watches, f.watch...)
	}
	m := &material{}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(open(certFile), open(keyFile))
		if err != nil {
			return nil, nil, fmt.Errorf("client certificate %s, %s: %w", certFile, keyFile, err)
		}
		m.cert = &cert
	}
	if caFile != "" {
		pem, err := os.ReadFile(open(caFile))
		if err != nil {
			return nil, nil, fmt.Errorf("Failed to load trusted CA certificates from %s: %w", caFile, err) //nolint:staticcheck // Envoy's words
		}
		m.roots = x509.NewCertPool()
		if !m.roots.AppendCertsFromPEM(pem) {
			return nil, nil, fmt.Errorf("Failed to load trusted CA certificates from %s", caFile) //nolint:staticcheck // Envoy's words
		}
	}
	return m, watches, nil
}

// clientConfig reads the files and builds what the gRPC client dials with,
// verifying the server as Envoy's default certificate validator does
// (default_validator.cc): the chain against trusted_ca for the ssl_server
// purpose, then the SAN matchers, and no host name check. Without trusted_ca
// nothing is verified. Each handshake uses the material current then: with
// SDS, follow swaps it when the files rotate.
func (t *UpstreamTLS) clientConfig(open func(string) string) (*tls.Config, *secrets, error) {
	m, watches, err := t.load(open)
	if err != nil {
		return nil, nil, err
	}
	s := &secrets{t: t, open: open, watches: watches}
	s.cur.Store(m)
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
	if m.cert != nil {
		// BoringSSL sends the configured certificate whatever CAs the server
		// names; Go's default choice would send none for a foreign CA.
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return s.cur.Load().cert, nil }
	}
	if m.roots != nil {
		cfg.VerifyConnection = func(cs tls.ConnectionState) error { return t.verify(cs.PeerCertificates, s.cur.Load().roots) }
	}
	return cfg, s, nil
}

// secrets is a cluster's TLS material as the handshakes read it.
type secrets struct {
	t       *UpstreamTLS
	open    func(string) string
	watches []watch
	cur     atomic.Pointer[material]
}

// follow reloads the material whenever a file is moved into a watched
// directory (a Kubernetes volume swaps its ..data link so), until ctx ends.
// Files named without SDS are never read again, as in Envoy. A reload that
// fails keeps the material in use, as Envoy keeps the last good secret.
func (s *secrets) follow(ctx context.Context, logf func(string, ...any)) error {
	if s.t.CertSDS == nil && s.t.CASDS == nil {
		return nil
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	for _, wt := range s.watches {
		if err := w.Add(s.open(wt.dir)); err != nil {
			w.Close()
			return fmt.Errorf("watched_directory %s: %w", wt.dir, err)
		}
	}
	go func() {
		defer w.Close()
		for {
			select {
			case <-ctx.Done():
				return
			case ev := <-w.Events:
				if !ev.Has(fsnotify.Create) || !s.watched(ev.Name) {
					continue
				}
				m, _, err := s.t.load(s.open)
				if err != nil {
					logf("TLS secrets not reloaded after %s, the previous ones stay: %v", ev.Name, err)
					continue
				}
				s.cur.Store(m)
				logf("TLS secrets reloaded after %s", ev.Name)
			case <-w.Errors:
			}
		}
	}()
	return nil
}

// watched reports whether a file moved in at path is one a watch counts.
func (s *secrets) watched(path string) bool {
	for _, wt := range s.watches {
		if filepath.Clean(s.open(wt.dir)) == filepath.Dir(path) && (wt.names == nil || slices.Contains(wt.names, filepath.Base(path))) {
			return true
		}
	}
	return false
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
