package envoyemu

import (
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
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

// TestRetryBufferLimit: the router keeps the request body for a retry up to
// the stream's buffer limit; a longer body is retried no more, and Envoy
// counts retry_or_shadow_abandoned.
func TestRetryBufferLimit(t *testing.T) {
	const limit = 64
	tests := []struct {
		name      string
		body      int // bytes
		status    int
		attempts  int
		abandoned uint64
	}{
		{name: "a body at the limit is retried", body: limit, status: 200, attempts: 2},
		{name: "a body past the limit is not", body: limit + 1, status: 503, attempts: 1, abandoned: 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := failingFirst(t, 1)
			p := retryProxy(t, &RetryPolicy{On: []string{"5xx"}, NumRetries: 1}, false, up.addr,
				func(cfg *Config) { cfg.Limits.BufferLimitBytes = limit })
			p.hooks.backoff = func(time.Duration) time.Duration { return 0 }
			body := `"` + strings.Repeat("x", tc.body-2) + `"`
			res := do(t, p, http.MethodPost, "/v1/completions", body, nil)
			if res.status != tc.status {
				t.Errorf("status %d %q, want %d", res.status, res.body, tc.status)
			}
			if n := len(p.Upstreams()); n != tc.attempts {
				t.Errorf("%d attempts, want %d", n, tc.attempts)
			}
			if got := p.ClusterStats()["pd_original_dst"].RetryOrShadowAbandoned; got != tc.abandoned {
				t.Errorf("retry_or_shadow_abandoned = %d, want %d", got, tc.abandoned)
			}
		})
	}
}

// TestRetryBufferOverflowWhileBackingOff: a body that passes the buffer
// limit while a retry waits its backoff, with no attempt under way, gets
// Envoy's 507 (Filter::decodeData in router.cc).
func TestRetryBufferOverflowWhileBackingOff(t *testing.T) {
	// Answers 503 at once, before the body ends.
	refuse := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		rc := http.NewResponseController(w)
		_ = rc.EnableFullDuplex()
		w.WriteHeader(http.StatusServiceUnavailable)
		_ = rc.Flush()
	}))
	t.Cleanup(refuse.Close)
	addr := strings.TrimPrefix(refuse.URL, "http://")
	cfg := streamedConfig(t, extprocfilterv3.ProcessingMode_STREAMED)
	cfg.Limits.BufferLimitBytes = 64
	for i := range cfg.Routes {
		cfg.Routes[i].Retry = &RetryPolicy{On: []string{"5xx"}, NumRetries: 1}
	}
	chunks := make(chan string, 4)
	p := startProxy(t, cfg, func(s *procStream) error {
		s.next()
		s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", addr)), nil))
		for m := s.next(); m.GetRequestBody() != nil; m = s.next() {
			s.reply(requestBodyReply(bodyMutation(m.GetRequestBody().GetBody())))
			chunks <- string(m.GetRequestBody().GetBody())
		}
		return nil
	})
	backingOff := make(chan struct{})
	p.hooks.backoff = func(time.Duration) time.Duration {
		close(backingOff)
		return time.Hour
	}
	pw, resc := streamedPost(p.URL() + "/v1/completions")
	defer pw.Close()
	_, _ = pw.Write([]byte("ab"))
	<-chunks
	<-backingOff // the 503 came back, and the retry waits
	go func() { _, _ = pw.Write([]byte(strings.Repeat("x", 100))) }()
	var res result
	select {
	case res = <-resc:
	case <-time.After(10 * time.Second):
		t.Fatal("no answer: the request still waits its backoff")
	}
	const body = "exceeded request buffer limit while retrying upstream"
	if res.status != http.StatusInsufficientStorage || !strings.Contains(res.body, body) ||
		res.header.Get(DetailsHeader) != "request_payload_exceeded_retry_buffer_limit" {
		t.Errorf("answer %d %q (%s), want 507 %q", res.status, res.body, res.header.Get(DetailsHeader), body)
	}
	if n := len(p.Upstreams()); n != 1 {
		t.Errorf("%d attempts, want 1", n)
	}
}

