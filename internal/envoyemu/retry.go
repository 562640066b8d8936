package envoyemu

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
)

// RetryPolicy is a route's retry_policy, as far as emulated: the conditions
// of retry_on that apply to HTTP/1.1 upstreams, and the number of retries.
// Retries have no backoff here, and the whole request body is kept for them
// (Envoy keeps up to the buffer limit, and retries none past it).
type RetryPolicy struct {
	On          []string // retry_on
	NumRetries  int      // num_retries, default 1
	StatusCodes []int    // retriable_status_codes
}

// retryOn are the retry_on conditions emulated (RetryStateImpl,
// source/common/router/retry_state_impl.cc): 5xx and gateway-error retry a
// reset too, reset any reset, connect-failure a failed connection.
var retryOn = []string{"5xx", "gateway-error", "reset", "connect-failure", "retriable-4xx", "retriable-status-codes"}

func retryPolicyFrom(rp *routev3.RetryPolicy) (*RetryPolicy, error) {
	if rp == nil {
		return nil, nil
	}
	if rp.GetPerTryTimeout() != nil || rp.GetPerTryIdleTimeout() != nil || rp.GetRetryBackOff() != nil ||
		len(rp.GetRetryHostPredicate()) > 0 || rp.GetRetryPriority() != nil || len(rp.GetRetriableHeaders()) > 0 ||
		len(rp.GetRetriableRequestHeaders()) > 0 || rp.GetRateLimitedRetryBackOff() != nil {
		return nil, errors.New("retry_policy: only retry_on, num_retries and retriable_status_codes are emulated")
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
	return p, nil
}

// onStatus says whether an answer of this status is retried.
func (p *RetryPolicy) onStatus(status int) bool {
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
	hosts    []string // the gateway's list (GatewayFallbacks), else the one host
	made     int      // attempts sent
	at       string   // the host of the last
	headers  *headerMap
	noBody   bool
	body     [][]byte // the request body so far
	ended    bool
	trailers *headerMap
}

// next is the host of the next attempt: ORIGINAL_DST picks the same host
// again; a gateway goes down its list, and stops at its end.
func (rt *router) next(gateway bool) (string, bool) {
	a, p := &rt.attempts, rt.route.Retry
	switch {
	case p == nil || a.made > p.NumRetries:
		return "", false
	case !gateway:
		return a.hosts[0], true
	case a.made < len(a.hosts):
		return a.hosts[a.made], true
	}
	return "", false
}

// retriable is what the upstream goroutine asks of a failed attempt, nil
// when no other attempt may follow.
func (rt *router) retriable() func(status int, err error) bool {
	if _, ok := rt.next(rt.x.cfg.GatewayFallbacks); !ok {
		return nil
	}
	p := rt.route.Retry
	return func(status int, err error) bool {
		if err != nil {
			return p.onError(err)
		}
		return p.onStatus(status)
	}
}

// keep records what the upstream is sent, for another attempt.
func (rt *router) keep(b []byte, end bool, tr *headerMap) {
	if rt.route.Retry == nil {
		return
	}
	a := &rt.attempts
	if len(b) > 0 {
		a.body = append(a.body, append([]byte(nil), b...))
	}
	a.ended, a.trailers = a.ended || end, tr
}

// retry sends the request to the next host, after an attempt that failed
// as the route's retry policy says to retry.
func (rt *router) retry(why string) {
	x := rt.x
	if x.finished {
		return
	}
	addr, _ := rt.next(x.cfg.GatewayFallbacks)
	x.logf("upstream %s: %s; retrying on %s", rt.attempts.at, why, addr)
	if rt.body != nil {
		rt.body.abort(errors.New("retried"))
	}
	rt.cancelUpstream()
	if !rt.send(addr) || rt.body == nil {
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
