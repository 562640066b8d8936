// Package enginehttp is how pd-extproc itself speaks HTTP to the engines: the
// client of the prefill legs, and the TLS and API key of those legs and of
// each pool's health checks, scrapes and questions. (The decode leg goes
// through Envoy, whose cluster carries its TLS; the routing reply, its key.)
package enginehttp

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/secretfiles"
)

// IdleConnTimeout closes a connection to an engine before the engine does:
// vLLM and SGLang close one idle for 5 s (uvicorn's timeout_keep_alive), and
// a request sent on one as it closes fails, a POST (a prefill leg, a
// question for token ids) not being retried.
const IdleConnTimeout = 4 * time.Second

// handshakeTimeout bounds a TLS handshake with an engine: net/http does not
// cancel a dial with its request, and an engine that accepts connections but
// is frozen would hold a connection slot (prefill.max_conns_per_endpoint)
// for good.
var handshakeTimeout = 10 * time.Second

// Client returns the HTTP client for prefill legs and the URL scheme it
// speaks: a keep-alive pool per endpoint (prefill.max_idle_conns_per_endpoint),
// at most prefill.max_conns_per_endpoint connections to each, no environment
// proxy (engines are addressed directly by ip:port), no transparent
// compression that would hide the response size, no redirects, HTTPS when
// prefill.tls says so and HTTP/2 when prefill.http2 does.
func Client(cfg config.Prefill) (*http.Client, string, error) {
	dialer := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
	t := &http.Transport{
		Proxy:               nil,
		DialContext:         dialer.DialContext,
		MaxIdleConns:        0, // no bound across engines: MaxIdleConnsPerHost bounds each
		MaxIdleConnsPerHost: cfg.MaxIdleConnsPerEndpoint,
		MaxConnsPerHost:     cfg.MaxConnsPerEndpoint,
		IdleConnTimeout:     IdleConnTimeout,
		DisableCompression:  true,
		Protocols:           new(http.Protocols),
	}
	client := &http.Client{Transport: t, CheckRedirect: noRedirects}
	if !cfg.TLS.Enabled {
		t.Protocols.SetHTTP1(!cfg.HTTP2)
		t.Protocols.SetUnencryptedHTTP2(cfg.HTTP2)
		return client, "http", nil
	}
	t.Protocols.SetHTTP1(true)
	t.Protocols.SetHTTP2(cfg.HTTP2)
	t.ForceAttemptHTTP2 = cfg.HTTP2 // the TLS dialer below is ours
	c, err := TLS("prefill.tls", cfg.TLS)
	if err != nil {
		return nil, "", err
	}
	if cfg.HTTP2 {
		c.NextProtos = []string{"h2", "http/1.1"}
	}
	t.DialTLSContext = DialTLS(c, dialer.DialContext)
	return client, "https", nil
}

// DialTLS dials engines over TLS c: each connection's handshake checks the
// engine's certificate against c's CA (ca_file as it is at that handshake)
// and against tls.server_name or, when that is not set, the IP address
// dialled. A transport's own dialer cannot do the latter: crypto/tls hands
// the certificate check no name for an IP address, which it leaves out of
// the handshake (SNI).
func DialTLS(c *tls.Config, dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		raw, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		conn := c.Clone()
		name := cmp.Or(c.ServerName, host)
		conn.ServerName = name
		if verify := c.VerifyConnection; verify != nil {
			conn.VerifyConnection = func(cs tls.ConnectionState) error {
				cs.ServerName = name
				return verify(cs)
			}
		}
		tc := tls.Client(raw, conn)
		hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
		defer cancel()
		if err := tc.HandshakeContext(hctx); err != nil {
			raw.Close()
			return nil, err
		}
		return tc, nil
	}
}

// TLS is the client TLS of requests to engines under the config keys at key;
// nil when they speak plain HTTP. Dial with DialTLS, which checks the
// engine's name. A ca_file is read again when it changes (secretfiles), before
// the next handshake, so that rotating the engines' CA (the bundle first
// gains the new CA, then the engines restart with certificates from it)
// needs no restart. A file that cannot be read or holds no certificate then
// keeps the CA read before; at start it is an error.
func TLS(key string, cfg config.EngineTLS) (*tls.Config, error) {
	if !cfg.Enabled {
		return nil, nil
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cfg.ServerName}
	if cfg.CAFile != "" {
		ca := secretfiles.New(func() (*x509.CertPool, error) { return secretfiles.CAPool(cfg.CAFile) }, cfg.CAFile)
		if _, _, err := ca.Current(); err != nil {
			return nil, fmt.Errorf("%s.ca_file: %w", key, err)
		}
		// The chain is verified against the CA as it is at each handshake,
		// as crypto/tls would verify it against RootCAs.
		c.InsecureSkipVerify = true
		c.VerifyConnection = func(cs tls.ConnectionState) error { return verify(ca, cs) }
	}
	return c, nil
}

