package scheduling

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/pd-extproc/pd-extproc/pkg/enginehttp"
)

// maxMetricsBytes bounds one /metrics answer; vLLM's is ~100 KiB.
const maxMetricsBytes = 8 << 20

// The gauges an engine reports its load with, by engine. Several series of one
// name (data-parallel ranks, models) add up for the queue; the fullest one
// counts for the KV cache.
var (
	waitingGauges = []string{"vllm:num_requests_waiting", "sglang:num_queue_reqs"}
	kvUsageGauges = []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"}
	runningGauges = []string{"vllm:num_requests_running", "sglang:num_running_reqs"}
)

// cacheSeries are how an engine reports its prefix cache: a series of its
// size (read by sizeOf), and the counters of its prompt tokens, of those its
// cache held (hits) and of its generated tokens, from which what it has
// written into the cache follows (Load.Written). hitsAppear: the hits
// counter first appears with a hit; else it is there from the start, and
// not at all when the engine runs no prefix cache.
type cacheSeries struct {
	size, prompt, hits, generation string
	hitsAppear                     bool
	sizeOf                         func(*dto.MetricFamily) float64
}

var engineCaches = []cacheSeries{
	// vLLM (vllm/v1/metrics/loggers.py): its size in the labels of an info
	// gauge (num_gpu_blocks of block_size tokens).
	{size: "vllm:cache_config_info", prompt: "vllm:prompt_tokens_total", hits: "vllm:prefix_cache_hits_total",
		generation: "vllm:generation_tokens_total", sizeOf: configuredTokens},
	// SGLang (python/sglang/srt/metrics/collector.py): its KV pool's size
	// in tokens, a gauge of each scheduler (poolTokens), and its tokenizer
	// manager's counters (observe_one_finished_request), the hits by
	// cache_source where the engine labels them (deviceHits).
	{size: "sglang:max_total_num_tokens", prompt: "sglang:prompt_tokens_total", hits: "sglang:cached_tokens_total",
		generation: "sglang:generation_tokens_total", hitsAppear: true, sizeOf: poolTokens},
}

// What a vLLM engine reports of its prefills as each request finishes
// (vllm/v1/metrics/loggers.py; update_from_finished_request,
// vllm/v1/metrics/stats.py): histograms of the prompt tokens each computed
// (its prefix cache did not hold them) and of the seconds from its first
// step to its first token. Their sums are read (Load.Computed,
// Load.Prefilling), not their buckets.
const (
	computedTokens = "vllm:request_prefill_kv_computed_tokens"
	prefillSeconds = "vllm:request_prefill_time_seconds"
)

// pdQueues are the queues an SGLang engine in P/D mode keeps apart from its
// waiting queue, by the role it plays (SGLang's
// python/sglang/srt/metrics/collector.py): a prefill's bootstrap queue (named
// …prealloc… before SGLang renamed it) and its in-flight transfers, a
// decode's preallocation and transfer queues. Each is a list of the names one
// queue has had, newest first; the queues of a pool's role add to Waiting.
var pdQueues = map[role][][]string{
	rolePrefill: {
		{"sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_prealloc_queue_reqs"},
		{"sglang:num_prefill_inflight_queue_reqs", "sglang:num_prefill_infight_queue_reqs"}, // misspelt in older releases
	},
	roleDecode: {
		{"sglang:num_decode_prealloc_queue_reqs"},
		{"sglang:num_decode_transfer_queue_reqs"},
	},
}

// scrapeAll reads every endpoint's /metrics concurrently (probeEach). A
// failed scrape leaves the old figures to go stale, no longer fresh; it is
// counted by reason, and logged when it is the first since the engine last
// answered, as is the answer that ends such a run.
func (p *Pool) scrapeAll(ctx context.Context, eps []*Endpoint, path string, timeout time.Duration) {
	probeEach(eps, func(e *Endpoint) {
		l, err := scrape(ctx, p.probe, p.probe.url(e.Addr, path), timeout)
		log := func() logr.Logger { return p.deps.Log.WithValues("pool", p.Name(), "endpoint", e.Addr, "path", path) }
		switch {
		case err == nil:
			l.At = p.deps.Now()
			if failed := e.observe(l); failed > 0 {
				log().Info("the engine's metrics answer again", "failures", failed)
			}
		case ctx.Err() != nil: // shutting down
		default:
			reason := failureOf(err)
			if e.scrapeFailed(reason) {
				log().Info("cannot scrape the engine's metrics: until it answers, it counts as loaded as the mean of the pool, "+
					"as saturated, and after metrics.stale_after as holding none of the prompts it was sent",
					"reason", ScrapeFailureReasons[reason], "error", err.Error())
			}
		}
	})
}

