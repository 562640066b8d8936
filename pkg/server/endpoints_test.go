package server

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
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

// The engine's own queue and KV use are exported while its last scrape
// answered: a failed scrape takes the series away at once, as the docs say,
// not once its figures go stale (the clock here never moves), and the next
// answer brings them back.
func TestEngineLoadGaugesGoWithAFailedScrape(t *testing.T) {
	arrived, answers := make(chan struct{}), make(chan bool)
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		select { // each scrape waits for the test to say how it is answered
		case arrived <- struct{}{}:
		case <-r.Context().Done():
			return
		}
		select {
		case ok := <-answers:
			if !ok {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			fmt.Fprint(w, "vllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.25\n")
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(engine.Close)
	addr := strings.TrimPrefix(engine.URL, "http://")
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	ps := scheduling.NewPools(scheduling.Spec{Decode: scheduling.PoolSpec{Endpoints: []string{addr},
		PoolScheduling: config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Millisecond), Timeout: config.Duration(time.Minute)}}}},
		scheduling.Deps{Now: func() time.Time { return now }})
	m := metrics.New("kv-nixl")
	m.WatchEndpoints(poolStates(ps.Decode))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { ps.Decode.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	<-arrived
	steps := []struct {
		name    string
		answer  bool
		present bool
		waiting float64
		kvUsage float64
	}{
		{"the scrape answered", true, true, 3, 0.25},
		{"the next scrape failed", false, false, 0, 0},
		{"the engine answers again", true, true, 3, 0.25},
	}
	for _, s := range steps {
		answers <- s.answer
		<-arrived // the next scrape waits: this one's figures are in
		waiting, ok := endpointGauge(t, m, "pd_extproc_endpoint_engine_waiting", addr)
		kvUsage, kvOK := endpointGauge(t, m, "pd_extproc_endpoint_engine_kv_usage", addr)
		if ok != s.present || kvOK != s.present || waiting != s.waiting || kvUsage != s.kvUsage {
			t.Errorf("%s: engine_waiting = %v (%v), engine_kv_usage = %v (%v); want %v, %v (%v)",
				s.name, waiting, ok, kvUsage, kvOK, s.waiting, s.kvUsage, s.present)
		}
	}
}

// endpointHealthy is the decode endpoint addr's pd_extproc_endpoint_healthy.
func endpointHealthy(t *testing.T, m *metrics.Metrics, addr string) float64 {
	t.Helper()
	v, ok := endpointGauge(t, m, "pd_extproc_endpoint_healthy", addr)
	if !ok {
		t.Fatalf("no pd_extproc_endpoint_healthy for %s", addr)
	}
	return v
}

// endpointGauge is the decode endpoint addr's gauge name, and whether it has
// the series.
func endpointGauge(t *testing.T, m *metrics.Metrics, name, addr string) (float64, bool) {
	t.Helper()
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, s := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range s.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["pool"] == "decode" && labels["endpoint"] == addr {
				return s.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}
