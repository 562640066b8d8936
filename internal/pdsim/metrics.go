package pdsim

import (
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
)

const (
	blockSize = 16 // tokens per KV block, vLLM's default
	// kvCapacityBlocks is the simulated GPU's KV cache, and so by default what
	// its prefix cache keeps (Config.PrefixCacheBlocks): vLLM caches prefixes
	// in the blocks no running request holds.
	kvCapacityBlocks = 8192
)

func blocksFor(tokens int) int64 { return int64((tokens + blockSize - 1) / blockSize) }

// metrics holds the live load a router's scorers read from /metrics, and
// what the KV cache holds.
type metrics struct {
	waiting, running atomic.Int64
	blocks           atomic.Int64 // held by running requests and by issued NIXL blocks
	pdQueues         atomic.Pointer[PDQueues]
	// cache holds the blocks computed here or received from another engine:
	// the prefix cache behind usage.prompt_tokens_details.cached_tokens.
	cache *prefixCache
	// prefixQueries and prefixHits are the prompt tokens looked up in cache
	// and found there, vLLM's prefix_cache_queries and prefix_cache_hits.
	prefixQueries, prefixHits atomic.Int64
}

// PDQueues are the queues an SGLang engine in P/D mode reports beside its
// waiting queue, set by a test (Server.SetPDQueues) to stand for a busy engine.
type PDQueues struct {
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
		usage := min(1, float64(m.blocks.Load())/kvCapacityBlocks)
		var gauges []gauge
		if protocol != ProtocolSGLang {
			gauges = []gauge{
				{"vllm:num_requests_running", "Number of requests in model execution batches.", float64(m.running.Load())},
				{"vllm:num_requests_waiting", "Number of requests waiting to be processed.", float64(m.waiting.Load())},
				{"vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage},
			}
		} else {
			var q PDQueues
			if p := m.pdQueues.Load(); p != nil {
				q = *p
			}
			gauges = []gauge{
				{"sglang:num_running_reqs", "The number of running requests.", float64(m.running.Load())},
				{"sglang:num_queue_reqs", "The number of requests in the waiting queue.", float64(m.waiting.Load())},
				{"sglang:token_usage", "The token usage.", usage},
				{"sglang:num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue.", float64(q.PrefillBootstrap)},
				{"sglang:num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue.", float64(q.PrefillInflight)},
				{"sglang:num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.", float64(q.DecodePrealloc)},
				{"sglang:num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue.", float64(q.DecodeTransfer)},
			}
		}
		write := func(kind string, series []gauge) {
			for _, g := range series {
				fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n%s%s %g\n", g.name, g.help, g.name, kind, g.name, labels, g.value)
			}
		}
		write("gauge", gauges)
		if protocol != ProtocolSGLang {
			// Named as prometheus_client prints a Counter, with its _total.
			write("counter", []gauge{
				{"vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", float64(m.prefixQueries.Load())},
				{"vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", float64(m.prefixHits.Load())},
			})
		}
	}
}

// SetPDQueues sets the P/D queues an SGLang engine reports from now on.
func (s *Server) SetPDQueues(q PDQueues) { s.metrics.pdQueues.Store(&q) }
