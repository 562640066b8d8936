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
// server, the service Envoy's gRPC health check names, and "readiness" of
// the endpoint-picker protocol's health checking (gateway-api-inference-extension,
// docs/proposals/004-endpoint-picker-protocol), whose "liveness" is SERVING
// until shutdown (livenessService).
var healthServices = []string{"", extprocv3.ExternalProcessor_ServiceDesc.ServiceName, "readiness"}

const livenessService = "liveness"

// readiness tells Envoy (gRPC health) and Kubernetes (/readyz) whether to send
// traffic: only while each pool requests need has an endpoint to route to
// and every pool discovered from Kubernetes has synced with nothing refused,
// and never again once shutdown has begun. A request routed without one
// would only get a 503.
type readiness struct {
	health *health.Server
	// pools are the pools requests need: the decode pool, and the prefill
	// pool where a request cannot go decode-only (a paired connector).
	pools     []string
	endpoints func() []metrics.EndpointState
	discovery func() []discovery.PoolStatus // nil: no pool is discovered
	log       logr.Logger

	mu sync.Mutex // orders updates, so each transition is applied and logged once
	// why is why not ready as update last found it, "" when ready; nil before
	// the first update (New runs one before anything is served). Guarded by mu.
	why      *string
	draining atomic.Bool
}

func newReadiness(hs *health.Server, pools []string, endpoints func() []metrics.EndpointState, log logr.Logger) *readiness {
	hs.SetServingStatus(livenessService, healthpb.HealthCheckResponse_SERVING)
	return &readiness{health: hs, pools: pools, endpoints: endpoints, log: log}
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

// update reads the pools now, applies a change of state, and returns the
// checks it read and why not ready ("" when ready).
func (r *readiness) update() ([]check, string) {
	r.mu.Lock() // the checks too: a later reading is never applied before an earlier one
	defer r.mu.Unlock()
	checks, why := r.checks(), ""
	for _, c := range checks {
		if !c.ok {
			why = c.name + ": " + c.detail
			break
		}
	}
	old := r.why
	r.why = &why
	if old != nil && (*old == "") == (why == "") {
		return checks, why
	}
	status := healthpb.HealthCheckResponse_NOT_SERVING
	if why == "" {
		status = healthpb.HealthCheckResponse_SERVING
	}
	for _, svc := range healthServices {
		r.health.SetServingStatus(svc, status) // ignored once draining: Shutdown is final
	}
	if why == "" {
		r.log.Info("ready: each pool requests need has an endpoint to route to and every discovered pool has synced", "pools", r.pools)
	} else {
		r.log.Info("not ready", "why", why)
	}
	return checks, why
}

// drain makes readiness false for good.
func (r *readiness) drain() {
	r.draining.Store(true)
	r.health.Shutdown()
}

// ServeHTTP answers /readyz from the checks read now, which gRPC health
// then follows too; /readyz?verbose also lists them, as the Kubernetes API
// server's own /readyz?verbose does: [+] passing, [-] failing.
func (r *readiness) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	checks, why := r.update()
	code, msg := http.StatusOK, "ready"
	switch {
	case r.draining.Load():
		code, msg = http.StatusServiceUnavailable, "shutting down"
	case why != "":
		code, msg = http.StatusServiceUnavailable, "not ready: "+why
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	if _, verbose := req.URL.Query()["verbose"]; verbose {
		for _, c := range checks {
			mark := "+"
			if !c.ok {
				mark = "-"
			}
			fmt.Fprintf(w, "[%s]%s: %s\n", mark, c.name, c.detail)
		}
	}
	fmt.Fprintln(w, msg)
}

// drainedHealth is the gRPC health service, whose Watch streams end once the
// server drains, after telling NOT_SERVING: GracefulStop waits for every
// stream, and a client watching readiness is not a request in flight, which
// would otherwise hold the shutdown for all of --shutdown-grace.
type drainedHealth struct {
	*health.Server
	draining <-chan struct{}
}

func (h drainedHealth) Watch(req *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	w := &watchStream{Health_WatchServer: stream, ctx: ctx, cancel: cancel, draining: h.draining}
	go func() {
		select {
		case <-h.draining:
			w.endIfDrained()
		case <-ctx.Done():
		}
	}()
	return h.Server.Watch(req, w)
}

// watchStream is a Watch stream that ends once the server drains and the
// client has been told the service is not serving (or was never told it is).
type watchStream struct {
	healthpb.Health_WatchServer
	ctx      context.Context
	cancel   context.CancelFunc
	draining <-chan struct{}
	last     atomic.Int32 // the status sent last
}

func (w *watchStream) Context() context.Context { return w.ctx }

func (w *watchStream) Send(m *healthpb.HealthCheckResponse) error {
	err := w.Health_WatchServer.Send(m)
	w.last.Store(int32(m.GetStatus()))
	w.endIfDrained()
	return err
}

func (w *watchStream) endIfDrained() {
	select {
	case <-w.draining:
		if healthpb.HealthCheckResponse_ServingStatus(w.last.Load()) != healthpb.HealthCheckResponse_SERVING {
			w.cancel()
		}
	default:
	}
}
