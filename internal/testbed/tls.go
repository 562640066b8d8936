package testbed

import (
	"crypto/tls"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc/credentials"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testpki"
)

// The identities the shipped configs name: config/envoy/*.yaml accept the
// ext_proc server's certificate only with ServerSAN, and the manifests'
// --tls-client-allowed-sans admits the Envoy client certificate with
// ClientSAN.
const (
	ServerSAN = "pd-extproc.pd-extproc.svc"
	ClientSAN = "envoy.pd-extproc"
)

// MTLS is the certificates of the link between Envoy and extproc: a CA,
// extproc's server certificate and Envoy's client certificate, each in its
// own directory as a kubernetes.io/tls Secret is mounted. The CA of the
// server certificate is the one both sides trust (one CA signs both, as in
// the shipped cert-manager example); a test may swap Client for one of
// another CA.
type MTLS struct {
	CA             *testpki.CA
	Server, Client testpki.Files
	serverName     string   // the server certificate's first SAN
	allowed        []string // the client SANs extproc admits
	dir            string   // where Envoy's Secret volumes are written
}

// MTLSConfig names the SANs of each certificate, and those extproc admits
// (--tls-client-allowed-sans); empty: ServerSAN, ClientSAN and ClientSAN, the
// shipped names.
type MTLSConfig struct {
	ServerSANs, ClientSANs, AllowedSANs []string
}

// NewMTLS issues the certificates into a new temporary directory, removed
// when c cleans up.
func NewMTLS(c Cleaner, cfg MTLSConfig) (*MTLS, error) {
	if len(cfg.ServerSANs) == 0 {
		cfg.ServerSANs = []string{ServerSAN}
	}
	if len(cfg.ClientSANs) == 0 {
		cfg.ClientSANs = []string{ClientSAN}
	}
	if len(cfg.AllowedSANs) == 0 {
		cfg.AllowedSANs = []string{ClientSAN}
	}
	dir, err := os.MkdirTemp("", "pd-extproc-certs-")
	if err != nil {
		return nil, err
	}
	c.Cleanup(func() { os.RemoveAll(dir) })
	ca, err := testpki.NewCA("pd-extproc test CA")
	if err != nil {
		return nil, err
	}
	m := &MTLS{CA: ca, serverName: cfg.ServerSANs[0], allowed: cfg.AllowedSANs, dir: dir}
	if m.Server, err = ca.Issue(filepath.Join(dir, "extproc"), testpki.Leaf{Name: "pd-extproc", SANs: cfg.ServerSANs, Server: true}); err != nil {
		return nil, err
	}
	if m.Client, err = ca.Issue(filepath.Join(dir, "envoy"), testpki.Leaf{Name: "envoy", SANs: cfg.ClientSANs, Client: true}); err != nil {
		return nil, err
	}
	return m, nil
}

// ExtprocArgs are the flags that make extproc serve ext_proc over TLS with
// the server certificate and require a client certificate the CA signed for
// an allowed SAN, as the shipped manifests run it.
func (m *MTLS) ExtprocArgs() []string {
	return []string{"--tls-cert-file", m.Server.Cert, "--tls-key-file", m.Server.Key, "--tls-client-ca-file", m.Server.CA,
		"--tls-client-allowed-sans", strings.Join(m.allowed, ",")}
}

// Envoy mounts what the ext_proc cluster of cfg reads, as the compose file
// and the chart mount it: at /etc/envoy/certs a Secret volume (written as the
// kubelet writes one) with the client certificate and the CA of extproc's,
// at /etc/envoy/sds the shipped SDS files of config/envoy/sds. The
// bootstrap's SAN checks, SNI and versions stay. A config whose ext_proc
// cluster is plaintext is left so. A volume that cannot be written leaves
// the mount empty: Start then fails, naming the file it misses.
func (m *MTLS) Envoy(cfg *envoyemu.Config) {
	if cl := cfg.Clusters[cfg.ExtProcCluster]; cl == nil || cl.TLS == nil {
		return
	}
	sds, _ := RepoPath("config/envoy/sds")
	certs, _ := os.MkdirTemp(m.dir, "envoy-certs-")
	cfg.Mounts = map[string]string{"/etc/envoy/certs": certs, "/etc/envoy/sds": sds}
	files := map[string][]byte{}
	for name, path := range map[string]string{"tls.crt": m.Client.Cert, "tls.key": m.Client.Key, "ca.crt": m.Server.CA} {
		files[name], _ = os.ReadFile(path)
	}
	_ = (&testpki.Volume{Dir: certs}).Write(files)
}

// Plaintext drops the TLS of cfg's ext_proc cluster, for a server that
// speaks none (bench/echo). The shipped configs all use mTLS.
func Plaintext(cfg *envoyemu.Config) {
	if cl := cfg.Clusters[cfg.ExtProcCluster]; cl != nil {
		cl.TLS = nil
	}
}

// Credentials are what a gRPC client of extproc dials with in Envoy's place:
// the client certificate, and the server's checked against the CA for its
// name.
func (m *MTLS) Credentials() (credentials.TransportCredentials, error) {
	cert, err := tls.LoadX509KeyPair(m.Client.Cert, m.Client.Key)
	if err != nil {
		return nil, err
	}
	return credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: m.CA.Roots(), ServerName: m.serverName, MinVersion: tls.VersionTLS12}), nil
}
