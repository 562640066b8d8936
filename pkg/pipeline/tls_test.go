package pipeline_test

import (
	"context"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/server/assemble"

	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

func TestPrefillLegOverTLSWithACAFile(t *testing.T) {
	engine := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, `{"kv_transfer_params":{"remote_host":"10.0.0.9"}}`)
	}))
	defer engine.Close()
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: engine.Certificate().Raw}), 0o600)
	addr := strings.TrimPrefix(engine.URL, "https://")

	tests := []struct {
		name       string
		tls        string
		wantStatus int // 0: routed with the engine's params
	}{
		{"engine's CA trusted", fmt.Sprintf("{enabled: true, ca_file: %q}", caFile), 0},
		{"engine's certificate not trusted", "{enabled: true}", 503},
		{"plain HTTP to a TLS engine: its 400 is passed on", "{enabled: false}", 400},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newNIXL(t, addr, fmt.Sprintf("{on_failure: fail, attempts: 1, tls: %s}", tt.tls))
			d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: "r1", Body: []byte(`{"model":"m","prompt":"hi"}`)})
			if tt.wantStatus != 0 {
				if e, ok := err.(*pipeline.Error); !ok || e.Status != tt.wantStatus {
					t.Fatalf("Route error = %v, want status %d", err, tt.wantStatus)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer d.Release()
			if !strings.Contains(string(d.Body.Bytes()), `"remote_host":"10.0.0.9"`) {
				t.Errorf("decode body lacks the params of the TLS prefill: %s", d.Body.Bytes())
			}
		})
	}
}

// The prefill pool's health checks follow prefill.tls, the decode pool's
// pools.decode.tls: each engine below serves only HTTPS with a certificate of
// the CA the keys name, so a check reaches its handler only over TLS trusted
// that way.
func TestPoolsAreCheckedOverTheirTLS(t *testing.T) {
	checked := map[string]chan struct{}{"prefill": make(chan struct{}, 1), "decode": make(chan struct{}, 1)}
	engine := func(role string) *httptest.Server {
		srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case checked[role] <- struct{}{}:
			default: // checks go on every 20ms: one is enough
			}
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	prefill, decode := engine("prefill"), engine("decode")
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: prefill.Certificate().Raw}), 0o600)
	checks := "health: {check_interval: 20ms}"
	cfg, err := config.Parse([]byte(fmt.Sprintf(`connector: kv-nixl
pools:
  prefill: {endpoints: [%q], %s}
  decode: {endpoints: [%q], %s, tls: {enabled: true, ca_file: %q}}
prefill: {tls: {enabled: true, ca_file: %q}}`,
		strings.TrimPrefix(prefill.URL, "https://"), checks, strings.TrimPrefix(decode.URL, "https://"), checks, caFile, caFile)))
	if err != nil {
		t.Fatal(err)
	}
	p, err := assemble.Pipeline(cfg, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { p.Run(ctx); close(ran) }()
	defer func() { cancel(); <-ran }()
	for role, ch := range checked {
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Errorf("the %s engine's /health was never reached over HTTPS", role)
		}
	}
}
