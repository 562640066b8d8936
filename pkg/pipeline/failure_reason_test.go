package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

func TestFailureReasonClassifiesPrefillErrors(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	dial := &url.Error{Op: "Post", URL: "http://10.0.0.1:8000/v1/completions",
		Err: &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connect: connection refused")}}
	tests := []struct {
		name string
		ctx  context.Context
		err  error
		want string
	}{
		{"engine 503", context.Background(), &statusError{status: 503}, metrics.FailureStatus5xx},
		{"engine 400", context.Background(), &statusError{status: 400}, metrics.FailureStatus4xx},
		{"connection refused", context.Background(), dial, metrics.FailureConnect},
		{"prefill.timeout expired", context.Background(), &url.Error{Op: "Post", Err: context.DeadlineExceeded}, metrics.FailureTimeout},
		{"answer cut short", context.Background(), fmt.Errorf("reading prefill answer: %w", io.ErrUnexpectedEOF), metrics.FailureTransport},
		{"client left", cancelled, &url.Error{Op: "Post", Err: context.Canceled}, metrics.FailureCancelled},
		{"client left during dial", cancelled, dial, metrics.FailureCancelled},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := failureReason(tt.ctx, tt.err); got != tt.want {
				t.Errorf("failureReason(%v) = %q, want %q", tt.err, got, tt.want)
			}
		})
	}
}