// TestRetryCircuitBreaker: a retry needs room under the cluster's
// max_retries, counted from the retry's decision until its attempt's answer
// is judged; without room the failed answer is the client's, and Envoy
// counts upstream_rq_retry_overflow (RetryStateImpl::shouldRetry).
func TestRetryCircuitBreaker(t *testing.T) {
	policy := &RetryPolicy{On: []string{"5xx"}, NumRetries: 1}
	maxRetries := func(n int) func(*Config) {
		return func(cfg *Config) { cfg.Clusters["pd_original_dst"].Breakers.MaxRetries = n }
	}
	t.Run("max_retries 0 retries nothing", func(t *testing.T) {
		up := failingFirst(t, 1)
		p := retryProxy(t, policy, false, up.addr, maxRetries(0))
		p.hooks.backoff = func(time.Duration) time.Duration { return 0 }
		if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil); res.status != http.StatusServiceUnavailable {
			t.Errorf("status %d %q, want the upstream's 503", res.status, res.body)
		}
		if st := p.ClusterStats()["pd_original_dst"]; len(p.Upstreams()) != 1 || st.RqRetry != 0 || st.RqRetryOverflow != 1 {
			t.Errorf("%d attempts, stats %+v; want 1 attempt, no retry and 1 retry overflow", len(p.Upstreams()), st)
		}
	})
	t.Run("a retry's room ends with its answer", func(t *testing.T) {
		var calls atomic.Int32 // odd calls fail, even ones answer
		up := startUpstreamWith(t, func(w http.ResponseWriter, _ *http.Request) {
			if calls.Add(1)%2 == 1 {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		})
		p := retryProxy(t, policy, false, up.addr, maxRetries(1))
		p.hooks.backoff = func(time.Duration) time.Duration { return 0 }
		for i := range 2 {
			if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil); res.status != http.StatusOK {
				t.Errorf("request %d: status %d %q, want 200 after its retry", i, res.status, res.body)
			}
		}
		if st := p.ClusterStats()["pd_original_dst"]; st.RqRetry != 2 || st.RqRetryOverflow != 0 {
			t.Errorf("stats %+v, want 2 retries and no overflow", st)
		}
	})
	t.Run("a retry under way takes the room of another", func(t *testing.T) {
		held, release := make(chan struct{}), make(chan struct{})
		var calls atomic.Int32
		up := startUpstreamWith(t, func(w http.ResponseWriter, _ *http.Request) {
			switch calls.Add(1) {
			case 2: // the first request's retry: held while the second one fails
				close(held)
				<-release
				_, _ = w.Write([]byte("ok"))
			default:
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		})
		p := retryProxy(t, policy, false, up.addr, maxRetries(1))
		p.hooks.backoff = func(time.Duration) time.Duration { return 0 }
		first := make(chan result, 1)
		go func() {
			req, _ := http.NewRequest(http.MethodPost, p.URL()+"/v1/completions", strings.NewReader(`{"model":"m"}`))
			first <- send(req)
		}()
		<-held
		if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil); res.status != http.StatusServiceUnavailable {
			t.Errorf("second request: status %d %q, want its 503 unretried", res.status, res.body)
		}
		close(release)
		if res := <-first; res.status != http.StatusOK || res.body != "ok" {
			t.Errorf("first request: %d %q, want 200 ok", res.status, res.body)
		}
		if st := p.ClusterStats()["pd_original_dst"]; len(p.Upstreams()) != 3 || st.RqRetry != 1 || st.RqRetryOverflow != 1 {
			t.Errorf("%d attempts, stats %+v; want 3 attempts, 1 retry, 1 retry overflow", len(p.Upstreams()), st)
		}
	})
}

// TestRetryMarkedAnswers: an answer marked x-envoy-ratelimited (an
// upstream Envoy's rate limit) is never retried unless retry_on names
// envoy-ratelimited, which the emulator refuses; one marked
// x-envoy-overloaded is retried like any other, as Envoy does since 1.15
// (RetryStateImpl::wouldRetryFromHeaders).
func TestRetryMarkedAnswers(t *testing.T) {
	tests := []struct {
		header   string
		status   int
		attempts int
	}{
		{header: "x-envoy-ratelimited", status: 503, attempts: 1},
		{header: "x-envoy-overloaded", status: 200, attempts: 2},
	}
	for _, tc := range tests {
		t.Run(tc.header, func(t *testing.T) {
			var calls atomic.Int32
			up := startUpstreamWith(t, func(w http.ResponseWriter, _ *http.Request) {
				if calls.Add(1) == 1 {
					w.Header().Set(tc.header, "true")
					w.WriteHeader(http.StatusServiceUnavailable)
				}
			})
			p := retryProxy(t, &RetryPolicy{On: []string{"5xx"}, NumRetries: 1}, false, up.addr, nil)
			p.hooks.backoff = func(time.Duration) time.Duration { return 0 }
			if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil); res.status != tc.status {
				t.Errorf("status %d %q, want %d", res.status, res.body, tc.status)
			}
			if n := len(p.Upstreams()); n != tc.attempts {
				t.Errorf("%d attempts, want %d", n, tc.attempts)
			}
		})
	}
}

