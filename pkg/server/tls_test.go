package server

import (
	"context"
	"crypto/tls"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/pd-extproc/pd-extproc/internal/testpki"
	"github.com/pd-extproc/pd-extproc/pkg/config"
)

func newCA(t *testing.T) *testpki.CA {
	t.Helper()
	ca, err := testpki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// issue signs a certificate for 127.0.0.1, or for the SANs given, and
// returns it and its key in PEM.
func issue(t *testing.T, ca *testpki.CA, leaf testpki.Leaf) (certPEM, keyPEM []byte) {
	t.Helper()
	if leaf.SANs == nil {
		leaf.SANs = []string{"127.0.0.1"}
	}
	certPEM, keyPEM, err := ca.IssuePEM(leaf)
	if err != nil {
		t.Fatal(err)
	}
	return certPEM, keyPEM
}

// clientPair is a client certificate for the SANs, for a client to present.
func clientPair(t *testing.T, ca *testpki.CA, serial int64, sans ...string) tls.Certificate {
	t.Helper()
	pair, err := tls.X509KeyPair(issue(t, ca, testpki.Leaf{SANs: sans, Serial: serial, Client: true}))
	if err != nil {
		t.Fatal(err)
	}
	return pair
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	// Written then renamed, as a Secret volume or cert-manager does.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestGRPCListenerServesMTLSAndReloadsRotatedCertificates(t *testing.T) {
	ca := newCA(t)
	dir := t.TempDir()
	files := TLSFiles{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), ClientCA: filepath.Join(dir, "ca.crt")}
	certPEM, keyPEM := issue(t, ca, testpki.Leaf{Serial: 100, Server: true})
	writeFile(t, files.Cert, certPEM)
	writeFile(t, files.Key, keyPEM)
	writeFile(t, files.ClientCA, ca.PEM)

	cfg, err := config.Parse([]byte(`{connector: kv-nixl, pools: {decode: {endpoints: ["` + decodeEP + `"]}}}`))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(cfg, Options{TLS: files}, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	grpcLis, _ := net.Listen("tcp", "127.0.0.1:0")
	adminLis, _ := net.Listen("tcp", "127.0.0.1:0")
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- s.Serve(ctx, grpcLis, adminLis) }()
	t.Cleanup(func() { stop(); <-served })

	roots := ca.Roots()
	pair := clientPair(t, ca, 200, "127.0.0.1")
	// check dials with cfg, runs a health check, and returns the serial of the
	// server certificate it saw.
	check := func(cfg *tls.Config) (int64, error) {
		var serial int64
		cfg.VerifyConnection = func(cs tls.ConnectionState) error {
			serial = cs.PeerCertificates[0].SerialNumber.Int64()
			return nil
		}
		conn, err := grpc.NewClient(grpcLis.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
		if err != nil {
			return 0, err
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		return serial, err
	}

	tests := []struct {
		name       string
		rotate     bool // issue a new server certificate (serial 101) first
		clientCert bool
		wantErr    bool
		wantSerial int64
	}{
		{name: "client certificate accepted", clientCert: true, wantSerial: 100},
		{name: "no client certificate refused", clientCert: false, wantErr: true},
		{name: "rotated server certificate served without restart", rotate: true, clientCert: true, wantSerial: 101},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.rotate {
				certPEM, keyPEM := issue(t, ca, testpki.Leaf{Serial: 101, Server: true})
				writeFile(t, files.Key, keyPEM)
				writeFile(t, files.Cert, certPEM)
			}
			cfg := &tls.Config{RootCAs: roots, ServerName: "127.0.0.1"}
			if tt.clientCert {
				cfg.Certificates = []tls.Certificate{pair}
			}
			serial, err := check(cfg)
			if (err != nil) != tt.wantErr {
				t.Fatalf("health check error = %v, want error %v", err, tt.wantErr)
			}
			if !tt.wantErr && serial != tt.wantSerial {
				t.Errorf("server certificate serial %d, want %d", serial, tt.wantSerial)
			}
		})
	}
}

func TestTLSFlagsMustGoTogether(t *testing.T) {
	tests := []struct {
		files   TLSFiles
		wantErr bool
	}{
		{TLSFiles{}, false},
		{TLSFiles{Cert: "c", Key: "k"}, false},
		{TLSFiles{Cert: "c", Key: "k", ClientCA: "ca"}, false},
		{TLSFiles{Cert: "c"}, true},
		{TLSFiles{ClientCA: "ca"}, true},
		{TLSFiles{Cert: "c", Key: "k", ClientCA: "ca", AllowedSANs: []string{"gw.svc", "spiffe://td/ns/gw/sa/envoy"}}, false},
		{TLSFiles{Cert: "c", Key: "k", AllowedSANs: []string{"gw.svc"}}, true}, // no client CA: no client certificate to check
		{TLSFiles{Cert: "c", Key: "k", ClientCA: "ca", AllowedSANs: []string{"*.gw.svc"}}, true},
		{TLSFiles{Cert: "c", Key: "k", ClientCA: "ca", AllowedSANs: []string{"spiffe://td/ns/*"}}, true},
	}
	for _, tt := range tests {
		if err := tt.files.Validate(); (err != nil) != tt.wantErr {
			t.Errorf("%+v: Validate() = %v, want error %v", tt.files, err, tt.wantErr)
		}
	}
}

