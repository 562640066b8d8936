package main

import (
	"fmt"
	"io"
)

// answer returns the response cell of target at conc, if it completed any answer.
func (r *Report) answer(target string, conc int) *CellResult {
	for i := range r.Answers {
		if c := &r.Answers[i]; c.Target == target && c.Concurrency == conc && c.Chunks > 0 {
			return c
		}
	}
	return nil
}

// cpuPerChunk is the server's CPU per answer chunk, in microseconds, the
// request path of each answer included.
func (c *CellResult) cpuPerChunk() float64 { return c.ServerCPU * 1e6 / float64(max(c.Chunks, 1)) }

// writeAnswers prints the response cells and the cost of the usage rewrite
// per streamed chunk, against pass-through in the same run.
func (r *Report) writeAnswers(w io.Writer, targets []string, concs []int) {
	if len(r.Answers) == 0 {
		return
	}
	fmt.Fprint(w, "### Response path: streamed answers\n\n")
	fmt.Fprintln(w, "After each request (FULL_DUPLEX_STREAMED, 4 KiB, the fake prefill), the driver plays a streamed answer")
	fmt.Fprintln(w, "with FULL_DUPLEX_STREAMED response bodies: a role event, the token events, the usage event and [DONE],")
	fmt.Fprintln(w, "one event per chunk, each sent when the previous one's reply is back. `pd-fake` passes the answer")
	fmt.Fprintln(w, "through; `pd-usage` (response.rewrite_usage) reads every chunk and rewrites the usage event.")
	fmt.Fprintln(w, "Latencies are per chunk, from its send to its reply; `CPU µs/chunk` is the server's CPU over the")
	fmt.Fprint(w, "chunks, each answer's request path included.\n\n")
	fmt.Fprintln(w, "| c | target | answers | chunks | chunks/s | chunk p50 ms | chunk p99 ms | CPU s | CPU µs/chunk | driver s | others s | goroutines before→after | errors |")
	fmt.Fprintln(w, "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
	for _, conc := range concs {
		for _, t := range targets {
			c := r.answer(t, conc)
			if c == nil {
				continue
			}
			fmt.Fprintf(w, "| %d | %s | %d | %d | %.0f | %s | %s | %.2f | %.1f | %.2f | %.2f | %s | %s |\n",
				conc, t, c.Requests, c.Chunks, float64(c.Chunks)/c.Elapsed.Seconds(), ms(c.P50), ms(c.P99),
				c.ServerCPU, c.cpuPerChunk(), c.DriverCPU, c.OtherCPU, goroutineDelta(c), errorsCell(c))
		}
	}
	fmt.Fprintln(w)
	fmt.Fprint(w, "Usage rewriting against pass-through, the same run (`pd-usage` ÷ `pd-fake`; `+µs/chunk`: the CPU it adds per chunk):\n\n")
	fmt.Fprintln(w, "| c | CPU/chunk | +µs/chunk | chunk p50 | chunk p99 |")
	fmt.Fprintln(w, "|--:|--:|--:|--:|--:|")
	for _, conc := range concs {
		pass, usage := r.answer(TargetPDFake, conc), r.answer(TargetPDUsage, conc)
		if pass == nil || usage == nil {
			continue
		}
		fmt.Fprintf(w, "| %d | %.2f | %+.1f | %.2f | %.2f |\n", conc, usage.cpuPerChunk()/pass.cpuPerChunk(),
			usage.cpuPerChunk()-pass.cpuPerChunk(), float64(usage.P50)/float64(pass.P50), float64(usage.P99)/float64(pass.P99))
	}
	fmt.Fprintln(w)
}
