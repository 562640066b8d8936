package enginehttp

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testpki"
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
		{name: "a CA file that is missing", cfg: config.EngineTLS{Enabled: true, CAFile: filepath.Join(dir, "missing.pem")}, wantErr: "prefill.tls.ca_file: stat"},
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

// The engines' CA is rotated as cert-manager or an operator does it: the
// bundle first gains the new CA, then the engines serve certificates from
// it. New connections trust it without a restart; a bundle that cannot be
// read mid-rotation keeps the one read before; a certificate from a CA the
// bundle never held is still refused.
func TestEngineCARotationNeedsNoRestart(t *testing.T) {
	cas := map[string]*testpki.CA{}
	certs := map[string]*tls.Certificate{}
	for _, name := range []string{"old", "new", "stranger"} {
		ca, err := testpki.NewCA(name)
		if err != nil {
			t.Fatal(err)
		}
		certPEM, keyPEM, err := ca.IssuePEM(testpki.Leaf{Name: "engine", SANs: []string{"127.0.0.1"}, Server: true})
		if err != nil {
			t.Fatal(err)
		}
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		cas[name], certs[name] = ca, &cert
	}
	var serving atomic.Pointer[tls.Certificate]
	engine := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	engine.Listener = tls.NewListener(engine.Listener, &tls.Config{
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return serving.Load(), nil }})
	engine.Start()
	defer engine.Close()
	url := strings.Replace(engine.URL, "http://", "https://", 1)

	volume := &testpki.Volume{Dir: t.TempDir()}
	if err := volume.Write(map[string][]byte{"ca.crt": cas["old"].PEM}); err != nil {
		t.Fatal(err)
	}
	c, _, err := Client(config.Prefill{TLS: config.EngineTLS{Enabled: true, CAFile: filepath.Join(volume.Dir, "ca.crt")}})
	if err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		name   string
		bundle []byte // written before the step; nil: left as it is
		serves string
		ok     bool
	}{
		{"the old CA", nil, "old", true},
		{"the bundle gains the new CA, the engine serves from it", append(slices.Clone(cas["old"].PEM), cas["new"].PEM...), "new", true},
		{"a bundle that is not PEM keeps the one before", []byte("half-written"), "new", true},
		{"a CA the bundle never held", nil, "stranger", false},
	}
	for _, s := range steps {
		if s.bundle != nil {
			if err := volume.Write(map[string][]byte{"ca.crt": s.bundle}); err != nil {
				t.Fatal(err)
			}
		}
		serving.Store(certs[s.serves])
		c.CloseIdleConnections() // a new connection, a new handshake
		resp, err := c.Get(url)
		if err == nil {
			resp.Body.Close()
		}
		if (err == nil) != s.ok {
			t.Errorf("%s: error %v, want success %v", s.name, err, s.ok)
		}
	}
}

// An engine's certificate must name the engine: the IP address dialled, or
// tls.server_name when that is set. A certificate the CA signed for another
// engine is refused, as Go's own verification would refuse it; over
// HTTP/2 too, which the handshake still negotiates.
func TestEngineCertificateNamesTheEngine(t *testing.T) {
	ca, err := testpki.NewCA("engines")
	if err != nil {
		t.Fatal(err)
	}
	caPath := filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(caPath, ca.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name       string
		sans       []string // the engine's certificate; it listens on 127.0.0.1
		serverName string
		http2      bool
		ok         bool
	}{
		{"its IP address", []string{"127.0.0.1"}, "", false, true},
		{"another engine's IP address", []string{"127.0.0.2"}, "", false, false},
		{"another engine's, over HTTP/2", []string{"127.0.0.2"}, "", true, false},
		{"its IP address, over HTTP/2", []string{"127.0.0.1"}, "", true, true},
		{"the name tls.server_name says", []string{"engine.pd"}, "engine.pd", false, true},
		{"a name, not tls.server_name's", []string{"other.pd"}, "engine.pd", false, false},
		{"tls.server_name rules, not the IP address", []string{"127.0.0.1"}, "engine.pd", false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			certPEM, keyPEM, err := ca.IssuePEM(testpki.Leaf{Name: "engine", SANs: tt.sans, Server: true})
			if err != nil {
				t.Fatal(err)
			}
			cert, err := tls.X509KeyPair(certPEM, keyPEM)
			if err != nil {
				t.Fatal(err)
			}
			engine := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte(r.Proto)) }))
			engine.EnableHTTP2 = true
			engine.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
			engine.StartTLS()
			defer engine.Close()
			c, _, err := Client(config.Prefill{HTTP2: tt.http2, TLS: config.EngineTLS{Enabled: true, CAFile: caPath, ServerName: tt.serverName}})
			if err != nil {
				t.Fatal(err)
			}
			defer c.CloseIdleConnections()
			resp, err := c.Get(engine.URL)
			if (err == nil) != tt.ok {
				t.Fatalf("error %v, want success %v", err, tt.ok)
			}
			if err != nil {
				return
			}
			defer resp.Body.Close()
			if want := map[bool]int{true: 2, false: 1}[tt.http2]; resp.ProtoMajor != want {
				t.Errorf("spoke %s, want HTTP/%d", resp.Proto, want)
			}
		})
	}
}

// An engine that accepts a connection and never answers the handshake (a
// frozen process the kernel still accepts for) gives the dial up after the
// handshake bound: net/http does not cancel a dial with its request, and the
// connection slot would be held for good.
func TestAHandshakeThatNeverEndsIsGivenUp(t *testing.T) {
	defer func(d time.Duration) { handshakeTimeout = d }(handshakeTimeout)
	handshakeTimeout = 50 * time.Millisecond
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close() // silent until the test ends
		}
	}()
	dial := DialTLS(&tls.Config{MinVersion: tls.VersionTLS12}, (&net.Dialer{}).DialContext)
	done := make(chan error, 1)
	go func() {
		_, err := dial(context.Background(), "tcp", l.Addr().String())
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("dial: %v, want the handshake's deadline", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the handshake still waits for an engine that never answers")
	}
}
