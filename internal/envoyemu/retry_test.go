package envoyemu

import (
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// retryProxy is the shipped envoy.yaml whose routes retry as policy says,
// in front of a processor that routes every request to dest; edit, when
// set, changes the config first.
func retryProxy(t *testing.T, policy *RetryPolicy, gateway bool, dest string, edit func(*Config)) *Proxy {
	t.Helper()
	cfg := loadShipped(t, "envoy.yaml")
	cfg.GatewayFallbacks = gateway
	for i := range cfg.Routes {
		cfg.Routes[i].Retry = policy
	}
	if edit != nil {
		edit(cfg)
	}
	return startProxy(t, cfg, fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", dest)), nil, nil))
}

// failingFirst answers 503 to its first n requests, then "ok".
func failingFirst(t *testing.T, n int32) *upstream {
	var calls atomic.Int32
	return startUpstreamWith(t, func(w http.ResponseWriter, _ *http.Request) {
		if calls.Add(1) <= n {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok"))
	})
}

// ceilings records the backoff ceilings a proxy draws from, and waits none.
type ceilings struct {
	mu  sync.Mutex
	got []time.Duration
}

func (c *ceilings) draw(ceiling time.Duration) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.got = append(c.got, ceiling)
	return 0
}

// TestRetryBackoff: each retry waits a jittered backoff below a ceiling
// that starts at the base interval (Envoy's 25 ms unless retry_back_off
// sets it), doubles while under half the max (ten times the base unless
// set), then stays at the max (JitteredExponentialBackOffStrategy).
func TestRetryBackoff(t *testing.T) {
	const ms = time.Millisecond
	on503 := func(n int, base, most time.Duration) *RetryPolicy {
		return &RetryPolicy{On: []string{"retriable-status-codes"}, StatusCodes: []int{503}, NumRetries: n, BaseInterval: base, MaxInterval: most}
	}
	tests := []struct {
		name     string
		policy   *RetryPolicy
		failures int32
		status   int
		want     []time.Duration
	}{
		{name: "Envoy's default: 25 ms, doubled up to 250 ms", policy: on503(6, 0, 0), failures: 100, status: 503,
			want: []time.Duration{25 * ms, 50 * ms, 100 * ms, 200 * ms, 250 * ms, 250 * ms}},
		{name: "retry_back_off's intervals", policy: on503(4, 10*ms, 30*ms), failures: 100, status: 503,
			want: []time.Duration{10 * ms, 20 * ms, 30 * ms, 30 * ms}},
		{name: "retry_back_off's base alone: the max is ten times it", policy: on503(5, 40*ms, 0), failures: 100, status: 503,
			want: []time.Duration{40 * ms, 80 * ms, 160 * ms, 320 * ms, 400 * ms}},
		{name: "an answer that is not retried ends the backoffs", policy: on503(6, 0, 0), failures: 2, status: 200,
			want: []time.Duration{25 * ms, 50 * ms}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := failingFirst(t, tc.failures)
			p := retryProxy(t, tc.policy, false, up.addr, nil)
			var c ceilings
			p.hooks.backoff = c.draw
			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
			if res.status != tc.status {
				t.Fatalf("status %d %q, want %d", res.status, res.body, tc.status)
			}
			if n := len(p.Upstreams()); n != len(tc.want)+1 {
				t.Errorf("%d attempts, want %d", n, len(tc.want)+1)
			}
			if !slices.Equal(c.got, tc.want) {
				t.Errorf("backoff ceilings %v, want %v", c.got, tc.want)
			}
		})
	}
}

// TestRetryWaitsItsBackoff: the retry is sent only once the backoff drawn
// has passed.
func TestRetryWaitsItsBackoff(t *testing.T) {
	const wait = 150 * time.Millisecond
	up := failingFirst(t, 1)
	p := retryProxy(t, &RetryPolicy{On: []string{"5xx"}, NumRetries: 1}, false, up.addr, nil)
	p.hooks.backoff = func(time.Duration) time.Duration { return wait }
	start := time.Now()
	res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
	if res.status != http.StatusOK || res.body != "ok" {
		t.Fatalf("answer %d %q, want 200 ok", res.status, res.body)
	}
	if took := time.Since(start); took < wait {
		t.Errorf("the retried request took %v, less than its %v backoff", took, wait)
	}
}
