package envoyemu

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"google.golang.org/protobuf/types/known/durationpb"
)

// RetryPolicy is a route's retry_policy, as far as emulated: the conditions
// of retry_on that apply to HTTP/1.1 upstreams, the number of retries and
// their backoff. The request body is kept for them up to the stream's buffer
// limit (Limits.BufferLimitBytes); a longer one is not retried.
type RetryPolicy struct {
	On          []string // retry_on
	NumRetries  int      // num_retries, default 1
	StatusCodes []int    // retriable_status_codes
	// BaseInterval and MaxInterval are retry_back_off's; 0: Envoy's
	// defaults, 25 ms and ten times the base.
	BaseInterval, MaxInterval time.Duration
}

// retryOn are the retry_on conditions emulated (RetryStateImpl,
// source/common/router/retry_state_impl.cc): 5xx and gateway-error retry a
// reset too, reset any reset, connect-failure a failed connection.
var retryOn = []string{"5xx", "gateway-error", "reset", "connect-failure", "retriable-4xx", "retriable-status-codes"}

func retryPolicyFrom(rp *routev3.RetryPolicy) (*RetryPolicy, error) {
	if rp == nil {
		return nil, nil
	}
	if rp.GetPerTryTimeout() != nil || rp.GetPerTryIdleTimeout() != nil ||
		len(rp.GetRetryHostPredicate()) > 0 || rp.GetRetryPriority() != nil || len(rp.GetRetriableHeaders()) > 0 ||
		len(rp.GetRetriableRequestHeaders()) > 0 || rp.GetRateLimitedRetryBackOff() != nil {
		return nil, errors.New("retry_policy: only retry_on, num_retries, retriable_status_codes and retry_back_off are emulated")
	}
	p := &RetryPolicy{NumRetries: 1}
	if n := rp.GetNumRetries(); n != nil {
		p.NumRetries = int(n.GetValue())
	}
	for _, on := range strings.Split(rp.GetRetryOn(), ",") {
		on = strings.TrimSpace(on)
		if !slices.Contains(retryOn, on) {
			return nil, fmt.Errorf("retry_policy: retry_on %q is not emulated", on)
		}
		p.On = append(p.On, on)
	}
	for _, c := range rp.GetRetriableStatusCodes() {
		p.StatusCodes = append(p.StatusCodes, int(c))
	}
	return p, backOffFrom(p, rp.GetRetryBackOff())
}

// backOffFrom reads retry_back_off as Envoy's RetryPolicyImpl does
// (source/common/router/retry_policy_impl.cc): whole milliseconds, at least
// one, and a max_interval below the base refused.
func backOffFrom(p *RetryPolicy, b *routev3.RetryPolicy_RetryBackOff) error {
	if b == nil {
		return nil
	}
	ms := func(d *durationpb.Duration) time.Duration {
		return max(d.AsDuration().Truncate(time.Millisecond), time.Millisecond)
	}
	p.BaseInterval = ms(b.GetBaseInterval())
	if b.GetMaxInterval() == nil {
		return nil
	}
	if p.MaxInterval = ms(b.GetMaxInterval()); p.MaxInterval < p.BaseInterval {
		return fmt.Errorf("retry_policy: retry_back_off max_interval %v is below base_interval %v", p.MaxInterval, p.BaseInterval)
	}
	return nil
}

// onStatus says whether an answer of this status is retried. One marked
// x-envoy-ratelimited never is (retry_on envoy-ratelimited is refused);
// x-envoy-overloaded no longer stops a retry since Envoy 1.15
// (wouldRetryFromHeaders in source/common/router/retry_state_impl.cc).
func (p *RetryPolicy) onStatus(status int, h http.Header) bool {
	if h.Get("x-envoy-ratelimited") != "" {
		return false
	}
	for _, on := range p.On {
		switch {
		case on == "5xx" && status >= 500 && status <= 599,
			on == "gateway-error" && status >= 502 && status <= 504,
			on == "retriable-4xx" && status == 409,
			on == "retriable-status-codes" && slices.Contains(p.StatusCodes, status):
			return true
		}
	}
	return false
}

// onError says whether an upstream that failed before its headers is
// retried: a failed connection, or a reset.
func (p *RetryPolicy) onError(err error) bool {
	var op *net.OpError
	connect := errors.As(err, &op) && op.Op == "dial"
	for _, on := range p.On {
		if on == "5xx" || on == "gateway-error" || on == "reset" || (on == "connect-failure" && connect) {
			return true
		}
	}
	return false
}

// attempts is what the router keeps to send the request again: the hosts in
// order, and the request as the upstream got it.
type attempts struct {
	hosts     []string // the gateway's list (GatewayFallbacks), else the one host
	made      int      // attempts sent
	at        string   // the host of the last
	headers   *headerMap
	noBody    bool
	body      [][]byte // the request body so far
	ended     bool
	trailers  *headerMap
	ceiling   time.Duration // of the next backoff, 0 before the first
	kept      int           // body bytes seen
	abandoned bool          // the body passed the buffer limit: no retry
}

