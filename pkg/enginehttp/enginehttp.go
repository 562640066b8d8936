// Package enginehttp is how pd-extproc itself speaks HTTP to the engines: the
// client of the prefill legs, and the TLS of those legs and of each pool's
// health checks and load scrapes. (The decode leg goes through Envoy, whose
// cluster carries its TLS.)
package enginehttp

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// idleConnTimeout closes a connection to an engine before the engine does:
// vLLM and SGLang close one idle for 5 s (uvicorn's timeout_keep_alive), and
// a leg sent on one as it closes fails, a POST not being retried.
const idleConnTimeout = 4 * time.Second

// Client returns the HTTP client for prefill legs and the URL scheme it
// speaks: a keep-alive pool per endpoint (prefill.max_idle_conns_per_endpoint),
// at most prefill.max_conns_per_endpoint connections to each, no environment
// proxy (engines are addressed directly by ip:port), no transparent
// compression that would hide the response size, no redirects, HTTPS when
// prefill.tls says so and HTTP/2 when prefill.http2 does.
func Client(cfg config.Prefill) (*http.Client, string, error) {
	t := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        4 * cfg.MaxIdleConnsPerEndpoint,
		MaxIdleConnsPerHost: cfg.MaxIdleConnsPerEndpoint,
		MaxConnsPerHost:     cfg.MaxConnsPerEndpoint,
		IdleConnTimeout:     idleConnTimeout,
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
	var err error
	if t.TLSClientConfig, err = TLS("prefill.tls", cfg.TLS); err != nil {
		return nil, "", err
	}
	return client, "https", nil
}

// TLS is the client TLS of requests to engines under the config keys at key;
// nil when they speak plain HTTP.
func TLS(key string, cfg config.EngineTLS) (*tls.Config, error) {
	if !cfg.Enabled {
		return nil, nil
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cfg.ServerName}
	if cfg.CAFile != "" {
		pem, err := os.ReadFile(cfg.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%s.ca_file: %w", key, err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s.ca_file: no PEM certificate in %s", key, cfg.CAFile)
		}
	}
	return c, nil
}

// noRedirects keeps the prefill leg on the configured endpoint
// (docs/architecture.md, Security rules): a redirect would send the prompt and
// the client's Authorization elsewhere, and let that host's
// kv_transfer_params steer the decode engine.
func noRedirects(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
