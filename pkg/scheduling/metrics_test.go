package scheduling

import (
	"context"
	"fmt"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

func TestParseLoad(t *testing.T) {
	// An SGLang engine in P/D mode exports all four P/D queues, each role
	// filling its own (SGLang's metric names and labels).
	sglangPD := func(bootstrapName string, bootstrap, inflight, prealloc, transfer int) string {
		labels := `{engine_type="decode",model_name="m",pp_rank="0",tp_rank="0"}`
		return fmt.Sprintf("sglang:num_queue_reqs%s 4\nsglang:token_usage%s 0.25\n"+
			"sglang:%s%s %d\nsglang:num_prefill_inflight_queue_reqs%s %d\n"+
			"sglang:num_decode_prealloc_queue_reqs%s %d\nsglang:num_decode_transfer_queue_reqs%s %d\n",
			labels, labels, bootstrapName, labels, bootstrap, labels, inflight, labels, prealloc, labels, transfer)
	}
	tests := []struct {
		name    string
		text    string
		role    role
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
`, want: Load{Waiting: 7, Running: 30, KVUsage: 0.42}},
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
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 12
`, want: Load{Waiting: 4, Running: 12, KVUsage: 0.25}},
		{name: "SGLang prefill: its bootstrap and in-flight queues add up", role: rolePrefill,
			text: sglangPD("num_prefill_bootstrap_queue_reqs", 2, 3, 50, 60), want: Load{Waiting: 4 + 2 + 3, KVUsage: 0.25}},
		{name: "SGLang prefill, the bootstrap queue's older name", role: rolePrefill,
			text: sglangPD("num_prefill_prealloc_queue_reqs", 2, 3, 50, 60), want: Load{Waiting: 4 + 2 + 3, KVUsage: 0.25}},
		{name: "SGLang prefill, the in-flight queue's older, misspelt name", role: rolePrefill,
			text: strings.Replace(sglangPD("num_prefill_prealloc_queue_reqs", 2, 3, 50, 60), "inflight", "infight", 1), want: Load{Waiting: 4 + 2 + 3, KVUsage: 0.25}},
		{name: "SGLang prefill, both names: the newer counts once", role: rolePrefill,
			text: sglangPD("num_prefill_bootstrap_queue_reqs", 2, 3, 50, 60) + "sglang:num_prefill_prealloc_queue_reqs 7\n", want: Load{Waiting: 4 + 2 + 3, KVUsage: 0.25}},
		{name: "SGLang decode: its prealloc and transfer queues add up", role: roleDecode,
			text: sglangPD("num_prefill_bootstrap_queue_reqs", 20, 30, 5, 6), want: Load{Waiting: 4 + 5 + 6, KVUsage: 0.25}},
		{name: "a pool of no role counts no P/D queue", role: roleUnknown,
			text: sglangPD("num_prefill_bootstrap_queue_reqs", 2, 3, 5, 6), want: Load{Waiting: 4, KVUsage: 0.25}},
		{name: "P/D queues alone are not an engine we know", role: roleDecode,
			text: "sglang:num_decode_prealloc_queue_reqs 3\n", wantErr: true},
		{name: "tabs and leading blanks, as the text format allows", text: "  vllm:num_requests_waiting\t7\n# TYPE\tvllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc\t{engine=\"0\"} 0.5\n",
			want: Load{Waiting: 7, KVUsage: 0.5}},
		{name: "vLLM's cache: its size and what it wrote (prompt less hits, plus generated)", text: vllmCache(`num_gpu_blocks="661"`, true),
			want: Load{Waiting: 2, KVUsage: 0.5, CacheTokens: 661 * 16, Written: 9000 - 4000 + 1500}},
		{name: "vLLM's cache before the engine has sized it", text: vllmCache(`num_gpu_blocks="None"`, true), want: Load{Waiting: 2, KVUsage: 0.5}},
		{name: "vLLM's cache without the hits counter (prefix caching off)", text: vllmCache(`num_gpu_blocks="661"`, false), want: Load{Waiting: 2, KVUsage: 0.5}},
		{name: "vLLM's cache, data-parallel ranks add up", text: vllmCache(`num_gpu_blocks="661"`, true) +
			"vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"339\"} 1.0\nvllm:prompt_tokens_total{engine=\"1\"} 100\n",
			want: Load{Waiting: 2, KVUsage: 0.5, CacheTokens: 1000 * 16, Written: 9100 - 4000 + 1500}},
		{name: "vLLM's prefills: the computed tokens' and prefill seconds' sums, ranks added, buckets not read", text: `vllm:num_requests_waiting 1
# HELP vllm:request_prefill_kv_computed_tokens Histogram of new KV tokens computed during prefill (excluding cached tokens).
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="1.0",model_name="m"} 0
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="+Inf",model_name="m"} 12
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 12
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 48000
vllm:request_prefill_kv_computed_tokens_sum{engine="1",model_name="m"} 2000
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 12
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 12
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 4.5
vllm:request_prefill_time_seconds_sum{engine="1",model_name="m"} 0.5
`, want: Load{Waiting: 1, Computed: 50000, Prefilling: 5}},
		{name: "SGLang's cache: each data-parallel rank's pool once, and what it wrote (prompt less device hits, plus generated)",
			text: sglangCache(true) + `sglang:cached_tokens_total{cache_source="device",model_name="m"} 4000
sglang:cached_tokens_total{cache_source="host",model_name="m"} 1000
`, want: Load{Waiting: 1, CacheTokens: 50000 + 40000, Written: 9000 - 4000 + 1500}},
		{name: "SGLang's cache, hits without a source (older releases)", text: sglangCache(true) + "sglang:cached_tokens_total{model_name=\"m\"} 4000\n",
			want: Load{Waiting: 1, CacheTokens: 50000 + 40000, Written: 9000 - 4000 + 1500}},
		{name: "SGLang's cache before its first hit: no hits counter yet", text: sglangCache(true),
			want: Load{Waiting: 1, CacheTokens: 50000 + 40000, Written: 9000 + 1500}},
		{name: "SGLang's cache before its first request: no counters yet", text: sglangCache(false), want: Load{Waiting: 1}},
		{name: "KV use above 1 is clamped", text: "vllm:kv_cache_usage_perc 1.7\n", want: Load{KVUsage: 1}},
		{name: "not an engine we know", text: "process_cpu_seconds_total 12\n", wantErr: true},
		{name: "not the text format", text: "<html>", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseLoad(strings.NewReader(tt.text), tt.role)
			if (err != nil) != tt.wantErr {
				t.Fatalf("parseLoad() error = %v, wantErr %v", err, tt.wantErr)
			}
			if got != tt.want {
				t.Errorf("parseLoad() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// sglangCache is an SGLang answer with its pools (two data-parallel ranks,
// the first of two tensor-parallel ranks) and, with counters, its prompt and
// generation counters as prometheus_client prints them; no hits counter.
func sglangCache(counters bool) string {
	text := `sglang:num_queue_reqs{model_name="m"} 1
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{dp_rank="0",model_name="m",tp_rank="0"} 50000
sglang:max_total_num_tokens{dp_rank="0",model_name="m",tp_rank="1"} 50000
sglang:max_total_num_tokens{dp_rank="1",model_name="m",tp_rank="0"} 40000
`
	if counters {
		text += `# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens counter
sglang:prompt_tokens_total{model_name="m"} 9000
sglang:prompt_tokens_created{model_name="m"} 1.7e+09
# TYPE sglang:generation_tokens counter
sglang:generation_tokens_total{model_name="m"} 1500
`
	}
	return text
}

// vllmCache is a vLLM answer with its cache's size and counters as
// prometheus_client prints them (an info gauge, counters with their _total
// and _created), the hits counter left out unless hits.
func vllmCache(blocks string, hits bool) string {
	text := `vllm:num_requests_waiting{engine="0"} 2
vllm:kv_cache_usage_perc{engine="0"} 0.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",` + blocks + `} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 9000.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1500.0
`
	if hits {
		text += `# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 4000.0
`
	}
	return text
}

func TestScrapedLoadCountsUntilStale(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte("vllm:num_requests_waiting 5\nvllm:kv_cache_usage_perc 0.5\n"))
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, addr)
	e := p.Endpoints()[0]
	acquire(e)
	busy := func() float64 { return busyness(p.Endpoints())[0].busy }

	if got := busy(); got != 1 {
		t.Fatalf("busyness before any scrape = %g, want the 1 request in flight", got)
	}
	p.scrapeAll(context.Background(), p.Endpoints(), "/metrics", time.Second)
	if got := busy(); got != 6.5 {
		t.Fatalf("busyness after a scrape = %g, want 1 in flight + 5 waiting + 0.5 KV", got)
	}
	clock.Advance(3 * time.Second) // stale_after defaults to 3 intervals
	if got := busy(); got != 6.5 {
		t.Fatalf("busyness at the staleness limit = %g, want 6.5", got)
	}
	clock.Advance(time.Millisecond)
	if got := busy(); got != 1 {
		t.Fatalf("busyness with a stale scrape = %g, want 1", got)
	}
}

// TestFailedScrapeKeepsOldFigures: after a failed scrape the engine's last
// counters still tell what its cache holds, until stale_after; its queue is
// no longer read as fresh.
func TestFailedScrapeKeepsOldFigures(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "nope", http.StatusInternalServerError)
	}))
	defer srv.Close()
	p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, strings.TrimPrefix(srv.URL, "http://"))
	e := p.Endpoints()[0]
	e.observe(Load{Waiting: 2, CacheTokens: 1000, Written: 5000, At: clock.Now()})
	p.scrapeAll(context.Background(), p.Endpoints(), "/metrics", time.Second)
	if since, ok, stale := e.cacheWindow(); !ok || stale || since != (stamp{written: 4000}) {
		t.Errorf("cacheWindow() = %+v, %v, %v after a failed scrape; want the previous counters' {4000 0}, true, false", since, ok, stale)
	}
	if l, ok := e.Fresh(); ok {
		t.Errorf("Fresh() = %+v, true after a failed scrape; want none", l)
	}
}