// With --tls-client-allowed-sans, a client certificate the CA signed is
// accepted only when one of its DNS or URI SANs is on the list, exactly (DNS
// names in any case); a real gRPC client over mTLS is refused otherwise, and
// the refusal is logged with the SANs it presented.
func TestClientCertificateSANsAreChecked(t *testing.T) {
	const (
		gateway = "envoy.gateway.svc.cluster.local"
		spiffe  = "spiffe://cluster.local/ns/envoy-gateway-system/sa/envoy"
	)
	ca, other := newCA(t), newCA(t)
	f, err := ca.Issue(t.TempDir(), testpki.Leaf{SANs: []string{"127.0.0.1"}, Server: true})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var refusals strings.Builder
	log := funcr.New(func(_, args string) {
		mu.Lock()
		defer mu.Unlock()
		if strings.Contains(args, "refused a client certificate") {
			refusals.WriteString(args + "\n")
		}
	}, funcr.Options{})
	r := start(t, `{connector: kv-nixl, pools: {decode: {endpoints: ["`+decodeEP+`"]}}}`,
		Options{TLS: TLSFiles{Cert: f.Cert, Key: f.Key, ClientCA: f.CA, AllowedSANs: []string{gateway, spiffe, "SPIFFE://cluster.local/ns/debug/sa/envoy"}}}, log)
	tests := []struct {
		name   string
		signer *testpki.CA // nil: no client certificate
		sans   []string
		ok     bool
	}{
		{"the allowed DNS name", ca, []string{gateway}, true},
		{"the allowed DNS name in capitals", ca, []string{strings.ToUpper(gateway)}, true},
		{"the allowed SPIFFE id among others", ca, []string{"other.svc", spiffe}, true},
		{"a SPIFFE id the flag spells with its scheme in capitals", ca, []string{"spiffe://cluster.local/ns/debug/sa/envoy"}, true},
		{"another DNS name", ca, []string{"attacker.svc.cluster.local"}, false},
		{"another SPIFFE id", ca, []string{"spiffe://cluster.local/ns/default/sa/default"}, false},
		{"a SPIFFE id that only starts like the allowed one", ca, []string{spiffe + "-debug"}, false},
		{"a wildcard that would cover the allowed name", ca, []string{"*.gateway.svc.cluster.local"}, false},
		{"an IP address only", ca, []string{"127.0.0.1"}, false},
		{"the allowed name, signed by another CA", other, []string{gateway}, false},
		{"no client certificate", nil, nil, false},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := &tls.Config{RootCAs: ca.Roots(), ServerName: "127.0.0.1"}
			if tt.signer != nil {
				cfg.Certificates = []tls.Certificate{clientPair(t, tt.signer, int64(300+i), tt.sans...)}
			}
			err := checkHealth(r.grpcAddr, cfg)
			if (err == nil) != tt.ok {
				t.Fatalf("health check over mTLS: %v; want accepted %v", err, tt.ok)
			}
		})
	}
	mu.Lock()
	defer mu.Unlock()
	if got := refusals.String(); !strings.Contains(got, "attacker.svc.cluster.local") || !strings.Contains(got, "spiffe://cluster.local/ns/default/sa/default") {
		t.Errorf("the refusals were not logged with the SANs presented:\n%s", got)
	}
}

// checkHealth dials addr with cfg and runs a gRPC health check.
func checkHealth(addr string, cfg *tls.Config) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

// TestAllowedSANsRefuseAnEmptyEntry: an empty --tls-client-allowed-sans (a
// chart value left empty) or an empty entry in it is refused: it read as no
// list, which accepts every certificate the client CA signed.
func TestAllowedSANsRefuseAnEmptyEntry(t *testing.T) {
	tests := []struct {
		flag    string
		want    []string
		wantErr bool
	}{
		{"gw.svc", []string{"gw.svc"}, false},
		{" gw.svc , spiffe://td/ns/gw/sa/envoy", []string{"gw.svc", "spiffe://td/ns/gw/sa/envoy"}, false},
		{"", nil, true},
		{" ", nil, true},
		{",", nil, true},
		{"gw.svc,", nil, true},
	}
	for _, tt := range tests {
		got, err := ParseSANs(tt.flag)
		if (err != nil) != tt.wantErr || !slices.Equal(got, tt.want) {
			t.Errorf("ParseSANs(%q) = %q, %v; want %q, error %v", tt.flag, got, err, tt.want, tt.wantErr)
		}
	}
}
