package server

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// healthServices are the gRPC health names that follow readiness: the whole
// server, and the service Envoy's gRPC health check names.
var healthServices = []string{"", extprocv3.ExternalProcessor_ServiceDesc.ServiceName}

// readiness tells Envoy (gRPC health) and Kubernetes (/readyz) whether to send
// traffic: only while the decode pool has a healthy endpoint, and never again
// once shutdown has begun. A request routed without one would only get a 503.
type readiness struct {
	health    *health.Server
	pool      string // the decode pool's name
	endpoints func() []metrics.EndpointState
	log       logr.Logger

	mu       sync.Mutex // orders updates, so each transition is applied and logged once
	known    bool
	up       atomic.Bool // the decode pool has a healthy endpoint
	draining atomic.Bool
}

func newReadiness(hs *health.Server, pool string, endpoints func() []metrics.EndpointState, log logr.Logger) *readiness {
	return &readiness{health: hs, pool: pool, endpoints: endpoints, log: log}
}

// run re-reads the pool every interval until ctx is done. Polling rather than
// a change feed keeps pkg/scheduling free of listeners; a second of lag is far
// below what Envoy's and Kubernetes' own probes add.
func (r *readiness) run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.update()
		}
	}
}

// update reads the decode pool now and applies a change of state.
func (r *readiness) update() {
	up := false
	for _, e := range r.endpoints() {
		if e.Pool == r.pool && e.Healthy {
			up = true
			break
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.known && r.up.Load() == up {
		return
	}
	r.known = true
	r.up.Store(up)
	status := healthpb.HealthCheckResponse_NOT_SERVING
	if up {
		status = healthpb.HealthCheckResponse_SERVING
	}
	for _, svc := range healthServices {
		r.health.SetServingStatus(svc, status) // ignored once draining: Shutdown is final
	}
	if up {
		r.log.Info("the decode pool has a healthy endpoint: ready")
	} else {
		r.log.Info("the decode pool has no healthy endpoint: not ready until one recovers", "pool", r.pool)
	}
}

// drain makes readiness false for good.
func (r *readiness) drain() {
	r.draining.Store(true)
	r.health.Shutdown()
}

// ServeHTTP answers /readyz.
func (r *readiness) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	switch {
	case r.draining.Load():
		http.Error(w, "shutting down", http.StatusServiceUnavailable)
	case !r.up.Load():
		http.Error(w, "no healthy decode endpoint", http.StatusServiceUnavailable)
	default:
		fmt.Fprintln(w, "ready")
	}
}