// TestScrapeFailuresByReason: each way an engine's /metrics fails is
// counted under its reason, scrape after scrape, and logged once, at the
// first, with what the engine answered. An engine whose /metrics has never
// answered so is stale once stale_after has passed since its first failed
// scrape: it holds nothing by memory (cacheWindow), as one whose answers
// went stale.
func TestScrapeFailuresByReason(t *testing.T) {
	answering := func(status int, body string) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) { http.Error(w, body, status) }
	}
	tests := []struct {
		name    string
		handler http.HandlerFunc // nil: the port refuses
		reason  string
		logged  string // in the log line's error
	}{
		{"401 from an auth proxy", answering(http.StatusUnauthorized, "no bearer token"), "status_4xx", `answered 401: \"no bearer token\"`},
		{"wrong metrics.path", http.NotFound, "status_4xx", `answered 404: \"404 page not found\"`},
		{"an engine failing", answering(http.StatusServiceUnavailable, "boom"), "status_5xx", `answered 503: \"boom\"`},
		{"a redirect, not followed", http.RedirectHandler("/metrics/", http.StatusTemporaryRedirect).ServeHTTP, "redirect", "answered 307"},
		{"a page that is not an engine's metrics", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("<html>login</html>\n")) },
			"no_gauges", "no load gauge"},
		{"load gauges that do not parse", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("vllm:num_requests_waiting many\n")) },
			"malformed", "parsing metrics"},
		{"no answer within metrics.timeout", func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() },
			"timeout", "deadline exceeded"},
		{"the connection cut", func(w http.ResponseWriter, _ *http.Request) {
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		}, "transport", "EOF"},
		{"refused", nil, "connect", "refused"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(tt.handler)
			defer srv.Close()
			if tt.handler == nil {
				srv.Close()
			}
			var mu sync.Mutex
			var lines []string
			p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, strings.TrimPrefix(srv.URL, "http://"))
			p.deps.Log = funcr.New(func(_, args string) {
				mu.Lock()
				defer mu.Unlock()
				lines = append(lines, args)
			}, funcr.Options{})
			e, start := p.Endpoints()[0], clock.Now()
			for range 3 { // the first at once, then every interval
				p.scrapeAll(context.Background(), p.Endpoints(), "/metrics", 100*time.Millisecond)
				if _, _, stale := e.cacheWindow(); stale {
					t.Fatalf("stale %v after the first failed scrape, within stale_after (3s)", clock.Now().Sub(start))
				}
				clock.Advance(time.Second)
			}
			clock.Advance(time.Second)
			if _, _, stale := e.cacheWindow(); !stale {
				t.Errorf("not stale %v after the first failed scrape, past stale_after (3s)", clock.Now().Sub(start))
			}
			if got, want := e.ScrapeFailures(), map[string]uint64{tt.reason: 3}; !maps.Equal(got, want) {
				t.Errorf("ScrapeFailures() = %v after 3 failed scrapes; want %v", got, want)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(lines) != 1 {
				t.Fatalf("logged %q; want 1 line", lines)
			}
			for _, want := range []string{`"msg"="cannot scrape the engine's metrics`, `"pool"="decode"`, `"path"="/metrics"`, `"reason"="` + tt.reason + `"`, tt.logged} {
				if !strings.Contains(lines[0], want) {
					t.Errorf("logged %s; want it to hold %s", lines[0], want)
				}
			}
		})
	}
}

