// Package testpki makes certificates for tests: a CA, and certificates it
// signs for a server or a client with the SANs a test names, written as a
// Kubernetes TLS Secret mounts them (tls.crt, tls.key, ca.crt), the layout
// cert-manager produces and the shipped manifests read.
package testpki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"
)

// CA signs certificates.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	PEM  []byte // the CA certificate
}

var serial atomic.Int64

// NewCA makes a self-signed CA valid for a day.
func NewCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial.Add(1)), Subject: pkix.Name{CommonName: name},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{cert: cert, key: key, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// Leaf is what a certificate is issued for.
type Leaf struct {
	Name string   // the subject's common name
	SANs []string // DNS names, URIs (with a scheme: spiffe://...) and IP addresses
	// Server and Client set the extended key usages; neither: both.
	Server, Client bool
	// Serial is the certificate's serial number; 0: the next of a counter.
	Serial int64
}

// Roots is a pool of the CA alone, for a client checking a server.
func (ca *CA) Roots() *x509.CertPool {
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	return pool
}

// Files are the paths of a written certificate: tls.crt, tls.key and ca.crt
// in one directory, as a kubernetes.io/tls Secret is mounted.
type Files struct{ Dir, Cert, Key, CA string }

// Issue signs a certificate for leaf and writes it, its key and the CA's
// certificate into dir (created if need be).
func (ca *CA) Issue(dir string, leaf Leaf) (Files, error) {
	certPEM, keyPEM, err := ca.IssuePEM(leaf)
	if err != nil {
		return Files{}, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return Files{}, err
	}
	f := Files{Dir: dir, Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), CA: filepath.Join(dir, "ca.crt")}
	for path, data := range map[string][]byte{f.Cert: certPEM, f.Key: keyPEM, f.CA: ca.PEM} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return Files{}, fmt.Errorf("testpki: %w", err)
		}
	}
	return f, nil
}

// IssuePEM signs a certificate for leaf and returns it and its key in PEM.
func (ca *CA) IssuePEM(leaf Leaf) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	if leaf.Serial == 0 {
		leaf.Serial = serial.Add(1)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(leaf.Serial), Subject: pkix.Name{CommonName: leaf.Name},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature,
	}
	if leaf.Server || !leaf.Client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if leaf.Client || !leaf.Server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	for _, san := range leaf.SANs {
		if ip := net.ParseIP(san); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else if u, err := url.Parse(san); err == nil && u.Scheme != "" {
			tmpl.URIs = append(tmpl.URIs, u)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, san)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), nil
}

// Volume writes files into Dir as the kubelet updates a Secret or ConfigMap
// volume (its atomic writer): each version in a directory of its own, ..data
// a symlink to it swapped by a rename (a move into Dir), and each file a
// symlink through ..data. A reader sees the old set or the new one, never a
// mix, and a watcher of Dir sees ..data moved in.
type Volume struct {
	Dir      string
	versions int
}

// Write makes files (name to content) the volume's new version.
func (v *Volume) Write(files map[string][]byte) error {
	v.versions++
	version := fmt.Sprintf("..v%d", v.versions)
	if err := os.MkdirAll(filepath.Join(v.Dir, version), 0o700); err != nil {
		return err
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(v.Dir, version, name), data, 0o600); err != nil {
			return err
		}
	}
	tmp := filepath.Join(v.Dir, "..data_tmp")
	if err := os.Symlink(version, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(v.Dir, "..data")); err != nil {
		return err
	}
	for name := range files {
		link := filepath.Join(v.Dir, name)
		if _, err := os.Lstat(link); err == nil {
			continue
		}
		if err := os.Symlink(filepath.Join("..data", name), link); err != nil {
			return err
		}
	}
	return nil
}
