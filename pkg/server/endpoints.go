package server

import (
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// healthReporter is an endpoint that knows whether it may take requests.
// Endpoints that do not implement it count as healthy, so that a pool is ready
// as soon as it has an endpoint.
type healthReporter interface{ Healthy() bool }

func healthy(e any) bool {
	if h, ok := e.(healthReporter); ok {
		return h.Healthy()
	}
	return true
}

// poolStates reads the pools' endpoints as they are at each call.
func poolStates(pools ...*scheduling.Pool) func() []metrics.EndpointState {
	return func() []metrics.EndpointState {
		var out []metrics.EndpointState
		for _, p := range pools {
			for _, e := range p.Endpoints() {
				out = append(out, metrics.EndpointState{Pool: p.Name, Endpoint: e.Addr, InFlight: e.InFlight(), Healthy: healthy(e)})
			}
		}
		return out
	}
}