// scrapeFailure is why a scrape failed, an index of ScrapeFailureReasons.
type scrapeFailure uint8

const (
	scrapeConnect   scrapeFailure = iota // the engine could not be dialled
	scrapeTimeout                        // no answer within metrics.timeout
	scrapeTransport                      // the connection broke, or its TLS failed
	scrapeRedirect                       // a 3xx, never followed
	scrapeStatus4xx                      // a wrong metrics.path (404), an auth proxy (401, 403)
	scrapeStatus5xx
	scrapeMalformed // load series that do not parse, or a status no engine answers (1xx, a 2xx but 200)
	scrapeNoGauges  // an answer without the load gauges: not an engine's /metrics
	scrapeReasons
)

// ScrapeFailureReasons are the reason labels of failed scrapes
// (pd_extproc_endpoint_scrape_failures_total), by scrapeFailure.
var ScrapeFailureReasons = [scrapeReasons]string{"connect", "timeout", "transport", "redirect", "status_4xx", "status_5xx", "malformed", "no_gauges"}

var (
	errMalformed = errors.New("parsing metrics")
	errNoGauges  = errors.New("no load gauge")
)

// statusError is an answer other than 200: its status, and the start of its
// body, which says why (a proxy's, a 404 page).
type statusError struct {
	status int
	body   string
}

func (e statusError) Error() string { return fmt.Sprintf("answered %d: %q", e.status, e.body) }

// failureOf is why a scrape failed with err.
func failureOf(err error) scrapeFailure {
	var st statusError
	switch {
	case errors.As(err, &st):
		switch st.status / 100 {
		case 3:
			return scrapeRedirect
		case 4:
			return scrapeStatus4xx
		case 5:
			return scrapeStatus5xx
		}
		return scrapeMalformed
	case errors.Is(err, errMalformed):
		return scrapeMalformed
	case errors.Is(err, errNoGauges):
		return scrapeNoGauges
	}
	switch enginehttp.HowUnanswered(err) {
	case enginehttp.Unreached:
		return scrapeConnect
	case enginehttp.TimedOut:
		return scrapeTimeout
	}
	return scrapeTransport
}

