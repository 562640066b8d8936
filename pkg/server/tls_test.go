package server

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// testCA issues certificates for the TLS tests.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns a PEM certificate and key for 127.0.0.1 with the given serial.
func (ca *testCA) issue(t *testing.T, serial int64, usage x509.ExtKeyUsage) (certPEM, keyPEM []byte) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "pd-extproc"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		KeyUsage: x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
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
	ca := newTestCA(t)
	dir := t.TempDir()
	files := TLSFiles{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), ClientCA: filepath.Join(dir, "ca.crt")}
	certPEM, keyPEM := ca.issue(t, 100, x509.ExtKeyUsageServerAuth)
	writeFile(t, files.Cert, certPEM)
	writeFile(t, files.Key, keyPEM)
	writeFile(t, files.ClientCA, ca.pem)

	cfg, err := config.Parse([]byte(`pools: {decode: {endpoints: ["10.1.1.1:8000"]}}`))
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

	roots := x509.NewCertPool()
	roots.AddCert(ca.cert)
	clientCert, clientKey := ca.issue(t, 200, x509.ExtKeyUsageClientAuth)
	pair, err := tls.X509KeyPair(clientCert, clientKey)
	if err != nil {
		t.Fatal(err)
	}
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
				certPEM, keyPEM := ca.issue(t, 101, x509.ExtKeyUsageServerAuth)
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
	}
	for _, tt := range tests {
		if err := tt.files.Validate(); (err != nil) != tt.wantErr {
			t.Errorf("%+v: Validate() = %v, want error %v", tt.files, err, tt.wantErr)
		}
	}
}
