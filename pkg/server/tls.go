package server

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/go-logr/logr"
	"github.com/pd-extproc/pd-extproc/pkg/secretfiles"
	"google.golang.org/grpc/credentials"
)

// TLSFiles names the gRPC listener's certificate files, and the clients it
// accepts. Without Cert the listener is plaintext (Envoy next to us on a
// private network or localhost). With ClientCA, clients must present a
// certificate it signed (mTLS, as Envoy Gateway's BackendTLSPolicy sets up);
// with AllowedSANs too, one whose SANs name an allowed identity.
type TLSFiles struct {
	Cert, Key, ClientCA string
	// AllowedSANs are the client identities accepted: DNS names, compared
	// without regard to case, and URIs (SPIFFE ids, spiffe://trust-domain/…),
	// compared exactly but for the scheme's case (url.Parse lowers it). A certificate passes when any of its DNS or URI
	// SANs is on the list. No wildcards, on either side: a CA that signs for
	// other workloads must not let them in by a pattern.
	AllowedSANs []string
}

// Validate checks the combination of files given.
func (f TLSFiles) Validate() error {
	switch {
	case (f.Cert == "") != (f.Key == ""):
		return errors.New("--tls-cert-file and --tls-key-file go together")
	case f.ClientCA != "" && f.Cert == "":
		return errors.New("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
	case len(f.AllowedSANs) > 0 && f.ClientCA == "":
		return errors.New("--tls-client-allowed-sans needs --tls-client-ca-file: without a client CA no client certificate is asked for")
	}
	for _, san := range f.AllowedSANs {
		if strings.Contains(san, "*") {
			return fmt.Errorf("--tls-client-allowed-sans: %q: wildcards are not supported; list each identity", san)
		}
		if strings.Contains(san, "://") {
			if _, err := url.Parse(san); err != nil {
				return fmt.Errorf("--tls-client-allowed-sans: %q: %w", san, err)
			}
		}
	}
	return nil
}

// ParseSANs reads the comma-separated value of --tls-client-allowed-sans.
// An empty entry, or an empty value, is an error: given as a flag (a chart
// value left empty), it would otherwise turn the check off, and every
// certificate the client CA signed would be accepted.
func ParseSANs(flag string) ([]string, error) {
	var sans []string
	for s := range strings.SplitSeq(flag, ",") {
		if s = strings.TrimSpace(s); s == "" {
			return nil, fmt.Errorf("an empty entry in %q: list the client identities to accept, or leave the flag out to accept any certificate the client CA signed", flag)
		}
		sans = append(sans, s)
	}
	return sans, nil
}

// allowedClient returns the check of a verified client certificate's SANs
// against f.AllowedSANs; nil when any certificate the CA signed is accepted.
func (f TLSFiles) allowedClient(log logr.Logger) func(tls.ConnectionState) error {
	if len(f.AllowedSANs) == 0 {
		return nil
	}
	dns, uris := map[string]bool{}, map[string]bool{}
	for _, san := range f.AllowedSANs {
		if strings.Contains(san, "://") {
			if u, err := url.Parse(san); err == nil {
				uris[u.String()] = true // as a certificate's URI reads: the scheme in lower case
			}
		} else {
			dns[strings.ToLower(san)] = true
		}
	}
	return func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("no client certificate") // RequireAndVerifyClientCert refuses first
		}
		leaf := cs.PeerCertificates[0]
		for _, name := range leaf.DNSNames {
			if dns[strings.ToLower(name)] {
				return nil
			}
		}
		for _, u := range leaf.URIs {
			if uris[u.String()] {
				return nil
			}
		}
		presented := make([]string, len(leaf.URIs))
		for i, u := range leaf.URIs {
			presented[i] = u.String()
		}
		log.Info("refused a client certificate: none of its SANs is in --tls-client-allowed-sans",
			"dnsNames", leaf.DNSNames, "uris", presented, "subject", leaf.Subject.String())
		return errors.New("the client certificate names no allowed identity")
	}
}

// credentials returns the listener's transport credentials, or nil for
// plaintext. The files are read again whenever they change on disk, so that a
// rotated certificate (cert-manager, a Kubernetes Secret) is served from the
// next handshake on, without a restart.
func (f TLSFiles) credentials(log logr.Logger) (credentials.TransportCredentials, error) {
	if f.Cert == "" {
		return nil, nil
	}
	files := secretfiles.New(func() (*tls.Config, error) { return f.config(log) }, f.Cert, f.Key, f.ClientCA)
	current := func() (*tls.Config, error) {
		cfg, fresh, err := files.Current()
		switch {
		case cfg == nil:
			return nil, err
		case err != nil: // a half-written rotation: keep serving the previous certificate
			log.Error(err, "reloading TLS files failed; serving the previous certificate")
		case fresh:
			log.Info("TLS certificate loaded", "cert", f.Cert, "clientCA", f.ClientCA, "allowedSANs", f.AllowedSANs)
		}
		return cfg, nil
	}
	if _, err := current(); err != nil {
		return nil, err
	}
	return credentials.NewTLS(&tls.Config{
		MinVersion:         tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return current() },
	}), nil
}

// config is the listener's TLS as the files are now.
func (f TLSFiles) config(log logr.Logger) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate: %w", err)
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}}
	if f.ClientCA != "" {
		pool, err := secretfiles.CAPool(f.ClientCA)
		if err != nil {
			return nil, fmt.Errorf("CA file: %w", err)
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
		// Runs after the chain is verified against ClientCAs.
		cfg.VerifyConnection = f.allowedClient(log)
	}
	return cfg, nil
}