// verify checks the engine's chain against the CA bundle as it is now (or,
// mid-rotation, as read before), and its name (or IP address) against
// cs.ServerName, which DialTLS sets to the one dialled or tls.server_name.
func verify(ca *secretfiles.Files[*x509.CertPool], cs tls.ConnectionState) error {
	roots, _, err := ca.Current()
	if roots == nil {
		return err
	}
	if len(cs.PeerCertificates) == 0 {
		return errors.New("the engine sent no certificate")
	}
	if cs.ServerName == "" { // not dialled by DialTLS, and no name to check
		return errors.New("no engine name to check the certificate against")
	}
	opts := x509.VerifyOptions{Roots: roots, DNSName: cs.ServerName, Intermediates: x509.NewCertPool()}
	for _, cert := range cs.PeerCertificates[1:] {
		opts.Intermediates.AddCert(cert)
	}
	_, err = cs.PeerCertificates[0].Verify(opts)
	return err
}

// noRedirects keeps the prefill leg on the configured endpoint
// (docs/architecture.md, Security rules): a redirect would send the prompt and
// the client's Authorization elsewhere, and let that host's
// kv_transfer_params steer the decode engine.
func noRedirects(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// Key is an engine API key, read from its file (config's api_key_file) and
// again when the file changes, as "Bearer <key>".
type Key struct{ file *secretfiles.Files[string] }

// APIKey reads the key file at path, named key in errors; nil when path is
// empty. A file that cannot be read, or holds no key, is an error at start;
// later, the key read before stays.
func APIKey(key, path string) (*Key, error) {
	if path == "" {
		return nil, nil
	}
	k := &Key{secretfiles.New(func() (string, error) { return readKey(path) }, path)}
	if _, _, err := k.file.Current(); err != nil {
		return nil, fmt.Errorf("%s: %w", key, err)
	}
	return k, nil
}

func readKey(path string) (string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	key := strings.TrimSpace(string(raw))
	switch {
	case key == "":
		return "", fmt.Errorf("%s holds no key", path)
	case strings.ContainsFunc(key, func(r rune) bool { return r < ' ' || r == 0x7f }):
		return "", fmt.Errorf("%s: the key holds a control character", path)
	}
	return "Bearer " + key, nil
}

// Authorization is the header value: "Bearer <key>".
func (k *Key) Authorization() string {
	v, _, _ := k.file.Current()
	return v
}

// Client is c whose requests carry the key, in place of any Authorization
// they were given (the client's, forwarded). nil k: c itself.
func (k *Key) Client(c *http.Client) *http.Client {
	if k == nil {
		return c
	}
	keyed := *c
	next := c.Transport
	if next == nil {
		next = http.DefaultTransport
	}
	keyed.Transport = keyedTransport{next, k}
	return &keyed
}

type keyedTransport struct {
	next http.RoundTripper
	key  *Key
}

func (t keyedTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context()) // a RoundTripper leaves its request as it was given
	r.Header.Set("Authorization", t.key.Authorization())
	return t.next.RoundTrip(r)
}

// CloseIdleConnections closes the wrapped transport's idle connections:
// http.Client.CloseIdleConnections reaches a transport only through this
// method, and the pools call it as they stop (leaving no keep-alive
// connection, nor its goroutines, open to the engines).
func (t keyedTransport) CloseIdleConnections() {
	if c, ok := t.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// Unanswered is how a request to an engine failed before any answer came.
type Unanswered uint8

const (
	Broken    Unanswered = iota // the connection broke, or its TLS failed
	Unreached                   // the engine could not be dialled
	TimedOut                    // the request's deadline passed first
)

// HowUnanswered says how err, the failure of a request to an engine that
// got no answer, came about: the prefill legs' failure reasons and the
// scrapes' alike.
func HowUnanswered(err error) Unanswered {
	var op *net.OpError
	var ne net.Error
	switch {
	case errors.As(err, &op) && op.Op == "dial":
		return Unreached
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return TimedOut
	}
	return Broken
}
