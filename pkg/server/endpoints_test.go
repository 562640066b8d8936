package server

import (
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// pd_extproc_endpoint_healthy says what routing does: 0 while an ejection
// runs, 1 once it has run out. As Envoy's outlier detection unejects a host
// when its time ends, the endpoint is back in rotation then, taking its probe
// request (and no other until the probe tells).
func TestEndpointHealthyDuringTheProbe(t *testing.T) {
	const addr = "10.0.0.2:8000"
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	ps := scheduling.NewPools(scheduling.Spec{Decode: scheduling.PoolSpec{Endpoints: []string{addr},
		PoolScheduling: config.PoolScheduling{Health: config.EngineHealth{ConsecutiveFailures: 1,
			BaseEjection: config.Duration(time.Second), MaxEjection: config.Duration(time.Minute)}}}},
		scheduling.Deps{Now: func() time.Time { return now }})
	m := metrics.New("kv-nixl")
	m.WatchEndpoints(poolStates(ps.Decode))
	e := ps.Decode.Endpoints()[0]
	var probe *scheduling.Slot
	steps := []struct {
		name string
		do   func()
		want float64
	}{
		{"serving", func() {}, 1},
		{"ejected by a failure", func() { e.ReportFailure() }, 0},
		{"its ejection over, its probe under way", func() { now = now.Add(time.Second); probe = e.Claim() }, 1},
		{"the probe failed: ejected again", func() { probe.Report(false) }, 0},
		{"its second ejection over, its probe under way", func() { now = now.Add(2 * time.Second); probe = e.Claim() }, 1},
		{"the probe served", func() { probe.Report(true); probe.Release() }, 1},
	}
	for _, s := range steps {
		s.do()
		if got := endpointHealthy(t, m, addr); got != s.want {
			t.Errorf("%s: pd_extproc_endpoint_healthy = %v, want %v", s.name, got, s.want)
		}
	}
}

// endpointHealthy is the decode endpoint addr's pd_extproc_endpoint_healthy.
func endpointHealthy(t *testing.T, m *metrics.Metrics, addr string) float64 {
	t.Helper()
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "pd_extproc_endpoint_healthy" {
			continue
		}
		for _, s := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range s.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["pool"] == "decode" && labels["endpoint"] == addr {
				return s.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("no pd_extproc_endpoint_healthy for %s", addr)
	return 0
}
