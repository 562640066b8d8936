package envoyemu

import (
	"net/http"
	"strings"
	"testing"
)

// With use_remote_address the connection manager appends the peer's address
// to x-forwarded-for; with preserve_external_request_id the client's
// x-request-id reaches the server and the engine as it came.
func TestUseRemoteAddressAppendsTheClientToXFF(t *testing.T) {
	tests := []struct {
		name    string
		headers ClientHeaders
		xff     string // the client's
		want    string // what the engine gets
	}{
		{"off: the client's header as it came", ClientHeaders{}, "10.9.9.9", "10.9.9.9"},
		{"on: the peer appended", ClientHeaders{UseRemoteAddress: true, PreserveExternalRequestID: true}, "10.9.9.9", "10.9.9.9,127.0.0.1"},
		{"on, no client header: the peer alone", ClientHeaders{UseRemoteAddress: true, PreserveExternalRequestID: true}, "", "127.0.0.1"},
		{"on with skip_xff_append", ClientHeaders{UseRemoteAddress: true, PreserveExternalRequestID: true, SkipXFFAppend: true}, "10.9.9.9", "10.9.9.9"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := startUpstream(t)
			cfg := loadShipped(t, "envoy.yaml")
			cfg.ClientHeaders = tc.headers
			p := startProxy(t, cfg, fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil, nil))
			hdr := map[string]string{"x-request-id": "client-id-1"}
			if tc.xff != "" {
				hdr["x-forwarded-for"] = tc.xff
			}
			if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, hdr); res.status != http.StatusOK {
				t.Fatalf("status %d: %s", res.status, res.body)
			}
			got := up.requests()[0].Header
			if v := got.Get("X-Forwarded-For"); v != tc.want {
				t.Errorf("x-forwarded-for = %q, want %q", v, tc.want)
			}
			if v := got.Get("X-Request-Id"); v != "client-id-1" {
				t.Errorf("x-request-id = %q, want the client's", v)
			}
		})
	}
}

// Envoy would replace an external request's id with use_remote_address and
// without preserve_external_request_id, by rules the emulator does not
// model: the combination is refused.
func TestUseRemoteAddressWithoutPreservedRequestIDIsRefused(t *testing.T) {
	path := tlsBootstrap(t, "")
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ClientHeaders != (ClientHeaders{}) {
		t.Fatalf("ClientHeaders = %+v for a bootstrap that sets none", cfg.ClientHeaders)
	}
	yaml := strings.Replace(readFile(t, path), "stat_prefix: inference", "stat_prefix: inference\n          use_remote_address: true", 1)
	if _, err := LoadConfig(writeFile(t, yaml)); err == nil || !strings.Contains(err.Error(), "preserve_external_request_id") {
		t.Errorf("LoadConfig: %v; want a refusal naming preserve_external_request_id", err)
	}
	yaml = strings.Replace(yaml, "use_remote_address: true", "use_remote_address: true\n          preserve_external_request_id: true", 1)
	cfg, err = LoadConfig(writeFile(t, yaml))
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.ClientHeaders.UseRemoteAddress || !cfg.ClientHeaders.PreserveExternalRequestID {
		t.Errorf("ClientHeaders = %+v, want both read", cfg.ClientHeaders)
	}
}
