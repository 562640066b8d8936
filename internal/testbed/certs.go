package testbed

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// CA issues certificates for TLS tests: the listener's, and clients' with
// the identities (SANs) a test needs.
type CA struct {
	Cert *x509.Certificate
	PEM  []byte // the CA certificate, as a client CA file holds it
	key  *ecdsa.PrivateKey
}

// NewCA makes a CA valid for an hour either side of now.
func NewCA() (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, key: key, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// Issue returns a PEM certificate and key signed by the CA, for usage, with
// the given SANs: an IP address, a URI (scheme://…, as SPIFFE ids are), or
// else a DNS name.
func (ca *CA) Issue(serial int64, usage x509.ExtKeyUsage, sans ...string) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "pd-extproc test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{usage}, KeyUsage: x509.KeyUsageDigitalSignature}
	for _, san := range sans {
		switch ip := net.ParseIP(san); {
		case ip != nil:
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		case strings.Contains(san, "://"):
			u, err := url.Parse(san)
			if err != nil {
				return nil, nil, fmt.Errorf("SAN %q: %w", san, err)
			}
			tmpl.URIs = append(tmpl.URIs, u)
		default:
			tmpl.DNSNames = append(tmpl.DNSNames, san)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), nil
}

// IssuePair is Issue as a tls.Certificate, for a client to present.
func (ca *CA) IssuePair(serial int64, usage x509.ExtKeyUsage, sans ...string) (tls.Certificate, error) {
	certPEM, keyPEM, err := ca.Issue(serial, usage, sans...)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.X509KeyPair(certPEM, keyPEM)
}

// Roots is a pool of the CA alone, for a client checking the server.
func (ca *CA) Roots() *x509.CertPool {
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	return pool
}

// ServerFiles writes a server certificate for 127.0.0.1, its key and the CA
// into dir, as tls.crt, tls.key and ca.crt (the names of a Kubernetes TLS
// Secret), and returns their paths.
func (ca *CA) ServerFiles(dir string) (cert, key, clientCA string, err error) {
	certPEM, keyPEM, err := ca.Issue(100, x509.ExtKeyUsageServerAuth, "127.0.0.1")
	if err != nil {
		return "", "", "", err
	}
	cert, key, clientCA = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.crt")
	for path, b := range map[string][]byte{cert: certPEM, key: keyPEM, clientCA: ca.PEM} {
		if err := os.WriteFile(path, b, 0o600); err != nil {
			return "", "", "", err
		}
	}
	return cert, key, clientCA, nil
}
