package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
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
		reason                          string
		retry, blamed, blamedConcurrent bool
		status                          int
	}{
		{"engine 503", context.Background(), &statusError{status: 503}, false, metrics.FailureStatus5xx, true, true, false, 502},
		{"engine 400", context.Background(), &statusError{status: 400}, false, metrics.FailureStatus4xx, false, false, false, 400},
		{"engine redirect", context.Background(), &statusError{status: 307}, false, metrics.FailureRedirect, true, false, false, 502},
		{"a leg net/http refused to send", context.Background(), refused, true, metrics.FailureNotSent, false, false, false, 400},
		{"an answer over the read cap", context.Background(), errAnswerTooLarge, false, metrics.FailureTooLarge, false, false, false, 502},
		{"a URL net/http cannot parse", context.Background(), &url.Error{Op: "parse", Err: errors.New("invalid character")}, true,
			metrics.FailureNotSent, false, false, false, 400},
		{"attempt timed out waiting for a connection", context.Background(), &url.Error{Op: "Post", Err: context.DeadlineExceeded}, true,
			metrics.FailureTimeout, true, true, true, 503},
		{"connection refused", context.Background(), dial, false, metrics.FailureConnect, true, true, true, 503},
		{"prefill.attempt_timeout expired", context.Background(), &url.Error{Op: "Post", Err: context.DeadlineExceeded}, false, metrics.FailureTimeout, true, true, true, 503},
		{"prefill.timeout expired", expired, &url.Error{Op: "Post", Err: context.DeadlineExceeded}, false, metrics.FailureTimeout, false, false, true, 503},
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
			if f.retryable() != tt.retry || f.blames(kv.Sequential) != tt.blamed || f.blames(kv.Concurrent) != tt.blamedConcurrent {
				t.Errorf("retry %v, blamed %v, blamed when concurrent %v; want %v, %v, %v",
					f.retryable(), f.blames(kv.Sequential), f.blames(kv.Concurrent), tt.retry, tt.blamed, tt.blamedConcurrent)
			}
			if got := prefillFailed(errors.Join(f, errors.New("no endpoint left")), "r").Status; got != tt.status {
				t.Errorf("client status = %d, want %d", got, tt.status)
			}
		})
	}
}

// A client can eject no prefill endpoint with requests no engine could
// serve: a leg net/http refuses to send (a control byte in a header) and an
// engine's redirect say nothing of its health. A 5xx still does.
func TestOnlyTheEndpointsOwnFailuresEjectIt(t *testing.T) {
	tests := []struct {
		name       string
		answer     http.HandlerFunc
		requestID  string
		auth       string
		wantReason string
		wantStatus int  // the client's under on_failure=fail; 0: decode-only under decode-only too
		ejected    bool // after three requests
	}{
		{name: "a control byte in the request id", answer: enginetest.JSON(200, `{}`), requestID: "r\x01", wantReason: metrics.FailureNotSent, wantStatus: 400},
		{name: "a newline in Authorization", answer: enginetest.JSON(200, `{}`), requestID: "r1", auth: "Bearer a\nb",
			wantReason: metrics.FailureNotSent, wantStatus: 400},
		{name: "a redirect", answer: func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, "http://203.0.113.9/", http.StatusTemporaryRedirect)
		},
			requestID: "r1", wantReason: metrics.FailureRedirect},
		{name: "a 5xx", answer: enginetest.JSON(503, `{}`), requestID: "r1", wantReason: metrics.FailureStatus5xx, ejected: true},
	}
	for _, tt := range tests {
		for _, onFailure := range []string{config.OnFailureDecodeOnly, config.OnFailureFail} {
			t.Run(tt.name+"/"+onFailure, func(t *testing.T) {
				engine := enginetest.Start(t, tt.answer)
				p, m, _ := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {on_failure: %s, attempts: 1}`, engine.Addr(), onFailure))
				for range 3 {
					r := &Request{Method: "POST", Path: "/v1/completions", RequestID: tt.requestID,
						Body: []byte(`{"model":"m","prompt":"hi"}`), Forward: http.Header{}}
					if tt.auth != "" {
						r.Forward.Set("Authorization", tt.auth)
					}
					d, err := p.Route(context.Background(), r)
					want := tt.wantStatus
					if want == 0 && onFailure == config.OnFailureFail {
						want = 502
					}
					switch {
					case want == 0 && err != nil:
						t.Fatalf("Route: %v, want decode-only", err)
					case want != 0 && (err == nil || AsError(err, "r").Status != want):
						t.Fatalf("Route: %v, want %d", err, want)
					}
					d.Release()
				}
				if got := counter(t, m, "pd_extproc_prefill_failures_total", "reason", tt.wantReason); got != 3 {
					t.Errorf("prefill_failures_total{reason=%q} = %v, want 3", tt.wantReason, got)
				}
				prefill, _ := p.Pools()
				if healthy := prefill.Endpoints()[0].Healthy(); healthy == tt.ejected {
					t.Errorf("prefill endpoint healthy = %v after three such requests, want %v", healthy, !tt.ejected)
				}
				if tt.wantReason == metrics.FailureNotSent && len(engine.Requests()) != 0 {
					t.Errorf("the engine received %d legs net/http was to refuse", len(engine.Requests()))
				}
			})
		}
	}
}
