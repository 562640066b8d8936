package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// TestExtprocOverMTLSChecksTheClientSAN runs the binary as a Deployment would
// with cert-manager's Secret: TLS on the ext_proc port, client certificates
// from one CA, and only Envoy's identity (a SPIFFE id) let in. A real gRPC
// client over mTLS routes a request with Envoy's certificate; one the same CA
// signed for another workload, or none, is refused at the handshake, and the
// refusal is logged. (Here a gRPC client sends what Envoy sends, with each
// identity in turn; the rig's emulator over mTLS is test/e2e/mtls_test.go.)
func TestExtprocOverMTLSChecksTheClientSAN(t *testing.T) {
	const envoyID = "spiffe://cluster.local/ns/envoy-gateway-system/sa/envoy"
	ca := testbed.MustNewCA(t)
	cert, key, clientCA, err := ca.ServerFiles(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	x := startExtproc(t, testbed.ExtprocConfig{
		Config: `pools: {decode: {endpoints: ["10.1.1.1:8000"]}}`,
		Args: []string{"--tls-cert-file", cert, "--tls-key-file", key, "--tls-client-ca-file", clientCA,
			"--tls-client-allowed-sans", "envoy.envoy-gateway-system.svc," + envoyID},
	})
	tests := []struct {
		name string
		sans []string // nil: no client certificate
		ok   bool
	}{
		{"Envoy's SPIFFE id", []string{envoyID}, true},
		{"another workload's SPIFFE id", []string{"spiffe://cluster.local/ns/default/sa/default"}, false},
		{"another DNS name", []string{"attacker.default.svc"}, false},
		{"no client certificate", nil, false},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := &tls.Config{RootCAs: ca.Roots(), ServerName: "127.0.0.1"}
			if tt.sans != nil {
				cfg.Certificates = []tls.Certificate{ca.MustIssuePair(t, int64(200+i), x509.ExtKeyUsageClientAuth, tt.sans...)}
			}
			dest, err := routeOver(x.GRPCAddr, cfg)
			switch {
			case tt.ok && (err != nil || dest != "10.1.1.1:8000"):
				t.Fatalf("routed to %q, %v; want 10.1.1.1:8000", dest, err)
			case !tt.ok && err == nil:
				t.Fatalf("a client certificate with SANs %v was let in (routed to %q)", tt.sans, dest)
			}
		})
	}
	x.waitLog(t, "refused a client certificate")
	if logs := x.Logs(); !strings.Contains(logs, "spiffe://cluster.local/ns/default/sa/default") {
		t.Errorf("the refusal does not name the SANs presented:\n%s", logs)
	}
}

// routeOver runs one FULL_DUPLEX exchange over a gRPC connection with cfg and
// returns the destination of the routing reply.
func routeOver(addr string, cfg *tls.Config) (string, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return "", err
	}
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	for _, m := range []*extprocv3.ProcessingRequest{
		envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post("/v1/chat/completions", len(body))...),
			filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED),
		envoymsg.Body(envoymsg.Request, body, true),
	} {
		if err := s.Send(m); err != nil && !errors.Is(err, io.EOF) {
			return "", err
		}
	}
	reply, err := s.Recv()
	if err != nil {
		return "", err
	}
	for _, h := range reply.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
			return string(h.GetHeader().GetRawValue()), nil
		}
	}
	return "", errors.New("no destination in the first reply")
}