// TestResetReplyNamesTheReset: an attempt that fails before its headers gets
// Envoy's 503 whose body names the reset reason, the connect error's text
// with it, and "retried and the latest" once a retry was made
// (Filter::onUpstreamReset in router.cc): a refused connection is a remote
// connection failure (UF), one closed after connecting a connection
// termination (UC).
func TestResetReplyNamesTheReset(t *testing.T) {
	const prefix = "upstream connect error or disconnect/reset before headers. "
	const refused = "remote connection failure, transport failure reason: delayed connect error: Connection refused"
	hangUp := startUpstreamWith(t, func(w http.ResponseWriter, _ *http.Request) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close()
		}
	})
	tests := []struct {
		name    string
		closed  bool // the engine hangs up after connecting; else it refuses
		retries bool
		body    string
		details string
		flag    string
	}{
		{name: "refused", body: prefix + "reset reason: " + refused, flag: "UF",
			details: "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}"},
		{name: "refused after a retry", retries: true, body: prefix + "retried and the latest reset reason: " + refused, flag: "UF",
			details: "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}"},
		{name: "hung up", closed: true, body: prefix + "reset reason: connection termination", flag: "UC",
			details: "upstream_reset_before_response_started{connection_termination}"},
		{name: "hung up after a retry", closed: true, retries: true, body: prefix + "retried and the latest reset reason: connection termination",
			flag: "UC", details: "upstream_reset_before_response_started{connection_termination}"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			addr := hangUp.addr
			if !tc.closed {
				addr = refusingAddr(t)
			}
			var policy *RetryPolicy
			if tc.retries {
				policy = &RetryPolicy{On: []string{"reset"}, NumRetries: 1}
			}
			p := retryProxy(t, policy, false, addr, func(cfg *Config) {
				cfg.LocalReplies = LocalReplies{Mappers: []ReplyMapper{{filter: flagFilter{tc.flag}, Status: 502}}}
			})
			p.hooks.backoff = func(time.Duration) time.Duration { return 0 }
			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
			if res.status != http.StatusBadGateway || res.body != tc.body || res.header.Get(DetailsHeader) != tc.details {
				t.Errorf("answer %d %q (%s), want 502 (flag %s mapped) %q (%s)",
					res.status, res.body, res.header.Get(DetailsHeader), tc.flag, tc.body, tc.details)
			}
		})
	}
}

// TestResponseFlagsWhenRetriesRunOut: a retry refused for want of retries
// left sets URX, one refused by the cluster's max_retries UO, before the
// reset's own flag; %RESPONSE_FLAGS% joins them with "," in the order they
// were set, and a response_flag_filter matches any of them
// (Filter::maybeRetryReset in source/common/router/router.cc;
// StreamInfoImpl::setResponseFlag, ResponseFlagUtils::toString).
func TestResponseFlagsWhenRetriesRunOut(t *testing.T) {
	hangUp := startUpstreamWith(t, func(w http.ResponseWriter, _ *http.Request) {
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close()
		}
	})
	reset := &RetryPolicy{On: []string{"reset"}, NumRetries: 1}
	tests := []struct {
		name       string
		closed     bool // the engine hangs up after connecting; else it refuses
		policy     *RetryPolicy
		maxRetries int // the cluster's max_retries; 0 leaves Envoy's 3
		attempts   int
		status     int // 502 where the URX mapper matched
		flags      string
	}{
		{name: "refused, no retry policy", attempts: 1, status: 503, flags: "UF"},
		{name: "refused, retries run out", policy: reset, attempts: 2, status: 502, flags: "URX,UF"},
		{name: "hung up, retries run out", closed: true, policy: reset, attempts: 2, status: 502, flags: "URX,UC"},
		{name: "refused, no room under max_retries", policy: reset, maxRetries: -1, attempts: 1, status: 503, flags: "UO,UF"},
		{name: "refused, a policy that does not retry resets", policy: &RetryPolicy{On: []string{"retriable-status-codes"}, NumRetries: 1, StatusCodes: []int{503}},
			attempts: 1, status: 503, flags: "UF"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			addr := hangUp.addr
			if !tc.closed {
				addr = refusingAddr(t)
			}
			p := retryProxy(t, tc.policy, false, addr, func(cfg *Config) {
				if tc.maxRetries < 0 {
					cfg.Clusters["pd_original_dst"].Breakers.MaxRetries = 0
				}
				cfg.LocalReplies = LocalReplies{
					Mappers: []ReplyMapper{{filter: flagFilter{"URX"}, Status: 502}},
					Format:  &ReplyFormat{text: "%RESPONSE_FLAGS%", contentType: "text/plain"},
				}
			})
			p.hooks.backoff = func(time.Duration) time.Duration { return 0 }
			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
			if res.status != tc.status || res.body != tc.flags {
				t.Errorf("answer %d %q, want %d %q", res.status, res.body, tc.status, tc.flags)
			}
			if n := len(p.Upstreams()); n != tc.attempts {
				t.Errorf("%d attempts, want %d", n, tc.attempts)
			}
		})
	}
}