func scrape(ctx context.Context, pr probe, url string, timeout time.Duration) (Load, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return Load{}, err
	}
	req.Header.Set("Accept", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
	resp, err := pr.client.Do(req)
	if err != nil {
		return Load{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		start, _ := io.ReadAll(io.LimitReader(resp.Body, 128))
		return Load{}, statusError{resp.StatusCode, strings.ToValidUTF8(strings.TrimSpace(string(start)), "")}
	}
	return parseLoad(io.LimitReader(resp.Body, maxMetricsBytes), pr.role)
}

// parseLoad reads the load gauges from the Prometheus text format, and the P/D
// queues of an engine in role ro. An answer without any of the load gauges is
// an error: the endpoint is not an engine we know, and reading it as idle
// would draw traffic to it.
func parseLoad(r io.Reader, ro role) (Load, error) {
	text, err := loadLines(r, ro)
	if err != nil {
		return Load{}, fmt.Errorf("reading metrics: %w", err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(bytes.NewReader(text))
	if err != nil {
		return Load{}, fmt.Errorf("%w: %w", errMalformed, err)
	}
	waiting, hasWaiting := firstOf(families, waitingGauges)
	kvUsage, hasKVUsage := firstOf(families, kvUsageGauges)
	if !hasWaiting && !hasKVUsage {
		return Load{}, fmt.Errorf("%w among %v %v", errNoGauges, waitingGauges, kvUsageGauges)
	}
	running, _ := firstOf(families, runningGauges)
	l := Load{Waiting: sum(waiting), Running: sum(running), KVUsage: min(1, maxOf(kvUsage))} // a missing family sums to 0
	for _, names := range pdQueues[ro] {
		if f, ok := firstOf(families, names); ok {
			l.Waiting += sum(f)
		}
	}
	l.CacheTokens, l.Written = cacheOf(families)
	l.Computed, l.Prefilling = sum(families[computedTokens]), sum(families[prefillSeconds])
	return l, nil
}

// cacheOf is the engine's cache in tokens and what it has written into it
// (Load.CacheTokens, Load.Written), summed over its series (data-parallel
// ranks); 0, 0 unless it reports them all, as vLLM or as SGLang does.
func cacheOf(families map[string]*dto.MetricFamily) (size, written float64) {
	for _, c := range engineCaches {
		if families[c.size] == nil || families[c.prompt] == nil || families[c.generation] == nil || families[c.hits] == nil && !c.hitsAppear {
			continue
		}
		if size = c.sizeOf(families[c.size]); size <= 0 {
			return 0, 0
		}
		return size, sum(families[c.prompt]) - deviceHits(families[c.hits]) + sum(families[c.generation])
	}
	return 0, 0
}

// configuredTokens is the size of vLLM's cache, from its CacheConfig's
// labels, its data-parallel ranks added up.
func configuredTokens(f *dto.MetricFamily) (size float64) {
	for _, m := range f.GetMetric() {
		blocks, _ := strconv.ParseFloat(labelOf(m, "num_gpu_blocks"), 64) // "None" before the engine has sized its cache
		tokens, _ := strconv.ParseFloat(labelOf(m, "block_size"), 64)
		size += blocks * tokens
	}
	return size
}

// poolTokens is the size of SGLang's KV pools: each data-parallel rank's
// once (the largest its tensor-parallel ranks report), added up.
func poolTokens(f *dto.MetricFamily) (size float64) {
	pools := map[string]float64{}
	for _, m := range f.GetMetric() {
		rank := labelOf(m, "dp_rank")
		pools[rank] = max(pools[rank], value(m))
	}
	for _, tokens := range pools {
		size += tokens
	}
	return size
}

// deviceHits are the prompt tokens the engine's own cache held: of a hits
// counter labelled by cache_source (SGLang's), the device's, as a hit in
// host memory or storage is written into the device's cache anew.
func deviceHits(f *dto.MetricFamily) (held float64) {
	for _, m := range f.GetMetric() {
		if source := labelOf(m, "cache_source"); source == "" || source == "device" {
			held += value(m)
		}
	}
	return held
}

// labelOf is the value of m's label name, "" when it has none.
func labelOf(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// loadLines are the lines of a Prometheus text answer about the series
// parseLoad reads: their samples and their HELP and TYPE comments. An
// engine's answer is some 100 KiB of histograms, whose whole parse took
// some 35 times as long and 100 times the memory (BenchmarkParseLoad).
func loadLines(r io.Reader, ro role) ([]byte, error) {
	var out []byte
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 0, 4<<10), maxMetricsBytes)
	for s.Scan() {
		line := s.Bytes()
		name := bytes.TrimLeft(line, " \t")                     // as the parser takes them: blanks before, tabs between
		if rest, ok := bytes.CutPrefix(name, []byte("#")); ok { // # HELP name ..., # TYPE name ...
			if f := bytes.Fields(rest); len(f) >= 2 {
				name = f[1]
			}
		}
		if i := bytes.IndexAny(name, "{ \t"); i >= 0 {
			name = name[:i]
		}
		if loadSeries(string(name), ro) {
			out = append(append(out, line...), '\n')
		}
	}
	return out, s.Err()
}

// loadSeries says whether parseLoad reads the series of that name for an
// engine in role ro: a histogram's sum, not its buckets.
func loadSeries(name string, ro role) bool {
	if slices.Contains(waitingGauges, name) || slices.Contains(kvUsageGauges, name) || slices.Contains(runningGauges, name) {
		return true
	}
	for _, c := range engineCaches {
		if name == c.size || name == c.prompt || name == c.hits || name == c.generation {
			return true
		}
	}
	if family, ok := strings.CutSuffix(name, "_sum"); ok {
		name = family
	}
	if name == computedTokens || name == prefillSeconds {
		return true
	}
	for _, names := range pdQueues[ro] {
		if slices.Contains(names, name) {
			return true
		}
	}
	return false
}

// firstOf is the family of the first of names that families has.
func firstOf(families map[string]*dto.MetricFamily, names []string) (*dto.MetricFamily, bool) {
	for _, name := range names {
		if f, ok := families[name]; ok {
			return f, true
		}
	}
	return nil, false
}

func value(m *dto.Metric) float64 {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetHistogram() != nil:
		return m.GetHistogram().GetSampleSum()
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
