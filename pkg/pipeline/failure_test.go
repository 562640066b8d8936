package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// Every decision about a failed prefill attempt comes from its classification:
// the metrics label, a retry on another endpoint, the blame on this one for a
// sequential and a concurrent leg, and the client's status under on_failure=fail.
// Only connection failures, timeouts and 5xx count against an endpoint: a
// redirect, or a leg that never left, says nothing of its health.
func TestClassifyPrefillErrors(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, stop := context.WithDeadline(context.Background(), time.Now())
	defer stop()
	dial := &url.Error{Op: "Post", URL: "http://10.0.0.1:8000/v1/completions",
		Err: &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connect: connection refused")}}
	// What net/http returns for a leg it will not send: before any connection.
	refused := &url.Error{Op: "Post", URL: "http://10.0.0.1:8000/v1/completions",
		Err: errors.New(`net/http: invalid header field value for "X-Request-Id"`)}
	tests := []struct {
		name                            string
		ctx                             context.Context
		err                             error
		unreached                       bool // the transport never began to connect
		reason                          metrics.Failure
		retry, blamed, blamedConcurrent bool
		status                          int
	}{
		{"engine 503", context.Background(), &statusError{status: 503}, false, metrics.FailureStatus5xx, true, true, false, 502},
		{"engine 400", context.Background(), &statusError{status: 400}, false, metrics.FailureStatus4xx, false, false, false, 400},
		{"engine 429", context.Background(), &statusError{status: 429}, false, metrics.FailureOverloaded, true, false, false, 503},
		// vLLM's model (or LoRA adapter) not served here: another may serve it.
		{"engine 404 for its model", context.Background(), &statusError{status: 404,
			body: []byte(`{"error":{"message":"The model ` + "`sql-lora`" + ` does not exist.","type":"NotFoundError","param":"model","code":404}}`)},
			false, metrics.FailureNotFound, true, false, false, 404},
		{"a 404 that is no OpenAI error (a path the engine lacks)", context.Background(), &statusError{status: 404, body: []byte(`{"detail":"Not Found"}`)},
			false, metrics.FailureStatus4xx, false, false, false, 404},
		{"engine redirect", context.Background(), &statusError{status: 307}, false, metrics.FailureRedirect, true, false, false, 502},
		{"101 Switching Protocols, no upgrade asked", context.Background(), &statusError{status: 101}, false, metrics.FailureMalformed, true, true, false, 502},
		{"a leg net/http refused to send", context.Background(), refused, true, metrics.FailureNotSent, false, false, false, 400},
		{"an answer over the read cap", context.Background(), errAnswerTooLarge, false, metrics.FailureTooLarge, false, false, false, 502},
		{"a kv-nixl answer without kv_transfer_params", context.Background(), errNoParams, false, metrics.FailureNoParams, false, false, false, 502},
		{"a URL net/http cannot parse", context.Background(), &url.Error{Op: "parse", Err: errors.New("invalid character")}, true,
			metrics.FailureNotSent, false, false, false, 400},
		// Every connection prefill.max_conns_per_endpoint allows is busy
		// with the engine's other legs: it is busy, not broken.
		{"attempt timed out waiting for a connection", context.Background(), &url.Error{Op: "Post", Err: context.DeadlineExceeded}, true,
			metrics.FailureTimeout, true, false, false, 503},
		{"connection refused", context.Background(), dial, false, metrics.FailureConnect, true, true, true, 503},
		// A concurrent leg that reached its engine and timed out may be
		// waiting for its decode (SGLang's prefill does for up to 300 s).
		{"prefill.attempt_timeout expired", context.Background(), &url.Error{Op: "Post", Err: context.DeadlineExceeded}, false, metrics.FailureTimeout, true, true, false, 503},
		{"prefill.timeout expired", expired, &url.Error{Op: "Post", Err: context.DeadlineExceeded}, false, metrics.FailureTimeout, false, false, false, 503},
		{"answer cut short", context.Background(), fmt.Errorf("reading prefill answer: %w", io.ErrUnexpectedEOF), false, metrics.FailureTransport, true, true, true, 503},
		{"client left", cancelled, &url.Error{Op: "Post", Err: context.Canceled}, false, metrics.FailureCancelled, false, false, false, 503},
		{"client left during dial", cancelled, dial, false, metrics.FailureCancelled, false, false, false, 503},
		{"engine 503 as the client left", cancelled, &statusError{status: 503}, false, metrics.FailureStatus5xx, false, false, false, 502},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := classify(tt.ctx, tt.err, !tt.unreached)
			if f.reason != tt.reason {
				t.Errorf("reason = %q, want %q", f.reason, tt.reason)
			}
			// Attempts after the first, cut short by the phase's deadline.
			if f.retryable() != tt.retry || f.blames(kv.Sequential, false) != tt.blamed || f.blames(kv.Concurrent, false) != tt.blamedConcurrent {
				t.Errorf("retry %v, blamed %v, blamed when concurrent %v; want %v, %v, %v",
					f.retryable(), f.blames(kv.Sequential, false), f.blames(kv.Concurrent, false), tt.retry, tt.blamed, tt.blamedConcurrent)
			}
			// The first attempt, which had the whole phase: its timeout at the engine is the engine's.
			if wantWhole := tt.blamed || tt.reason == metrics.FailureTimeout && !tt.unreached; f.blames(kv.Sequential, true) != wantWhole {
				t.Errorf("blamed as the phase's first attempt %v, want %v", f.blames(kv.Sequential, true), wantWhole)
			}
			if got := prefillFailed(errors.Join(f, errors.New("no endpoint left")), "r").Status; got != tt.status {
				t.Errorf("client status = %d, want %d", got, tt.status)
			}
		})
	}
}
