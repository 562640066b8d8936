package testbed

import (
	"crypto/tls"
	"crypto/x509"

	"github.com/pd-extproc/pd-extproc/internal/testpki"
)

// CA issues certificates for TLS tests: the listener's, and clients' with
// the identities (SANs) a test needs. It is a testpki.CA with the calls the
// server's and the e2e TLS tests make.
type CA struct{ *testpki.CA }

// NewCA makes a CA.
func NewCA() (*CA, error) {
	ca, err := testpki.NewCA("test CA")
	if err != nil {
		return nil, err
	}
	return &CA{ca}, nil
}

// Issue returns a PEM certificate and key signed by the CA, with this serial
// number, for one usage, with the given SANs: an IP address, a URI
// (scheme://…, as SPIFFE ids are), or else a DNS name.
func (ca *CA) Issue(serial int64, usage x509.ExtKeyUsage, sans ...string) (certPEM, keyPEM []byte, err error) {
	return ca.IssuePEM(testpki.Leaf{Name: "pd-extproc test", SANs: sans, Serial: serial,
		Server: usage == x509.ExtKeyUsageServerAuth, Client: usage == x509.ExtKeyUsageClientAuth})
}

// IssuePair is Issue as a tls.Certificate, for a client to present.
func (ca *CA) IssuePair(serial int64, usage x509.ExtKeyUsage, sans ...string) (tls.Certificate, error) {
	certPEM, keyPEM, err := ca.Issue(serial, usage, sans...)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.X509KeyPair(certPEM, keyPEM)
}

// ServerFiles writes a server certificate for 127.0.0.1, its key and the CA
// into dir, as tls.crt, tls.key and ca.crt (the names of a Kubernetes TLS
// Secret), and returns their paths.
func (ca *CA) ServerFiles(dir string) (cert, key, clientCA string, err error) {
	f, err := ca.CA.Issue(dir, testpki.Leaf{Name: "pd-extproc test", SANs: []string{"127.0.0.1"}, Serial: 100, Server: true})
	return f.Cert, f.Key, f.CA, err
}
