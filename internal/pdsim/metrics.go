package pdsim

import (
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
)

const (
	blockSize        = 16   // tokens per KV block, vLLM's default
	kvCapacityBlocks = 8192 // the simulated GPU's KV cache
)

func blocksFor(tokens int) int64 { return int64((tokens + blockSize - 1) / blockSize) }

// metrics holds the live load a router's scorers read from /metrics.
type metrics struct {
	waiting, running atomic.Int64
	blocks           atomic.Int64 // held by running requests and by issued NIXL blocks
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

// serve writes the gauges in Prometheus text format under vLLM's names.
func (m *metrics) serve(model string) http.HandlerFunc {
	labels := fmt.Sprintf(`{engine="0",model_name="%s"}`, labelEscaper.Replace(model))
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		usage := min(1, float64(m.blocks.Load())/kvCapacityBlocks)
		for _, g := range []struct {
			name, help string
			value      float64
		}{
			{"vllm:num_requests_running", "Number of requests in model execution batches.", float64(m.running.Load())},
			{"vllm:num_requests_waiting", "Number of requests waiting to be processed.", float64(m.waiting.Load())},
			{"vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage},
		} {
			fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s gauge\n%s%s %g\n", g.name, g.help, g.name, g.name, labels, g.value)
		}
	}
}