// A decode endpoint whose SGLang P/D queues are full is passed over, though
// its waiting queue is as short as the other's; the prefill queues the other
// reports (an engine exports all four) do not count against a decode.
func TestBusySGLangDecodeEndpointIsAvoided(t *testing.T) {
	serve := func(text string) string {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte(text)) }))
		t.Cleanup(srv.Close)
		return strings.TrimPrefix(srv.URL, "http://")
	}
	busy := serve("sglang:num_queue_reqs 0\nsglang:token_usage 0.1\nsglang:num_prefill_bootstrap_queue_reqs 0\n" +
		"sglang:num_decode_prealloc_queue_reqs 3\nsglang:num_decode_transfer_queue_reqs 2\n")
	idle := serve("sglang:num_queue_reqs 0\nsglang:token_usage 0.1\nsglang:num_prefill_bootstrap_queue_reqs 9\n" +
		"sglang:num_decode_prealloc_queue_reqs 0\nsglang:num_decode_transfer_queue_reqs 0\n")
	scraped := config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Minute)}}
	// intn 0: least-load compares the first two candidates and keeps the first on a tie.
	ps := NewPools(Spec{Decode: PoolSpec{Endpoints: []string{busy, idle}, PoolScheduling: scraped}}, Deps{intn: func(int) int { return 0 }})
	if e, _ := ps.Decode.Select(nil); e.Addr != busy {
		t.Fatalf("before any scrape the pick is %s; want the first endpoint, %s, on the tie", e.Addr, busy)
	}
	ps.Decode.scrapeAll(context.Background(), ps.Decode.Endpoints(), "/metrics", time.Second)
	if e, _ := ps.Decode.Select(nil); e.Addr != idle {
		t.Errorf("after the scrape the pick is %s; want %s, whose P/D queues are empty (busyness %+v)",
			e.Addr, idle, busyness(ps.Decode.Endpoints()))
	}
}

