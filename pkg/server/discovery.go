package server

import (
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/discovery"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// newDiscovery builds the Kubernetes discovery of the pools whose config has
// a kubernetes key, its metrics and its readiness checks; nil when no pool has one.
func (s *Server) newDiscovery(cfg *config.Config, prefill, decode *scheduling.Pool, kubeconfig string, log logr.Logger) (*discovery.Discovery, error) {
	var countError func(pool, reason string)
	d, err := discovery.New(
		map[string]*config.Kubernetes{prefill.Name(): cfg.Pools.Prefill.Kubernetes, decode.Name(): cfg.Pools.Decode.Kubernetes},
		map[string]discovery.Sink{prefill.Name(): prefill, decode.Name(): decode},
		discovery.Options{Kubeconfig: kubeconfig, Log: log, OnError: func(pool, reason string) { countError(pool, reason) }},
	)
	if d == nil || err != nil {
		return nil, err
	}
	var pools []string
	for _, st := range d.Status() {
		pools = append(pools, st.Pool)
	}
	countError = s.metrics.WatchDiscovery(pools, func() []metrics.DiscoveryState {
		var out []metrics.DiscoveryState
		for _, st := range d.Status() {
			out = append(out, metrics.DiscoveryState{Pool: st.Pool, Synced: st.Synced, Refused: st.Refused != nil, Reachable: st.Reachable, Endpoints: st.Endpoints})
		}
		return out
	})
	return d, nil
}
