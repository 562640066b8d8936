package scheduling

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// maxMetricsBytes bounds one /metrics answer; vLLM's is ~100 KiB.
const maxMetricsBytes = 8 << 20

// The gauges an engine reports its load with, by engine. Several series of one
// name (data-parallel ranks, models) add up for the queue; the fullest one
// counts for the KV cache.
var (
	waitingGauges = []string{"vllm:num_requests_waiting", "sglang:num_queue_reqs"}
	kvUsageGauges = []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"}
)

// scrapeAll reads every endpoint's /metrics concurrently. A failed scrape
// leaves the old figures to go stale.
func scrapeAll(ctx context.Context, client *http.Client, eps []*Endpoint, path string, timeout time.Duration, now func() time.Time) {
	var wg sync.WaitGroup
	for _, e := range eps {
		wg.Go(func() {
			if l, err := scrape(ctx, client, "http://"+e.Addr+path, timeout); err == nil {
				l.At = now()
				e.observe(l)
			}
		})
	}
	wg.Wait()
}

func scrape(ctx context.Context, client *http.Client, url string, timeout time.Duration) (Load, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return Load{}, err
	}
	req.Header.Set("Accept", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
	resp, err := client.Do(req)
	if err != nil {
		return Load{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return Load{}, fmt.Errorf("%s answered %d", url, resp.StatusCode)
	}
	return parseLoad(io.LimitReader(resp.Body, maxMetricsBytes))
}

// parseLoad reads the load gauges from the Prometheus text format. An answer
// without any of them is an error: the endpoint is not an engine we know, and
// reading it as idle would draw traffic to it.
func parseLoad(r io.Reader) (Load, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(r)
	if err != nil {
		return Load{}, fmt.Errorf("parsing metrics: %w", err)
	}
	var l Load
	found := false
	for _, name := range waitingGauges {
		if f, ok := families[name]; ok {
			l.Waiting, found = sum(f), true
			break
		}
	}
	for _, name := range kvUsageGauges {
		if f, ok := families[name]; ok {
			l.KVUsage, found = min(1, maxOf(f)), true
			break
		}
	}
	if !found {
		return Load{}, fmt.Errorf("no load gauge among %v %v", waitingGauges, kvUsageGauges)
	}
	return l, nil
}

func value(m *dto.Metric) float64 {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	}
	return 0
}

func sum(f *dto.MetricFamily) float64 {
	var s float64
	for _, m := range f.GetMetric() {
		s += value(m)
	}
	return s
}

func maxOf(f *dto.MetricFamily) float64 {
	var v float64
	for _, m := range f.GetMetric() {
		v = max(v, value(m))
	}
	return v
}
