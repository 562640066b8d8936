package server

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"

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
	addr, arrived, answers := scriptedEngine(t)
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	_, m := runScrapedPool(t, addr, scheduling.Deps{Now: func() time.Time { return now }})
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
		answers <- map[bool]engineAnswer{true: {200, goodScrape}, false: {500, ""}}[s.answer]
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

// A failed scrape of an engine's /metrics is counted in
// pd_extproc_endpoint_scrape_failures_total{pool,endpoint,reason}, and logged
// once at the first failure since the engine last answered (with the path,
// the status and the start of the answer) and once when it answers again;
// the series leave with the endpoint.
func TestScrapeFailuresAreCountedAndLogged(t *testing.T) {
	addr, arrived, answers := scriptedEngine(t)
	var mu sync.Mutex
	var logged []string
	log := funcr.New(func(_, args string) {
		mu.Lock()
		defer mu.Unlock()
		if strings.Contains(args, `"path"="/metrics"`) {
			logged = append(logged, args)
		}
	}, funcr.Options{})
	ps, m := runScrapedPool(t, addr, scheduling.Deps{Log: log})
	<-arrived
	failures := func(reason string) (float64, bool) {
		return m.Sample("pd_extproc_endpoint_scrape_failures_total", map[string]string{"pool": "decode", "endpoint": addr, "reason": reason})
	}
	steps := []struct {
		name     string
		answer   engineAnswer
		want4xx  float64
		want5xx  float64
		wantLogs []string // substrings of the lines this scrape logged
	}{
		{"an auth proxy's 401", engineAnswer{401, "Unauthorized: no bearer token\n"}, 1, 0,
			[]string{`"msg"="cannot scrape the engine's metrics`, `"pool"="decode"`, `"endpoint"="` + addr + `"`, `"reason"="status_4xx"`, `answered 401: \"Unauthorized: no bearer token\"`}},
		{"a 404 next: counted, not logged", engineAnswer{404, "404 page not found\n"}, 2, 0, nil},
		{"the engine answers again", engineAnswer{200, goodScrape}, 2, 0,
			[]string{`"msg"="the engine's metrics answer again"`, `"endpoint"="` + addr + `"`, `"failures"=2`}},
		{"a 500: logged as the first failure since", engineAnswer{500, "Internal Server Error"}, 2, 1,
			[]string{`"msg"="cannot scrape the engine's metrics`, `"reason"="status_5xx"`, `answered 500: \"Internal Server Error\"`}},
	}
	for _, s := range steps {
		mu.Lock()
		before := len(logged)
		mu.Unlock()
		answers <- s.answer
		<-arrived // the next scrape waits: this one is counted and logged
		got4xx, _ := failures("status_4xx")
		got5xx, _ := failures("status_5xx")
		if got4xx != s.want4xx || got5xx != s.want5xx {
			t.Errorf("%s: scrape_failures_total status_4xx = %v, status_5xx = %v; want %v, %v", s.name, got4xx, got5xx, s.want4xx, s.want5xx)
		}
		mu.Lock()
		lines := slices.Clone(logged[before:])
		mu.Unlock()
		if len(lines) != min(1, len(s.wantLogs)) {
			t.Errorf("%s: logged %q; want %d line", s.name, lines, min(1, len(s.wantLogs)))
			continue
		}
		for _, want := range s.wantLogs {
			if !strings.Contains(lines[0], want) {
				t.Errorf("%s: logged %s; want it to hold %s", s.name, lines[0], want)
			}
		}
	}
	ps.Decode.Update(scheduling.PoolSpec{PoolScheduling: scrapedEvery})
	if v, ok := failures("status_4xx"); ok {
		t.Errorf("scrape_failures_total{reason=status_4xx} = %v after the endpoint left the pool; want no series", v)
	}
}

// engineAnswer is how scriptedEngine answers one scrape.
type engineAnswer struct {
	status int
	body   string
}

// goodScrape is an engine's /metrics with its queue and KV use.
const goodScrape = "vllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.25\n"

// scriptedEngine is an engine whose every /metrics scrape arrives (a send
// on arrived) and then waits for the test to say how it is answered.
func scriptedEngine(t *testing.T) (addr string, arrived chan struct{}, answers chan engineAnswer) {
	arrived, answers = make(chan struct{}), make(chan engineAnswer)
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		select {
		case arrived <- struct{}{}:
		case <-r.Context().Done():
			return
		}
		select {
		case a := <-answers:
			w.WriteHeader(a.status)
			fmt.Fprint(w, a.body)
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(engine.Close)
	return strings.TrimPrefix(engine.URL, "http://"), arrived, answers
}

// scrapedEvery scrapes a pool's engines every millisecond, each scrape
// waiting as long as the engine takes (scriptedEngine: the test).
var scrapedEvery = config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Millisecond), Timeout: config.Duration(time.Minute)}}

// runScrapedPool runs a decode pool of the engine at addr, scraped every
// millisecond, until the test ends, and a registry watching its endpoints.
func runScrapedPool(t *testing.T, addr string, deps scheduling.Deps) (*scheduling.Pools, *metrics.Metrics) {
	ps := scheduling.NewPools(scheduling.Spec{Decode: scheduling.PoolSpec{Endpoints: []string{addr}, PoolScheduling: scrapedEvery}}, deps)
	m := metrics.New("kv-nixl")
	m.WatchEndpoints(poolStates(ps.Decode))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { ps.Decode.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	return ps, m
}
