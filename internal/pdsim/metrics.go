package pdsim

import (
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

const (
	blockSize = 16 // tokens per KV block, vLLM's default
	// kvCapacityBlocks is the simulated GPU's KV cache by default
	// (Config.KVBlocks), and what its prefix cache keeps by default
	// (Config.PrefixCacheBlocks): vLLM caches prefixes in the blocks no
	// running request holds.
	kvCapacityBlocks = 8192
)

func blocksFor(tokens int) int64 { return int64((tokens + blockSize - 1) / blockSize) }

// metrics holds the live load a router's scorers read from /metrics, and
// what the KV cache holds.
type metrics struct {
	waiting, running atomic.Int64
	blocks           atomic.Int64 // held by running requests and by issued NIXL blocks
	capacity         int          // the KV cache's blocks (Config.KVBlocks)
	queues           atomic.Pointer[Queues]
	// cache holds the blocks computed here or received from another engine:
	// the prefix cache behind usage.prompt_tokens_details.cached_tokens.
	cache *prefixCache
	// prefixQueries and prefixHits are the prompt tokens looked up in cache
	// and found there, vLLM's prefix_cache_queries and prefix_cache_hits.
	prefixQueries, prefixHits atomic.Int64
	// promptTokens and generationTokens are the prompt tokens of the
	// requests whose first token was made (computed here or received) and
	// the tokens generated, vLLM's prompt_tokens and generation_tokens.
	promptTokens, generationTokens atomic.Int64
	// finishedRequests, computedTokens and prefillNanos are what vLLM's
	// request_prefill_kv_computed_tokens and request_prefill_time_seconds
	// histograms count and sum as each request finishes: the prompt tokens
	// it computed, its prefix cache not holding them, and the time from
	// its first step to its first token.
	finishedRequests, computedTokens, prefillNanos atomic.Int64
}

// finished records a request that ended, as vLLM's prefill histograms do.
func (m *metrics) finished(computed int, prefill time.Duration) {
	m.finishedRequests.Add(1)
	m.computedTokens.Add(int64(computed))
	m.prefillNanos.Add(int64(prefill))
}

// Queues are what an engine reports queued beyond its own requests, set by a
// test (Server.SetQueues) to stand for a busy engine: load that did not come
// through the router.
type Queues struct {
	Waiting int // added to its waiting queue (vllm:num_requests_waiting, sglang:num_queue_reqs)
	// The queues an SGLang engine in P/D mode reports beside its waiting queue.
	PrefillBootstrap, PrefillInflight int // a prefill's
	DecodePrealloc, DecodeTransfer    int // a decode's
}

// phase tracks one request: waiting (fault delay, remote KV, bootstrap
// handshake) until it computes or generates, then running until it ends.
type phase struct {
	m       *metrics
	blocks  int64
	running bool
}

func (m *metrics) enter() *phase {
	m.waiting.Add(1)
	return &phase{m: m}
}

func (p *phase) run() {
	if p == nil || p.running {
		return
	}
	p.running = true
	p.m.waiting.Add(-1)
	p.m.running.Add(1)
	p.m.blocks.Add(p.blocks)
}

func (p *phase) exit() {
	if p.running {
		p.m.running.Add(-1)
		p.m.blocks.Add(-p.blocks)
		return
	}
	p.m.waiting.Add(-1)
}

var labelEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)

// gauge is one series of the exposition (a counter's too).
type gauge struct {
	name, help string
	value      float64
}

// serve writes the gauges in Prometheus text format under the engine's names:
// vLLM's, or SGLang's with the labels its scheduler sets and its P/D queues.
func (m *metrics) serve(model, protocol, role string) http.HandlerFunc {
	name := labelEscaper.Replace(model)
	labels := fmt.Sprintf(`{engine="0",model_name="%s"}`, name)
	if protocol == ProtocolSGLang {
		labels = fmt.Sprintf(`{engine_type="%s",model_name="%s",pp_rank="0",tp_rank="0"}`, role, name)
	}
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		usage := min(1, float64(m.blocks.Load())/float64(m.capacity))
		var q Queues
		if p := m.queues.Load(); p != nil {
			q = *p
		}
		waiting := float64(m.waiting.Load() + int64(q.Waiting))
		var gauges []gauge
		if protocol != ProtocolSGLang {
			gauges = []gauge{
				{"vllm:num_requests_running", "Number of requests in model execution batches.", float64(m.running.Load())},
				{"vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting},
				{"vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage},
			}
		} else {
			gauges = []gauge{
				{"sglang:num_running_reqs", "The number of running requests.", float64(m.running.Load())},
				{"sglang:num_queue_reqs", "The number of requests in the waiting queue.", waiting},
				{"sglang:token_usage", "The token usage.", usage},
				{"sglang:num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue.", float64(q.PrefillBootstrap)},
				{"sglang:num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue.", float64(q.PrefillInflight)},
				{"sglang:num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.", float64(q.DecodePrealloc)},
				{"sglang:num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue.", float64(q.DecodeTransfer)},
			}
		}
		write := func(kind, labels string, series []gauge) {
			for _, g := range series {
				fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n%s%s %g\n", g.name, g.help, g.name, kind, g.name, labels, g.value)
			}
		}
		write("gauge", labels, gauges)
		if protocol != ProtocolSGLang {
			// Named as prometheus_client prints a Counter, with its _total.
			write("counter", labels, []gauge{
				{"vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", float64(m.prefixQueries.Load())},
				{"vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", float64(m.prefixHits.Load())},
				{"vllm:prompt_tokens_total", "Number of prefill tokens processed.", float64(m.promptTokens.Load())},
				{"vllm:generation_tokens_total", "Number of generation tokens processed.", float64(m.generationTokens.Load())},
			})
			// The histograms' buckets are left out but the last: a router reads
			// their sums.
			n := m.finishedRequests.Load()
			for _, h := range []gauge{
				{"vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill (excluding cached tokens).", float64(m.computedTokens.Load())},
				{"vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", time.Duration(m.prefillNanos.Load()).Seconds()},
			} {
				fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s histogram\n%s_bucket{engine=\"0\",le=\"+Inf\",model_name=\"%s\"} %d\n%s_sum%s %g\n%s_count%s %d\n",
					h.name, h.help, h.name, h.name, name, n, h.name, labels, h.value, h.name, labels, n)
			}
			// The KV cache's size, in the labels of an info gauge as vLLM
			// prints its CacheConfig: all of the GPU's blocks (Config.KVBlocks),
			// of which its prefix cache keeps those no running request holds.
			fmt.Fprintf(w, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"+
				"vllm:cache_config_info{block_size=\"%d\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"%d\"} 1.0\n", blockSize, m.capacity)
			return
		}
		// SGLang's KV pool in tokens, a gauge of its scheduler, and the
		// token counters of its tokenizer manager, labelled by model only.
		write("gauge", labels, []gauge{{"sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", float64(m.capacity * blockSize)}})
		write("counter", fmt.Sprintf(`{model_name="%s"}`, name), []gauge{
			{"sglang:prompt_tokens_total", "Number of prefill tokens processed.", float64(m.promptTokens.Load())},
			{"sglang:cached_tokens_total", "Number of cached prompt tokens.", float64(m.prefixHits.Load())},
			{"sglang:generation_tokens_total", "Number of generation tokens processed.", float64(m.generationTokens.Load())},
		})
	}
}

// SetQueues sets what the engine reports queued beyond its own requests
// from now on.
func (s *Server) SetQueues(q Queues) { s.metrics.queues.Store(&q) }
