package deploy

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// clientSAN is the SAN of Envoy's client certificate in every shipped setup, the one
// pd-extproc's --tls-client-allowed-sans admits.
const clientSAN = "envoy.pd-extproc"

// `make certs` (hack/certs.sh, OpenSSL) writes certificates the shipped configs accept: a
// handshake between pd-extproc's and Envoy's succeeds with each side checking the other as the
// configs say (the server's SAN as Envoy's matcher names it, the client's CA), and the SANs are
// the ones the manifests and envoy.yaml name.
func TestMakeCertsWritesWhatTheConfigsAccept(t *testing.T) {
	if findTool("openssl") == "" {
		t.Skip("openssl not found; hack/certs.sh needs it")
	}
	dir := t.TempDir()
	if _, err := runTool(t, testbed.MustRepoRoot(t), "bash", "hack/certs.sh", dir); err != nil {
		t.Fatal(err)
	}
	server := loadPair(t, filepath.Join(dir, "extproc"))
	client := loadPair(t, filepath.Join(dir, "envoy"))
	if !slices.Contains(server.Leaf.DNSNames, extprocServerSAN) || !slices.Contains(server.Leaf.ExtKeyUsage, x509.ExtKeyUsageServerAuth) {
		t.Errorf("pd-extproc's certificate: SANs %v, usages %v; want %s for server authentication", server.Leaf.DNSNames, server.Leaf.ExtKeyUsage, extprocServerSAN)
	}
	if !slices.Contains(client.Leaf.DNSNames, clientSAN) || !slices.Contains(client.Leaf.ExtKeyUsage, x509.ExtKeyUsageClientAuth) {
		t.Errorf("Envoy's certificate: SANs %v, usages %v; want %s for client authentication", client.Leaf.DNSNames, client.Leaf.ExtKeyUsage, clientSAN)
	}
	for _, name := range []string{"extproc/tls.key", "envoy/tls.key"} {
		if fi, err := os.Stat(filepath.Join(dir, name)); err != nil || fi.Mode().Perm()&0o004 == 0 {
			t.Errorf("%s: %v; the compose containers run as their own users and must read it", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "ca.key")); err == nil {
		t.Error("the CA's key was left behind")
	}

	// The handshake, as pd-extproc serves it and as Envoy checks it (the CA, then the SAN).
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{server}, ClientAuth: tls.RequireAndVerifyClientCert,
		ClientCAs: pool(t, filepath.Join(dir, "extproc", "ca.crt")), MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			err = c.(*tls.Conn).Handshake()
			c.Close()
		}
		served <- err
	}()
	conn, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{
		Certificates: []tls.Certificate{client}, RootCAs: pool(t, filepath.Join(dir, "envoy", "ca.crt")),
		ServerName: extprocServerSAN, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS12,
	})
	if err != nil {
		t.Fatalf("Envoy's side of the handshake: %v", err)
	}
	conn.Close()
	if err := <-served; err != nil {
		t.Fatalf("pd-extproc's side of the handshake: %v", err)
	}
}

func loadPair(t *testing.T, dir string) tls.Certificate {
	t.Helper()
	c, err := tls.LoadX509KeyPair(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Leaf == nil {
		if c.Leaf, err = x509.ParseCertificate(c.Certificate[0]); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

func pool(t *testing.T, file string) *x509.CertPool {
	t.Helper()
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(mustRead(t, file)) {
		t.Fatalf("%s: no certificate", file)
	}
	return p
}