// next is the host of the next attempt: ORIGINAL_DST picks the same host
// again; a gateway goes down its list, and stops at its end.
func (rt *router) next(gateway bool) (string, bool) {
	a := &rt.attempts
	switch {
	case !gateway:
		return a.hosts[0], true
	case a.made < len(a.hosts):
		return a.hosts[a.made], true
	}
	return "", false
}

// keep records what the upstream is sent, for another attempt, up to the
// stream's buffer limit. Past it Envoy's router retries the request no
// more, and answers 507 when a retry was waiting its backoff
// (Filter::decodeData in source/common/router/router.cc).
func (rt *router) keep(b []byte, end bool, tr *headerMap) {
	a := &rt.attempts
	if rt.route.Retry == nil || a.abandoned {
		return
	}
	if a.kept += len(b); a.kept > rt.x.cfg.Limits.BufferLimitBytes {
		a.abandoned, a.body = true, nil
		rt.cluster().abandonRetry()
		if rt.wait.running() {
			rt.wait.stop()
			rt.x.localReply(http.StatusInsufficientStorage, "", "exceeded request buffer limit while retrying upstream",
				"request_payload_exceeded_retry_buffer_limit")
		}
		return
	}
	if len(b) > 0 {
		a.body = append(a.body, append([]byte(nil), b...))
	}
	a.ended, a.trailers = a.ended || end, tr
}

// retry is asked on the event loop of an attempt that failed (err) or
// answered status with headers h, as Envoy's router asks RetryStateImpl (onUpstreamReset
// and onUpstreamHeaders in source/common/router/router.cc): true when the
// request goes to the next host after a backoff.
func (rt *router) retry(status int, h http.Header, err error) bool {
	x, p, a := rt.x, rt.route.Retry, &rt.attempts
	rt.releaseRetry()
	if x.finished || a.abandoned || (err != nil && !p.onError(err)) || (err == nil && !p.onStatus(status, h)) {
		return false
	}
	if a.made > p.NumRetries {
		x.setFlag("URX") // RetryStatus::NoRetryLimitExceeded
		return false
	}
	addr, ok := rt.next(x.cfg.GatewayFallbacks)
	if !ok {
		return false
	}
	why := strconv.Itoa(status)
	if err != nil {
		why = err.Error()
	}
	if rt.retrying, ok = rt.cluster().retry(); !ok {
		x.setFlag("UO") // RetryStatus::NoOverflow
		x.logf("upstream %s: %s; not retried: the cluster's max_retries retries are under way", a.at, why)
		return false
	}
	wait := rt.backoff()
	x.logf("upstream %s: %s; retrying on %s in %v", a.at, why, addr, wait)
	if rt.body != nil {
		rt.body.abort(errors.New("retried"))
	}
	rt.cancelUpstream()
	rt.wait.start(x, wait, func() { rt.resend(addr) })
	return true
}

// releaseRetry ends the retry under way, if any, in the cluster's count.
func (rt *router) releaseRetry() {
	if rt.retrying != nil {
		rt.retrying()
		rt.retrying = nil
	}
}

// backoff is the wait before the next retry, Envoy's fully jittered
// exponential backoff (JitteredExponentialBackOffStrategy,
// source/common/common/backoff_strategy.cc): whole milliseconds below a
// ceiling that starts at the base interval and doubles while under half the
// max interval, then stays at the max.
func (rt *router) backoff() time.Duration {
	a := &rt.attempts
	base, most := rt.route.Retry.intervals()
	ceiling := cmp.Or(a.ceiling, base)
	a.ceiling = most
	if ceiling < most/2 {
		a.ceiling = 2 * ceiling
	}
	if h := rt.x.p.hooks.backoff; h != nil {
		return h(ceiling)
	}
	return time.Duration(rand.Int64N(max(ceiling.Milliseconds(), 1))) * time.Millisecond
}

// intervals are the backoff's base and max: 25 ms and ten times the base
// unless retry_back_off sets them (RetryStateImpl's constructor,
// source/common/router/retry_state_impl.cc).
func (p *RetryPolicy) intervals() (base, most time.Duration) {
	base = cmp.Or(p.BaseInterval, 25*time.Millisecond)
	return base, cmp.Or(p.MaxInterval, 10*base)
}

// resend sends the request, and its body so far, to addr once the backoff
// has passed.
func (rt *router) resend(addr string) {
	if rt.x.finished || !rt.send(addr) || rt.body == nil {
		return
	}
	a := &rt.attempts
	for _, b := range a.body {
		rt.body.push(b)
	}
	if a.ended {
		rt.body.end(a.trailers)
	}
}
