package pipeline

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/response"
)

// maxPrefillResponseBytes bounds what we read of a prefill answer: it is one
// token plus kv_transfer_params, far below this. A longer one fails the
// attempt (errAnswerTooLarge): vLLM writes kv_transfer_params last, so what
// was read would lose the handoff without a word.
const maxPrefillResponseBytes = 8 << 20

// errAnswerTooLarge is a 2xx prefill answer over maxPrefillResponseBytes.
var errAnswerTooLarge = fmt.Errorf("the prefill answer is longer than %d bytes", maxPrefillResponseBytes)

// attempt sends one prefill leg to endpoint inside its own span, and records
// its duration and any failure, classified. wrote, when set, is called once
// the request is written whole, before any answer.
func (p *Pipeline) attempt(ctx context.Context, endpoint string, r *Request, leg prefillLeg, wrote func()) (prefillAnswer, *attemptError) {
	attrs := []attribute.KeyValue{semconv.HTTPRequestMethodPost, semconv.URLPath(r.URLPath()), attribute.String("pd.request_id", r.RequestID)}
	if host, port, err := net.SplitHostPort(endpoint); err == nil {
		n, _ := strconv.Atoi(port)
		attrs = append(attrs, semconv.ServerAddress(host), semconv.ServerPort(n))
	}
	ctx, span := p.tracer.Start(ctx, "prefill", trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(attrs...))
	defer span.End()

	start := time.Now()
	var reached atomic.Bool // the transport began to connect to endpoint, or took a pooled connection to it
	answer, err := p.postPrefill(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		ConnectStart: func(string, string) { reached.Store(true) },
		GotConn:      func(httptrace.GotConnInfo) { reached.Store(true) },
		WroteRequest: func(w httptrace.WroteRequestInfo) {
			if w.Err == nil && wrote != nil {
				wrote()
			}
		},
	}), endpoint, r, leg)
	if err != nil {
		failed := classify(ctx, err, reached.Load())
		p.metrics.PrefillAttempt(time.Since(start), failed.reason)
		switch {
		case failed.answer != nil && failed.answer.streamed: // the error came after a 200
			span.SetAttributes(semconv.HTTPResponseStatusCode(http.StatusOK))
		case failed.answer != nil:
			span.SetAttributes(semconv.HTTPResponseStatusCode(failed.answer.status))
		}
		span.SetAttributes(attribute.String("error.type", failed.reason.String()))
		span.SetStatus(codes.Error, err.Error())
		return prefillAnswer{}, failed
	}
	p.metrics.PrefillAttempt(time.Since(start), 0)
	span.SetAttributes(semconv.HTTPResponseStatusCode(http.StatusOK), attribute.Bool("pd.kv_transfer_params", answer.params != nil))
	return answer, nil
}

// postPrefill sends one prefill leg and reads what the decode leg and the
// client's answer need of the engine's answer.
func (p *Pipeline) postPrefill(ctx context.Context, endpoint string, r *Request, leg prefillLeg) (prefillAnswer, error) {
	ctx, cancel := context.WithTimeout(ctx, p.opts.AttemptTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.scheme+"://"+endpoint+r.Path, nil)
	if err != nil {
		return prefillAnswer{}, withoutQuery(err)
	}
	setBody(req, leg.body)
	for k, v := range r.Forward {
		req.Header[k] = v
	}
	// The engine joins the caller's trace (vLLM reads traceparent when tracing is on).
	p.propagator.Inject(ctx, propagation.HeaderCarrier(req.Header))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", r.RequestID)
	if leg.rank != "" {
		req.Header.Set("X-Data-Parallel-Rank", leg.rank) // vLLM's API server pins the request to it
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return prefillAnswer{}, withoutQuery(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 {
		// A 101, the one 1xx net/http hands on: its body, with an Upgrade
		// header, is the connection itself, which no deadline ends.
		return prefillAnswer{}, &statusError{status: resp.StatusCode}
	}
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxPrefillResponseBytes+1))
	if err != nil {
		return prefillAnswer{}, fmt.Errorf("reading prefill answer: %w", err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		e := &statusError{status: resp.StatusCode, body: answer, contentType: resp.Header.Get("Content-Type"),
			retryAfter: retryAfter(resp.Header.Get("Retry-After"))}
		if e.cut = len(answer) > maxPrefillResponseBytes; e.cut {
			e.body = answer[:maxQuotedBytes] // cut, it is JSON no more: the client is told its beginning
		}
		return prefillAnswer{}, e
	}
	if len(answer) > maxPrefillResponseBytes {
		return prefillAnswer{}, errAnswerTooLarge
	}
	var a prefillAnswer
	if ct := resp.Header.Get("Content-Type"); !response.IsEventStream(ct, resp.Header.Get("Content-Encoding")) {
		if a, err = p.readAnswer(answer, r); err != nil {
			return prefillAnswer{}, err
		}
	} else if response.StreamFailed(answer) {
		// A streamed leg (kv-sglang keeps the client's stream) that
		// failed after its 200: the engine's 500, told in an error event
		// (SGLang's /generate: in its abort chunk).
		return prefillAnswer{}, &statusError{status: http.StatusInternalServerError, body: answer, contentType: ct, streamed: true}
	}
	if a.params == nil && p.connector.HandsBackParams() {
		return prefillAnswer{}, errNoParams
	}
	return a, nil
}

// errNoParams is a 2xx prefill answer without the kv_transfer_params its
// connector hands back: vLLM's NIXL connector is not configured (null), the
// request was aborted, the engine's release drops them for the API, its one
// token was a stop token (readAnswer says so), or the answer is not the
// engine's (a proxy's error with a 200). Sent on, the decode engine would
// compute the prompt again unseen, so it is a failed prefill.
var errNoParams = errors.New("the prefill answer has no kv_transfer_params")

// errMalformed is a 2xx prefill answer that is not a JSON object, nor an
// event stream (a kv-sglang leg keeps the client's stream): a broken engine,
// or a proxy in front of it answering for it. Its kv_transfer_params, if
// any, cannot be read, so it is a failed attempt, retried and blamed.
var errMalformed = errors.New("the prefill answer is not a JSON object")

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

// withoutQuery drops the query from the URL an error of net/http quotes: the
// client's path may carry a credential (?api_key=), which no log line or span
// may (docs/architecture.md, Security rules).
func withoutQuery(err error) error {
	if ue := (*url.Error)(nil); errors.As(err, &ue) {
		ue.URL, _, _ = strings.Cut(ue.URL, "?")
	}
	return err
}
