package pipeline

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// maxPrefillResponseBytes bounds what we read of a prefill answer: it is one
// token plus kv_transfer_params, far below this.
const maxPrefillResponseBytes = 8 << 20

// newEngineClient returns the HTTP client for prefill legs and the URL scheme
// it speaks: a keep-alive pool per endpoint (prefill.max_idle_conns_per_endpoint),
// no environment proxy (engines are addressed directly by ip:port), no
// transparent compression that would hide the response size, HTTPS when
// prefill.tls says so and HTTP/2 when prefill.http2 does.
func newEngineClient(cfg config.Prefill) (*http.Client, string, error) {
	t := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        4 * cfg.MaxIdleConnsPerEndpoint,
		MaxIdleConnsPerHost: cfg.MaxIdleConnsPerEndpoint,
		IdleConnTimeout:     90 * time.Second,
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
	t.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cfg.TLS.ServerName}
	if cfg.TLS.CAFile != "" {
		pem, err := os.ReadFile(cfg.TLS.CAFile)
		if err != nil {
			return nil, "", fmt.Errorf("prefill.tls.ca_file: %w", err)
		}
		t.TLSClientConfig.RootCAs = x509.NewCertPool()
		if !t.TLSClientConfig.RootCAs.AppendCertsFromPEM(pem) {
			return nil, "", fmt.Errorf("prefill.tls.ca_file: no PEM certificate in %s", cfg.TLS.CAFile)
		}
	}
	return client, "https", nil
}

// noRedirects keeps the prefill leg on the configured endpoint (docs/architecture.md, Security rules): a
// redirect would send the prompt and the client's Authorization elsewhere, and
// let that host's kv_transfer_params steer the decode engine.
func noRedirects(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// attempt sends one prefill leg to endpoint inside its own span, and records
// its duration and any failure, classified.
func (p *Pipeline) attempt(ctx context.Context, endpoint string, r *Request, leg body.Spliced) ([]byte, *attemptError) {
	attrs := []attribute.KeyValue{semconv.HTTPRequestMethodPost, semconv.URLPath(r.Path), attribute.String("pd.request_id", r.RequestID)}
	if host, port, err := net.SplitHostPort(endpoint); err == nil {
		n, _ := strconv.Atoi(port)
		attrs = append(attrs, semconv.ServerAddress(host), semconv.ServerPort(n))
	}
	ctx, span := p.tracer.Start(ctx, "prefill", trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(attrs...))
	defer span.End()

	start := time.Now()
	params, err := p.postPrefill(ctx, endpoint, r, leg)
	if err != nil {
		failed := classify(ctx, err)
		p.metrics.PrefillAttempt(time.Since(start), failed.reason)
		if failed.answer != nil {
			span.SetAttributes(semconv.HTTPResponseStatusCode(failed.answer.status))
		}
		span.SetAttributes(attribute.String("error.type", failed.reason))
		span.SetStatus(codes.Error, err.Error())
		return nil, failed
	}
	p.metrics.PrefillAttempt(time.Since(start), "")
	span.SetAttributes(semconv.HTTPResponseStatusCode(http.StatusOK), attribute.Bool("pd.kv_transfer_params", params != nil))
	return params, nil
}

// postPrefill sends one prefill leg and returns the raw kv_transfer_params of the
// answer, or nil when the engine returned none (absent, null or empty).
func (p *Pipeline) postPrefill(ctx context.Context, endpoint string, r *Request, leg body.Spliced) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, p.opts.AttemptTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.scheme+"://"+endpoint+r.Path, nil)
	if err != nil {
		return nil, err
	}
	setBody(req, leg)
	for k, v := range r.Forward {
		req.Header[k] = v
	}
	// The engine joins the caller's trace (vLLM reads traceparent when tracing is on).
	p.propagator.Inject(ctx, propagation.HeaderCarrier(req.Header))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", r.RequestID)
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxPrefillResponseBytes))
	if err != nil {
		return nil, fmt.Errorf("reading prefill answer: %w", err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, &statusError{status: resp.StatusCode, body: answer, contentType: resp.Header.Get("Content-Type")}
	}
	return transferParams(answer), nil
}

// maxJoinedLeg is the largest prefill leg joined into one buffer before it is
// sent. net/http writes a bytes.Reader's first bytes in the headers' packet
// but flushes the headers on their own before any other reader, so a small leg
// is joined; a larger one is sent from its pieces, without a copy of the
// client's body.
const maxJoinedLeg = 64 << 10

// setBody makes leg the request's body, with its Content-Length and a GetBody
// with which the transport may send it again on a fresh connection.
func setBody(req *http.Request, leg body.Spliced) {
	n := leg.Len()
	reader := func() io.Reader {
		pieces := net.Buffers(slices.Clone(leg)) // reading consumes the list, not the pieces
		return &pieces
	}
	if n <= maxJoinedLeg {
		joined := leg.Bytes()
		reader = func() io.Reader { return bytes.NewReader(joined) }
	}
	req.ContentLength = int64(n)
	req.Body = io.NopCloser(reader())
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(reader()), nil }
}

// transferParams extracts kv_transfer_params from a non-streamed engine answer.
// Anything but a non-empty object means there is nothing to hand to the decode
// engine (a streamed answer, no connector on the prefill engine, an EOS token).
func transferParams(answer []byte) []byte {
	o, err := body.Parse(answer)
	if err != nil {
		return nil
	}
	raw, ok := o.Raw("kv_transfer_params")
	if !ok || raw[0] != '{' || !kv.HasParams(raw) {
		return nil
	}
	return raw
}
