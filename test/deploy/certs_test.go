package deploy

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// `make certs` (hack/certs.sh, OpenSSL) writes certificates the shipped configs accept: a
// handshake between pd-extproc's and Envoy's succeeds with each side checking the other as the
// configs say (the server's SAN as Envoy's matcher names it, the client's CA), and the SANs are
// the ones the manifests and envoy.yaml name.
func TestMakeCertsWritesWhatTheConfigsAccept(t *testing.T) {
	if testbed.FindTool("openssl") == "" {
		t.Skip("openssl not found; hack/certs.sh needs it")
	}
	dir := t.TempDir()
	if _, err := runTool(t, testbed.MustRepoRoot(t), "bash", "hack/certs.sh", dir); err != nil {
		t.Fatal(err)
	}
	server := loadPair(t, filepath.Join(dir, "extproc"))
	client := loadPair(t, filepath.Join(dir, "envoy"))
	if !slices.Contains(server.Leaf.DNSNames, testbed.ServerSAN) || !slices.Contains(server.Leaf.ExtKeyUsage, x509.ExtKeyUsageServerAuth) {
		t.Errorf("pd-extproc's certificate: SANs %v, usages %v; want %s for server authentication", server.Leaf.DNSNames, server.Leaf.ExtKeyUsage, testbed.ServerSAN)
	}
	if !slices.Contains(client.Leaf.DNSNames, testbed.ClientSAN) || !slices.Contains(client.Leaf.ExtKeyUsage, x509.ExtKeyUsageClientAuth) {
		t.Errorf("Envoy's certificate: SANs %v, usages %v; want %s for client authentication", client.Leaf.DNSNames, client.Leaf.ExtKeyUsage, testbed.ClientSAN)
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
		ServerName: testbed.ServerSAN, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS12,
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
	return c // with its Leaf parsed, since Go 1.23
}

func pool(t *testing.T, file string) *x509.CertPool {
	t.Helper()
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(mustRead(t, file)) {
		t.Fatalf("%s: no certificate", file)
	}
	return p
}

// The chart's cert-manager objects issue the Secrets its pods read, for the names they check:
// pd-extproc's certificate for the SAN Envoy's matcher and the BackendTLSPolicy name, Envoy's
// for the SAN --tls-client-allowed-sans admits, both from one CA (whose ca.crt each side trusts).
// cert-manager renews that CA on its own and reissues nothing it signed (cert-manager#2478): the
// CA keeps its key, so that what it signed before still verifies against it.
func TestCertManagerExampleIssuesWhatTheManifestsRead(t *testing.T) {
	k8s := chartManifests(t, "defaults")
	gw := chartManifests(t, "envoy-gateway")
	server := find(t, k8s, "Certificate", tlsSecret)
	client := find(t, k8s, "Certificate", "pd-extproc-client-tls")
	envoyPod := dig(find(t, k8s, "Deployment", "pd-extproc-envoy"), "spec", "template")
	var envoySecret string
	for _, v := range dig(envoyPod, "spec", "volumes").([]any) {
		if s := digString(v, "secret", "secretName"); s != "" {
			envoySecret = s
		}
	}
	btp := find(t, gw, "BackendTLSPolicy", "pd-extproc")
	checks := []struct {
		what      string
		got, want any
	}{
		{"pd-extproc's Secret", digString(server, "spec", "secretName"), tlsSecret},
		{"pd-extproc's SANs include Envoy's check", slices.Contains(toStrings(dig(server, "spec", "dnsNames")), testbed.ServerSAN), true},
		{"pd-extproc's usages", fmt.Sprint(dig(server, "spec", "usages")), "[server auth digital signature]"},
		{"Envoy's Secret (Kubernetes Envoy)", digString(client, "spec", "secretName"), envoySecret},
		{"Envoy's Secret (the EnvoyProxy)", digString(client, "spec", "secretName"), digString(find(t, gw, "EnvoyProxy", "pd-gateway-proxy"), "spec", "backendTLS", "clientCertificateRef", "name")},
		// Named by the Gateway itself, whatever its class: a class the chart did not make
		// (gateway.createClass false) names no EnvoyProxy of this release.
		{"the EnvoyProxy the Gateway names", digString(find(t, gw, "Gateway", "pd-gateway"), "spec", "infrastructure", "parametersRef", "name"), "pd-gateway-proxy"},
		{"the class names none", dig(find(t, gw, "GatewayClass", "pd-extproc"), "spec", "parametersRef"), nil},
		{"the CA the BackendTLSPolicy trusts", digString(client, "spec", "secretName"), digString(dig(btp, "spec", "validation", "caCertificateRefs").([]any)[0], "name")},
		{"the BackendTLSPolicy's hostname", digString(btp, "spec", "validation", "hostname"), testbed.ServerSAN},
		{"Envoy's SANs", fmt.Sprint(dig(client, "spec", "dnsNames")), "[" + testbed.ClientSAN + "]"},
		{"Envoy's usages", fmt.Sprint(dig(client, "spec", "usages")), "[client auth digital signature]"},
		{"one CA issues both", digString(server, "spec", "issuerRef", "name") == digString(client, "spec", "issuerRef", "name"), true},
		{"the CA issuer signs with the CA certificate", digString(find(t, k8s, "Issuer", digString(client, "spec", "issuerRef", "name")), "spec", "ca", "secretName"),
			digString(find(t, k8s, "Certificate", "pd-extproc-ca"), "spec", "secretName")},
		{"the CA certificate is a CA", dig(find(t, k8s, "Certificate", "pd-extproc-ca"), "spec", "isCA"), true},
		// cert-manager 1.18 and later make a new key at each renewal unless told otherwise.
		{"the CA keeps its key when renewed", digString(find(t, k8s, "Certificate", "pd-extproc-ca"), "spec", "privateKey", "rotationPolicy"), "Never"},
	}
	for _, c := range checks {
		if !reflect.DeepEqual(c.got, c.want) {
			t.Errorf("%s: %v, want %v", c.what, c.got, c.want)
		}
	}
}