// BenchmarkParseLoad reads the load out of an answer the size of vLLM's
// /metrics (some 100 KiB, most of it histograms), as every scrape does.
//
//	go test -run '^$' -bench ParseLoad ./pkg/scheduling/
func BenchmarkParseLoad(b *testing.B) {
	var text strings.Builder
	for f := range 24 {
		fmt.Fprintf(&text, "# HELP vllm:histogram_%d A histogram.\n# TYPE vllm:histogram_%d histogram\n", f, f)
		for bucket := range 40 {
			fmt.Fprintf(&text, "vllm:histogram_%d_bucket{engine=\"0\",le=\"%d.0\",model_name=\"Qwen/Qwen3-8B\"} %d\n", f, bucket, bucket*17)
		}
		fmt.Fprintf(&text, "vllm:histogram_%d_sum{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 123.5\nvllm:histogram_%d_count{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 680\n", f, f)
	}
	text.WriteString("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 7\n" +
		"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 0.42\n")
	answer := text.String()
	b.SetBytes(int64(len(answer)))
	b.ReportAllocs()
	for b.Loop() {
		if l, err := parseLoad(strings.NewReader(answer), roleDecode); err != nil || l.Waiting != 7 {
			b.Fatal(l, err)
		}
	}
}

// TestRewriteIsReadFromTheLastScrapes: how long an engine takes to write its
// cache over is its cache's size over the pace of its written counter
// (vLLM's), read over the last 15 to 30 seconds of scrapes, not since the
// engine started; scrapes over less than 15 s (since the first, or since a
// restart), a stale scrape or a cache that does not say its size tell
// nothing, nor does a scrape that failed before the first answer. vLLM's
// written figure may go back a while without a restart (restarted): that
// keeps the scrapes read so far.
func TestRewriteIsReadFromTheLastScrapes(t *testing.T) {
	type scrape struct {
		at      int     // seconds from the first
		written float64 // the engine's counter, tokens
		prefill float64 // vLLM's prefill sums (Computed, Prefilling), which only grow; 0: not reported
	}
	tests := []struct {
		name    string
		size    float64 // tokens; 0: not reported
		scrapes []scrape
		failed  bool          // a scrape failed before the first answer
		later   time.Duration // the clock past the last scrape
		want    float64       // seconds
		ok      bool
	}{
		{name: "no scrape"},
		{name: "one scrape", size: 9000, scrapes: []scrape{{0, 0, 0}}},
		{name: "scraped over less than 15 s", size: 9000, scrapes: []scrape{{0, 0, 0}, {1, 900, 0}, {14, 1000, 0}}},
		{name: "scraped over 15 s", size: 9000, scrapes: []scrape{{0, 0, 0}, {1, 900, 0}, {15, 1500, 0}}, want: 90, ok: true},
		{name: "slow lately, fast at first", size: 9000, scrapes: []scrape{{0, 0, 0}, {15, 9000, 0}, {30, 9100, 0}, {31, 9110, 0}}, want: 9000.0 / 110 * 16, ok: true},
		{name: "written nothing", size: 9000, scrapes: []scrape{{0, 500, 0}, {15, 500, 0}}, want: math.Inf(1), ok: true},
		{name: "restarted", size: 9000, scrapes: []scrape{{0, 5000, 0}, {15, 9000, 0}, {16, 100, 0}}},
		{name: "restarted, then scraped 15 s", size: 9000, scrapes: []scrape{{0, 5000, 0}, {15, 9000, 0}, {16, 100, 0}, {31, 1000, 0}}, want: 150, ok: true},
		{name: "vLLM's written figure back a while", size: 9000, scrapes: []scrape{{0, 0, 1}, {15, 1500, 2}, {16, 1400, 3}}, want: 9000.0 / 1400 * 16, ok: true},
		{name: "vLLM's written figure back below the older mark", size: 9000, scrapes: []scrape{{0, 0, 1}, {15, 1500, 2}, {30, 3000, 3}, {31, 1400, 4}}},
		{name: "vLLM restarted", size: 9000, scrapes: []scrape{{0, 0, 1}, {15, 1500, 2}, {16, 1400, 0.5}}},
		{name: "the last scrape stale", size: 9000, scrapes: []scrape{{0, 0, 0}, {15, 900, 0}}, later: 4 * time.Second},
		{name: "the cache's size not reported", scrapes: []scrape{{0, 0, 0}, {15, 900, 0}}},
		{name: "failed before the first answer, then one scrape", size: 9000, failed: true, scrapes: []scrape{{20, 900, 0}}},
		{name: "failed before the first answer, then scraped over 15 s", size: 9000, failed: true, scrapes: []scrape{{20, 900, 0}, {35, 1500, 0}}, want: 225, ok: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{
				Interval: config.Duration(time.Second), StaleAfter: config.Duration(3 * time.Second)}}, "10.0.0.1:8000")
			e := p.Endpoints()[0]
			start := clock.Now()
			if tt.failed {
				e.scrapeFailed(scrapeTimeout)
			}
			for _, s := range tt.scrapes {
				clock.Advance(start.Add(time.Duration(s.at) * time.Second).Sub(clock.Now()))
				e.observe(Load{CacheTokens: tt.size, Written: s.written, Computed: s.prefill, Prefilling: s.prefill, At: clock.Now()})
			}
			clock.Advance(tt.later)
			got, ok := e.scrapedAt(clock.Now).rewrite()
			if ok != tt.ok || math.Abs(got-tt.want) > 1e-9 && !math.IsInf(tt.want, 1) || math.IsInf(tt.want, 1) != math.IsInf(got, 1) {
				t.Errorf("rewrite() = %g s, %v; want %g s, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}
