package server

import (
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// poolStates reads the pools' endpoints as they are at each call.
func poolStates(pools ...*scheduling.Pool) func() []metrics.EndpointState {
	return func() []metrics.EndpointState {
		var out []metrics.EndpointState
		for _, p := range pools {
			for _, e := range p.Endpoints() {
				st := metrics.EndpointState{Pool: p.Name, Endpoint: e.Addr, InFlight: e.InFlight(), Healthy: e.Healthy(), Ejections: e.Ejections()}
				if l, ok := e.Load(); ok {
					st.Scraped, st.Waiting, st.KVUsage = true, l.Waiting, l.KVUsage
				}
				out = append(out, st)
			}
		}
		return out
	}
}
