package envoyemu

import (
	"container/list"
	"context"
	"errors"
	"math"
	"sync"
)

// Thresholds are a cluster's circuit_breakers.thresholds for priority DEFAULT
// (§12). A field the bootstrap leaves out keeps Envoy's default.
type Thresholds struct {
	MaxConnections     int
	MaxPendingRequests int
	MaxRequests        int
	MaxRetries         int // retries under way at once
}

// DefaultThresholds are Envoy's for a cluster without circuit_breakers
// (ResourceManagers::load in upstream_impl.cc).
var DefaultThresholds = Thresholds{MaxConnections: 1024, MaxPendingRequests: 1024, MaxRequests: 1024, MaxRetries: 3}

// ClusterStats are the cluster counters and gauges Envoy exports under
// cluster.<name>. that the circuit breakers move (the names in the comments).
type ClusterStats struct {
	RqTotal           uint64 // upstream_rq_total: requests that became active
	RqActive          int    // upstream_rq_active
	RqPendingTotal    uint64 // upstream_rq_pending_total
	RqPendingActive   int    // upstream_rq_pending_active
	RqPendingOverflow uint64 // upstream_rq_pending_overflow: the pending queue was full
	RqActiveOverflow  uint64 // upstream_rq_active_overflow: max_requests was reached (Envoy 1.38+)
	// RetryOrShadowAbandoned is retry_or_shadow_abandoned: a request body
	// passed the buffer limit, so the request is retried no more.
	RetryOrShadowAbandoned uint64
	RqRetry                uint64 // upstream_rq_retry: retries made
	RqRetryOverflow        uint64 // upstream_rq_retry_overflow: max_retries retries were under way
}

// errOverflow is a request the circuit breakers refused: Envoy's pool
// failure with reason Overflow.
var errOverflow = errors.New("upstream connect error or disconnect/reset before headers. reset reason: overflow")

// resources is one cluster's circuit-breaker accounting, shared by every
// exchange of the proxy, as Envoy's ResourceManager is shared by all workers.
// The model (conn_pool_base.cc newStreamImpl and attachStreamToClient):
//
//   - A request that a connection can carry, open or still to be opened
//     under max_connections, starts at once, unless max_requests requests are
//     active: then it overflows.
//   - A request no connection can carry waits as pending, unless
//     max_pending_requests already wait: then it overflows. Pending requests
//     start in arrival order as active ones end.
//
// A connection carries one request over HTTP/1 and perConn streams over
// HTTP/2. Connections are counted as if every active request held its share
// and idle ones closed at once; Envoy keeps idle HTTP/1 connections (they
// count against max_connections) and a pending request waits for a
// connection to its own host, so Envoy queues a little earlier and longer
// than this model. Neither changes when a request overflows under load that
// only grows, which is what the limits are sized for.
type resources struct {
	t       Thresholds
	perConn int // requests one connection carries

	mu      sync.Mutex
	stats   ClusterStats
	waiting list.List // of chan error, the pending requests in arrival order
	retries int       // retries under way
}

func newResources(t Thresholds, perConn int) *resources {
	return &resources{t: t, perConn: max(perConn, 1)}
}

// capacity is how many requests the connections allowed can carry.
func (r *resources) capacity() int {
	if r.t.MaxConnections > 0 && r.perConn > math.MaxInt/r.t.MaxConnections {
		return math.MaxInt
	}
	return r.t.MaxConnections * r.perConn
}

// acquire admits one request, waiting while it is pending. It returns the
// release to call when the request ends, or errOverflow, or ctx's error when
// the request was abandoned while pending.
func (r *resources) acquire(ctx context.Context) (release func(), err error) {
	r.mu.Lock()
	if r.stats.RqActive < r.capacity() {
		err = r.startLocked()
		r.mu.Unlock()
		if err != nil {
			return nil, err
		}
		return r.releaser(), nil
	}
	if r.stats.RqPendingActive >= r.t.MaxPendingRequests {
		r.stats.RqPendingOverflow++
		r.mu.Unlock()
		return nil, errOverflow
	}
	r.stats.RqPendingActive++
	r.stats.RqPendingTotal++
	ready := make(chan error, 1)
	el := r.waiting.PushBack(ready)
	r.mu.Unlock()

	select {
	case err := <-ready:
		if err != nil {
			return nil, err
		}
		return r.releaser(), nil
	case <-ctx.Done():
		r.mu.Lock()
		defer r.mu.Unlock()
		select {
		case err := <-ready: // admitted meanwhile: give the slot back
			if err == nil {
				r.endLocked()
			}
		default:
			r.waiting.Remove(el)
			r.stats.RqPendingActive--
		}
		return nil, ctx.Err()
	}
}

// startLocked makes one more request active, or refuses it at max_requests.
func (r *resources) startLocked() error {
	if r.stats.RqActive >= r.t.MaxRequests {
		r.stats.RqActiveOverflow++
		return errOverflow
	}
	r.stats.RqActive++
	r.stats.RqTotal++
	return nil
}

func (r *resources) releaser() func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			r.mu.Lock()
			r.endLocked()
			r.mu.Unlock()
		})
	}
}

// endLocked ends an active request and lets pending ones start in order.
func (r *resources) endLocked() {
	r.stats.RqActive--
	for r.waiting.Len() > 0 && r.stats.RqActive < r.capacity() {
		ready := r.waiting.Remove(r.waiting.Front()).(chan error)
		r.stats.RqPendingActive--
		ready <- r.startLocked()
	}
}

// retry admits one retry while fewer than max_retries are under way
// (RetryStateImpl::shouldRetry, source/common/router/retry_state_impl.cc).
// Its release is due once the retried attempt's outcome is judged, or the
// request ends (RetryStateImpl::resetRetry).
func (r *resources) retry() (release func(), ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.retries >= r.t.MaxRetries {
		r.stats.RqRetryOverflow++
		return nil, false
	}
	r.retries++
	r.stats.RqRetry++
	var once sync.Once
	return func() {
		once.Do(func() {
			r.mu.Lock()
			r.retries--
			r.mu.Unlock()
		})
	}, true
}

// abandonRetry counts a request whose body grew past what is kept for a
// retry.
func (r *resources) abandonRetry() {
	r.mu.Lock()
	r.stats.RetryOrShadowAbandoned++
	r.mu.Unlock()
}

func (r *resources) snapshot() ClusterStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stats
}
