package enginehttp

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

func TestClient(t *testing.T) {
	tests := []struct {
		name                    string
		cfg                     config.Prefill
		scheme                  string
		http1, http2, cleartext bool
	}{
		{"plain HTTP/1.1", config.Prefill{}, "http", true, false, false},
		{"HTTP/2 cleartext", config.Prefill{HTTP2: true}, "http", false, false, true},
		{"HTTPS, HTTP/1.1", config.Prefill{TLS: config.EngineTLS{Enabled: true}}, "https", true, false, false},
		{"HTTPS, HTTP/2 offered", config.Prefill{HTTP2: true, TLS: config.EngineTLS{Enabled: true}}, "https", true, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, scheme, err := Client(tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if idle := c.Transport.(*http.Transport).IdleConnTimeout; idle <= 0 || idle >= 5*time.Second {
				t.Errorf("idle connections kept %v: the engines close them at 5 s, and a leg sent as they do fails", idle)
			}
			p := c.Transport.(*http.Transport).Protocols
			if scheme != tt.scheme || p.HTTP1() != tt.http1 || p.HTTP2() != tt.http2 || p.UnencryptedHTTP2() != tt.cleartext {
				t.Errorf("scheme %s, HTTP/1 %v, HTTP/2 %v, h2c %v; want %s, %v, %v, %v",
					scheme, p.HTTP1(), p.HTTP2(), p.UnencryptedHTTP2(), tt.scheme, tt.http1, tt.http2, tt.cleartext)
			}
		})
	}
}

// A redirect from an engine is the answer, never followed: following it would
// send the prompt and the client's credentials to another host.
func TestClientFollowsNoRedirect(t *testing.T) {
	var elsewhere bool
	other := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { elsewhere = true }))
	defer other.Close()
	engine := httptest.NewServer(http.RedirectHandler(other.URL, http.StatusTemporaryRedirect))
	defer engine.Close()
	c, _, err := Client(config.Prefill{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Post(engine.URL, "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTemporaryRedirect || elsewhere {
		t.Errorf("status %d, followed %v; want 307 and not followed", resp.StatusCode, elsewhere)
	}
	c.CloseIdleConnections()
}

func TestTLS(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		cfg     config.EngineTLS
		wantNil bool
		wantErr string
	}{
		{name: "off: plain HTTP", cfg: config.EngineTLS{CAFile: notPEM}, wantNil: true},
		{name: "on, system roots", cfg: config.EngineTLS{Enabled: true, ServerName: "engine"}},
		{name: "a CA file that is missing", cfg: config.EngineTLS{Enabled: true, CAFile: filepath.Join(dir, "missing.pem")}, wantErr: "prefill.tls.ca_file: open"},
		{name: "a CA file without a certificate", cfg: config.EngineTLS{Enabled: true, CAFile: notPEM}, wantErr: "prefill.tls.ca_file: no PEM certificate in " + notPEM},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := TLS("prefill.tls", tt.cfg)
			switch {
			case tt.wantErr != "":
				if err == nil || !strings.HasPrefix(err.Error(), tt.wantErr) {
					t.Fatalf("TLS() error %v, want one starting %q", err, tt.wantErr)
				}
			case err != nil:
				t.Fatal(err)
			case tt.wantNil != (c == nil):
				t.Fatalf("TLS() = %v, want nil %v", c, tt.wantNil)
			case c != nil && (c.ServerName != tt.cfg.ServerName || c.MinVersion == 0 || c.RootCAs != nil):
				t.Errorf("TLS() = server name %q, min version %x, roots %v", c.ServerName, c.MinVersion, c.RootCAs)
			}
		})
	}
}
