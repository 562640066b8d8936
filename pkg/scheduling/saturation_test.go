package scheduling

import (
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// A pool is saturated while every healthy endpoint a request may go to is,
// by its engine's scraped figures (queue at or above the line, KV use at or
// above it, or no fresh figure: stale, or its last scrape failed), as the
// Inference Extension judges a pool.
func TestAPoolIsSaturatedWhileEveryEndpointItMayUseIs(t *testing.T) {
	const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
	type load struct {
		waiting, kv float64
		none        bool // never scraped
		old         bool // scraped before stale_after
		failed      bool // its scrape since failed
	}
	tests := []struct {
		name   string
		a, b   load
		eject  bool   // a is ejected
		subset string // the request's subset hint
		want   bool
	}{
		{name: "both queues at the line", a: load{waiting: 5}, b: load{waiting: 7}, want: true},
		{name: "one queue below it", a: load{waiting: 4}, b: load{waiting: 7}, want: false},
		{name: "KV use at its line, a queue at the other", a: load{kv: 0.8}, b: load{waiting: 5}, want: true},
		{name: "KV use below its line", a: load{kv: 0.79}, b: load{waiting: 5}, want: false},
		{name: "an engine never scraped", a: load{none: true}, b: load{waiting: 5}, want: true},
		{name: "an engine whose figures are stale", a: load{old: true}, b: load{waiting: 5}, want: true},
		{name: "an idle engine whose scrape since failed", a: load{failed: true}, b: load{waiting: 5}, want: true},
		{name: "the idle engine is ejected", a: load{}, b: load{waiting: 5}, eject: true, want: true},
		{name: "the idle engine is outside the subset hint", a: load{}, b: load{waiting: 5}, subset: b, want: true},
		{name: "no endpoint may be used", a: load{waiting: 5}, b: load{waiting: 5}, subset: "10.0.0.9:8000", want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, a, b)
			for addr, l := range map[string]load{a: tt.a, b: tt.b} {
				at := clock.Now()
				if l.old {
					at = at.Add(-time.Hour)
				}
				if !l.none {
					byAddr(p, addr).observe(Load{Waiting: l.waiting, KVUsage: l.kv, At: at})
				}
				if l.failed {
					byAddr(p, addr).scrapeFailed(scrapeTimeout)
				}
			}
			if tt.eject {
				for range 3 {
					byAddr(p, a).ReportFailure()
				}
			}
			req := promptRequest("hello")
			if tt.subset != "" {
				req.Subset = ParseSubset([]string{tt.subset})
			}
			if got := p.Saturated(req, Lines{config.DefaultSaturatedQueue, config.DefaultSaturatedKVCache}); got != tt.want {
				t.Errorf("saturated: %v, want %v", got, tt.want)
			}
		})
	}
}
