package main

import (
	"fmt"
	"io"
)

// answer returns the response cell of target at conc in round, if it
// completed any answer.
func (r *Report) answer(target string, conc, round int) *CellResult {
	for i := range r.Answers {
		if c := &r.Answers[i]; c.Target == target && c.Concurrency == conc && c.Round == round && c.Chunks > 0 {
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
	section(w, "Response path: streamed answers",
		"After each request (FULL_DUPLEX_STREAMED, 4 KiB, the fake prefill), the driver plays a streamed answer",
		"with FULL_DUPLEX_STREAMED response bodies: a role event, the token events, the usage event and [DONE],",
		"one event per chunk, each sent when the previous one's reply is back. `pd-fake` passes the answer",
		"through; `pd-usage` (response.rewrite_usage) reads every chunk and rewrites the usage event.",
		"Latencies are per chunk, from its send to its reply; `CPU µs/chunk` is the server's CPU over the",
		"chunks, each answer's request path included.")
	tableHead(w, "c", "round", "<target", "answers", "chunks", "chunks/s", "chunk p50 ms", "chunk p99 ms", "CPU s", "CPU µs/chunk",
		"driver s", "others s", "goroutines before→after", "errors")
	for _, conc := range concs {
		for round := range answerRounds {
			for _, t := range targets {
				c := r.answer(t, conc, round)
				if c == nil {
					continue
				}
				fmt.Fprintf(w, "| %d | %d | %s | %d | %d | %.0f | %s | %s | %.2f | %.1f | %.2f | %.2f | %s | %s |\n",
					conc, round+1, t, c.Requests, c.Chunks, float64(c.Chunks)/c.Elapsed.Seconds(), ms(c.P50), ms(c.P99),
					c.ServerCPU, c.cpuPerChunk(), c.DriverCPU, c.OtherCPU, goroutineDelta(c), errorsCell(c))
			}
		}
	}
	fmt.Fprintln(w)
	prose(w, "Usage rewriting against pass-through, the same run (`pd-usage` ÷ `pd-fake`). CPU: over both rounds",
		"(`+µs/chunk`: the CPU it adds per chunk); latency: the mean of the two rounds' ratios. The second",
		"round runs the two in the reverse order, so the machine's drift between cells cancels out.")
	tableHead(w, "c", "CPU/chunk", "+µs/chunk", "chunk p50", "chunk p99")
	for _, conc := range concs {
		var cpu [2]float64 // pass-through, rewriting: CPU seconds
		var chunks [2]int
		var p50, p99 float64
		rounds := 0
		for round := range answerRounds {
			pass, usage := r.answer(TargetPDFake, conc, round), r.answer(TargetPDUsage, conc, round)
			if pass == nil || usage == nil {
				continue
			}
			rounds++
			cpu[0], cpu[1] = cpu[0]+pass.ServerCPU, cpu[1]+usage.ServerCPU
			chunks[0], chunks[1] = chunks[0]+pass.Chunks, chunks[1]+usage.Chunks
			p50 += float64(usage.P50) / float64(pass.P50)
			p99 += float64(usage.P99) / float64(pass.P99)
		}
		if rounds == 0 {
			continue
		}
		passPer, usagePer := cpu[0]*1e6/float64(chunks[0]), cpu[1]*1e6/float64(chunks[1])
		fmt.Fprintf(w, "| %d | %.2f | %+.1f | %.2f | %.2f |\n", conc, usagePer/passPer, usagePer-passPer, p50/float64(rounds), p99/float64(rounds))
	}
	fmt.Fprintln(w)
}
