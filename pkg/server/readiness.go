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

	"github.com/pd-extproc/pd-extproc/pkg/discovery"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// healthServices are the gRPC health names that follow readiness: the whole
// server, and the service Envoy's gRPC health check names.
var healthServices = []string{"", extprocv3.ExternalProcessor_ServiceDesc.ServiceName}

// readiness tells Envoy (gRPC health) and Kubernetes (/readyz) whether to send
// traffic: only while the decode pool has a healthy endpoint and every pool
// discovered from Kubernetes has synced with nothing refused, and never again
// once shutdown has begun. A request routed without one would only get a 503.
type readiness struct {
	health    *health.Server
	pool      string // the decode pool's name
	endpoints func() []metrics.EndpointState
	discovery func() []discovery.PoolStatus // nil: no pool is discovered
	log       logr.Logger

	mu sync.Mutex // orders updates, so each transition is applied and logged once
	// why is why not ready as update last found it, "" when ready; nil before
	// the first update (New runs one before anything is served).
	why      atomic.Pointer[string]
	draining atomic.Bool
}

func newReadiness(hs *health.Server, pool string, endpoints func() []metrics.EndpointState, log logr.Logger) *readiness {
	return &readiness{health: hs, pool: pool, endpoints: endpoints, log: log}
}

// run re-reads the pool every interval until ctx is done. Polling rather than
// a change feed keeps pkg/scheduling free of listeners; a second of lag is far
// below what Envoy's and Kubernetes' own probes add.
func (r *readiness) run(ctx context.Context, interval time.Duration) {
	for tick := time.Tick(interval); ; { // collected once unreferenced, since Go 1.23
		select {
		case <-ctx.Done():
			return
		case <-tick:
			r.update()
		}
	}
}

// update reads the pools now and applies a change of state.
func (r *readiness) update() {
	checks := r.checks()
	up, why := true, ""
	for _, c := range checks {
		if !c.ok {
			up, why = false, c.name+": "+c.detail
			break
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	old := r.why.Swap(&why)
	if old != nil && (*old == "") == up {
		return
	}
	status := healthpb.HealthCheckResponse_NOT_SERVING
	if up {
		status = healthpb.HealthCheckResponse_SERVING
	}
	for _, svc := range healthServices {
		r.health.SetServingStatus(svc, status) // ignored once draining: Shutdown is final
	}
	if up {
		r.log.Info("ready: the decode pool has an endpoint to route to and every discovered pool has synced")
	} else {
		r.log.Info("not ready", "why", why)
	}
}

// drain makes readiness false for good.
func (r *readiness) drain() {
	r.draining.Store(true)
	r.health.Shutdown()
}

// ServeHTTP answers /readyz with the state update last found; /readyz?verbose
// also lists each check as it is now, as the Kubernetes API server's own
// /readyz?verbose does: [+] passing, [-] failing.
func (r *readiness) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	code, msg := http.StatusOK, "ready"
	switch why := *r.why.Load(); {
	case r.draining.Load():
		code, msg = http.StatusServiceUnavailable, "shutting down"
	case why != "":
		code, msg = http.StatusServiceUnavailable, "not ready: "+why
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	if _, verbose := req.URL.Query()["verbose"]; verbose {
		for _, c := range r.checks() {
			mark := "+"
			if !c.ok {
				mark = "-"
			}
			fmt.Fprintf(w, "[%s]%s: %s\n", mark, c.name, c.detail)
		}
	}
	fmt.Fprintln(w, msg)
}
