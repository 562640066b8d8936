package scheduling

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

func TestParseLoad(t *testing.T) {
	tests := []struct {
		name    string
		text    string
		want    Load
		wantErr bool
	}{
		{name: "vLLM", text: `# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 30
`, want: Load{Waiting: 7, KVUsage: 0.42}},
		{name: "vLLM data-parallel ranks: queues add up, the fullest cache counts", text: `vllm:num_requests_waiting{engine="0"} 2
vllm:num_requests_waiting{engine="1"} 3
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.9
`, want: Load{Waiting: 5, KVUsage: 0.9}},
		{name: "older vLLM name for KV use", text: "vllm:num_requests_waiting 1\nvllm:gpu_cache_usage_perc 0.5\n", want: Load{Waiting: 1, KVUsage: 0.5}},
		{name: "SGLang", text: `# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 4
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.25
`, want: Load{Waiting: 4, KVUsage: 0.25}},
		{name: "KV use above 1 is clamped", text: "vllm:kv_cache_usage_perc 1.7\n", want: Load{KVUsage: 1}},
		{name: "not an engine we know", text: "process_cpu_seconds_total 12\n", wantErr: true},
		{name: "not the text format", text: "<html>", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseLoad(strings.NewReader(tt.text))
			if (err != nil) != tt.wantErr {
				t.Fatalf("parseLoad() error = %v, wantErr %v", err, tt.wantErr)
			}
			if got != tt.want {
				t.Errorf("parseLoad() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestScrapedLoadCountsUntilStale(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte("vllm:num_requests_waiting 5\nvllm:kv_cache_usage_perc 0.5\n"))
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, addr)
	e := p.Endpoints()[0]
	e.Acquire()

	if got := e.Busyness(); got != 1 {
		t.Fatalf("Busyness() before any scrape = %g, want the 1 request in flight", got)
	}
	scrapeAll(context.Background(), srv.Client(), p.Endpoints(), "/metrics", time.Second, clock.Now)
	if got := e.Busyness(); got != 6.5 {
		t.Fatalf("Busyness() after a scrape = %g, want 1 in flight + 5 waiting + 0.5 KV", got)
	}
	clock.Advance(3 * time.Second) // stale_after defaults to 3 intervals
	if got := e.Busyness(); got != 6.5 {
		t.Fatalf("Busyness() at the staleness limit = %g, want 6.5", got)
	}
	clock.Advance(time.Millisecond)
	if got := e.Busyness(); got != 1 {
		t.Fatalf("Busyness() with a stale scrape = %g, want 1", got)
	}
}

func TestFailedScrapeKeepsOldFigures(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "nope", http.StatusInternalServerError)
	}))
	defer srv.Close()
	p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, strings.TrimPrefix(srv.URL, "http://"))
	e := p.Endpoints()[0]
	e.observe(Load{Waiting: 2, At: clock.Now()})
	scrapeAll(context.Background(), srv.Client(), p.Endpoints(), "/metrics", time.Second, clock.Now)
	if l, ok := e.Load(); !ok || l.Waiting != 2 {
		t.Fatalf("Load() = %+v, %v after a failed scrape; want the previous figures", l, ok)
	}
}
