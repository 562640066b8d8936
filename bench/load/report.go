package main

import (
	"fmt"
	"io"
	"iter"
	"strings"
	"time"
)

// Target thresholds from the issue "Performance close to the floor".
const (
	latencyFactor = 1.3 // decode-only p50/p99 and P/D p99 against the echo floor
	memoryPerBody = 3.0 // peak memory per in-flight request, in body sizes
	// The memory target is judged where bodies dominate memory: below these,
	// fixed per-stream buffers and the GC's minimum heap do.
	memoryMinBody = 256 << 10
	memoryMinConc = 64
	// idleConnGoroutines is what extproc's prefill client may legitimately
	// keep after a cell: 2 goroutines for each of up to 256 idle keep-alive
	// connections (MaxIdleConnsPerHost), closed after 90 s idle.
	idleConnGoroutines = 2 * 256
)

// Report is everything a run measured.
type Report struct {
	Header  []string // lines describing the run
	RTT     []RTTResult
	Cells   []CellResult
	Answers []CellResult // the response cells
	Failed  []string     // cells that could not run, with the reason
}

// find returns the cell's result if any request of it completed.
func (r *Report) find(cell Cell) *CellResult {
	if c := r.findAny(cell); c != nil && c.Requests > 0 {
		return c
	}
	return nil
}

func (r *Report) findAny(cell Cell) *CellResult {
	for i := range r.Cells {
		if c := &r.Cells[i]; c.Cell == cell {
			return c
		}
	}
	return nil
}

// rows yields the cell of every mode, body size and concurrency, without its
// target, in the order of the run and of the report's rows.
func rows(modes []Mode, sizes, concs []int) iter.Seq[Cell] {
	return func(yield func(Cell) bool) {
		for _, mode := range modes {
			for _, size := range sizes {
				for _, conc := range concs {
					if !yield(Cell{Mode: mode, Size: size, Concurrency: conc}) {
						return
					}
				}
			}
		}
	}
}

// of is the cell of target in row.
func (row Cell) of(target string) Cell {
	row.Target = target
	return row
}

// rtt is the loopback round trip to simulator sim for leg ("small", or a body size name).
func (r *Report) rtt(sim, leg string) (RTTResult, bool) {
	for _, x := range r.RTT {
		if x.Sim == sim && x.Name == leg {
			return x, true
		}
	}
	return RTTResult{}, false
}

// Write prints the report as Markdown.
func (r *Report) Write(w io.Writer, l *Launcher, modes []Mode, sizes, concs []int, targets []string) {
	fmt.Fprint(w, "## Run\n\n")
	for _, h := range r.Header {
		fmt.Fprintf(w, "- %s\n", h)
	}
	fmt.Fprintln(w)
	r.writeRTT(w)
	if len(r.Cells) > 0 {
		for _, mode := range modes {
			r.writeMode(w, mode, sizes, concs, targets)
		}
		r.writeRatios(w, l, modes, sizes, concs, targets)
		r.writeTargets(w, l, modes, sizes, concs, targets)
	}
	if len(r.Failed) > 0 {
		section(w, "Cells that did not run")
		for _, f := range r.Failed {
			fmt.Fprintf(w, "- %s\n", f)
		}
		fmt.Fprintln(w)
	}
}

func (r *Report) writeRTT(w io.Writer) {
	if len(r.RTT) == 0 {
		return
	}
	section(w, "Loopback HTTP round trip to the prefill simulator",
		"One request at a time on a kept-alive connection. `small` is a one-line chat's prefill leg;",
		"the others are the prefill legs extproc sends for the benchmark bodies.")
	tableHead(w, "<simulator", "<prefill leg", "bytes", "requests", "p50 ms", "p99 ms")
	for _, x := range r.RTT {
		fmt.Fprintf(w, "| %s | %s | %d | %d | %s | %s |\n", x.Sim, x.Name, x.BodyBytes, x.Requests, ms(x.P50), ms(x.P99))
	}
	fmt.Fprintln(w)
}

func (r *Report) writeMode(w io.Writer, mode Mode, sizes, concs []int, targets []string) {
	section(w, mode.String(),
		"CPU, RSS and goroutines are of the ext_proc server process. `CPU ms/req`: its CPU per request;",
		"`prefill`, `driver`: CPU seconds of the prefill simulator and of the load driver; `others`: CPU",
		"seconds used by the rest of the machine meanwhile (noise). `mem/in-flight`: (peak RSS − idle RSS) /",
		"concurrency / body size.")
	tableHead(w, "<body", "c", "<target", "requests", "req/s", "p50 ms", "p99 ms", "CPU s", "CPU ms/req", "prefill s", "driver s",
		"others s", "idle RSS MiB", "peak RSS MiB", "mem/in-flight (× body)", "goroutines before→after", "errors")
	for row := range rows([]Mode{mode}, sizes, concs) {
		for _, target := range targets {
			c := r.findAny(row.of(target))
			if c == nil {
				continue
			}
			prefill := "–"
			if isPD(c.Target) {
				prefill = fmt.Sprintf("%.2f", c.PrefillCPU)
			}
			fmt.Fprintf(w, "| %s | %d | %s | %d | %.0f | %s | %s | %.2f | %.3f | %s | %.2f | %.2f | %.1f | %.1f | %.2f | %s | %s |\n",
				sizeName(c.Size), c.Concurrency, c.Target, c.Requests, c.Throughput(), ms(c.P50), ms(c.P99),
				c.ServerCPU, c.cpuPerRequest(), prefill, c.DriverCPU, c.OtherCPU,
				mib(c.IdleRSS), mib(c.PeakRSS), c.PerInFlight(), goroutineDelta(c), errorsCell(c))
		}
	}
	fmt.Fprintln(w)
}

// pdBudget is the P/D target: latencyFactor × the floor's p99 plus one loopback round trip.
func pdBudget(echoP99, rttP99 time.Duration) time.Duration {
	return time.Duration(latencyFactor*float64(echoP99)) + rttP99
}

func (r *Report) writeRatios(w io.Writer, l *Launcher, modes []Mode, sizes, concs []int, targets []string) {
	section(w, "Ratios to the floor (echo)",
		fmt.Sprintf("`÷ budget` is the target's p99 over %.1f × echo p99 + the small-POST loopback RTT p99 of its prefill", latencyFactor),
		"simulator (≤ 1 meets the P/D target); `÷ leg budget` uses the RTT of the same-size prefill leg",
		"instead, which includes the simulator's own work on the prompt. `CPU` is server CPU per request, the",
		"steadiest figure on a shared machine: at c ≥ 64 the CPUs are saturated and latency follows it.")
	cols := []string{"mode", "body", "c"}
	for _, t := range targets {
		switch {
		case t == TargetDecode:
			cols = append(cols, "decode/echo p50", "decode/echo p99", "decode/echo CPU")
		case isPD(t):
			cols = append(cols, t+"/echo p50", t+"/echo p99", t+" p99 ÷ budget", t+" p99 ÷ leg budget")
		}
	}
	tableHead(w, append([]string{"<" + cols[0], "<" + cols[1]}, cols[2:]...)...)
	for row := range rows(modes, sizes, concs) {
		echo := r.find(row.of(TargetEcho))
		if echo == nil {
			continue
		}
		line := []string{modeShort(row.Mode), sizeName(row.Size), fmt.Sprint(row.Concurrency)}
		for _, t := range targets {
			if t != TargetDecode && !isPD(t) {
				continue
			}
			c := r.find(row.of(t))
			line = append(line, ratio(c, echo.P50, (*CellResult).p50), ratio(c, echo.P99, (*CellResult).p99))
			if t == TargetDecode {
				line = append(line, cpuRatio(c, echo))
			}
			if isPD(t) {
				sim := l.prefillSim(t)
				small, ok1 := r.rtt(sim, "small")
				leg, ok2 := r.rtt(sim, sizeName(row.Size))
				line = append(line, budgetRatio(c, echo, small, ok1), budgetRatio(c, echo, leg, ok2))
			}
		}
		fmt.Fprintf(w, "| %s |\n", strings.Join(line, " | "))
	}
	fmt.Fprintln(w)
}

// cpuPerRequest is the server's CPU per completed request, in milliseconds.
func (c *CellResult) cpuPerRequest() float64 { return c.ServerCPU * 1000 / float64(max(c.Requests, 1)) }

func cpuRatio(c, echo *CellResult) string {
	if c == nil || echo.cpuPerRequest() == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", c.cpuPerRequest()/echo.cpuPerRequest())
}

func (c *CellResult) p50() time.Duration { return c.P50 }
func (c *CellResult) p99() time.Duration { return c.P99 }

func ratio(c *CellResult, floor time.Duration, f func(*CellResult) time.Duration) string {
	if c == nil || floor == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", float64(f(c))/float64(floor))
}

func budgetRatio(c, echo *CellResult, rtt RTTResult, ok bool) string {
	if c == nil || !ok {
		return "–"
	}
	return fmt.Sprintf("%.2f", float64(c.P99)/float64(pdBudget(echo.P99, rtt.P99)))
}

// verdict accumulates one target's cells.
type verdict struct {
	met, total int
	worst      float64
	worstCell  string
}

func (v *verdict) add(value, limit float64, cell string) {
	v.total++
	if value <= limit {
		v.met++
	}
	if v.total == 1 || value > v.worst {
		v.worst, v.worstCell = value, cell
	}
}

func (v *verdict) row(w io.Writer, what string) {
	if v.total == 0 {
		fmt.Fprintf(w, "| %s | – | – | not measured |\n", what)
		return
	}
	state := "**met**"
	if v.met < v.total {
		state = "**missed**"
	}
	fmt.Fprintf(w, "| %s | %d / %d | %.2f (%s) | %s |\n", what, v.met, v.total, v.worst, v.worstCell, state)
}

func (r *Report) writeTargets(w io.Writer, l *Launcher, modes []Mode, sizes, concs []int, targets []string) {
	var decP50, decP99 verdict
	pd := map[string]*verdict{}
	mem := map[string]*verdict{}
	growth := map[string]*verdict{}
	for _, t := range targets {
		pd[t], mem[t], growth[t] = &verdict{}, &verdict{}, &verdict{}
	}
	for row := range rows(modes, sizes, concs) {
		name := fmt.Sprintf("%s %s c=%d", modeShort(row.Mode), sizeName(row.Size), row.Concurrency)
		echo := r.find(row.of(TargetEcho))
		for _, t := range targets {
			c := r.find(row.of(t))
			if c == nil {
				continue
			}
			switch {
			case echo == nil:
			case t == TargetDecode:
				decP50.add(float64(c.P50)/float64(echo.P50), latencyFactor, name)
				decP99.add(float64(c.P99)/float64(echo.P99), latencyFactor, name)
			case isPD(t):
				if small, ok := r.rtt(l.prefillSim(t), "small"); ok {
					pd[t].add(float64(c.P99)/float64(pdBudget(echo.P99, small.P99)), 1, name)
				}
			}
			if row.Size >= memoryMinBody && row.Concurrency >= memoryMinConc {
				mem[t].add(c.PerInFlight(), memoryPerBody, name)
			}
			if c.GBefore >= 0 && c.GAfter >= 0 {
				growth[t].add(float64(c.GAfter-c.GBefore), float64(allowedGrowth(t)), name)
			}
		}
	}
	section(w, "Targets")
	tableHead(w, "<target", "cells met", "<worst value (cell)", "<verdict")
	decP50.row(w, fmt.Sprintf("decode-only p50 ≤ %.1f× echo p50 (ratio)", latencyFactor))
	decP99.row(w, fmt.Sprintf("decode-only p99 ≤ %.1f× echo p99 (ratio)", latencyFactor))
	for _, t := range targets {
		if isPD(t) {
			pd[t].row(w, fmt.Sprintf("%s: P/D p99 ≤ %.1f× echo p99 + loopback RTT p99 (p99 ÷ budget)", t, latencyFactor))
		}
	}
	for _, t := range targets {
		what := fmt.Sprintf("%s: peak memory per in-flight request ≤ %.0f× body, body ≥ %s and c ≥ %d (× body)", t, memoryPerBody, sizeName(memoryMinBody), memoryMinConc)
		if t == TargetEcho {
			what = fmt.Sprintf("(the floor) echo: peak memory per in-flight request, body ≥ %s and c ≥ %d (× body)", sizeName(memoryMinBody), memoryMinConc)
		}
		mem[t].row(w, what)
	}
	for _, t := range targets {
		what := fmt.Sprintf("%s: no goroutine growth (after − before)", t)
		if isPD(t) {
			what = fmt.Sprintf("%s: no goroutine growth beyond the prefill client's idle pool, %d (after − before)", t, idleConnGoroutines)
		}
		growth[t].row(w, what)
	}
	fmt.Fprintln(w)
}

// allowedGrowth is the goroutine growth over a cell that is not a leak.
func allowedGrowth(target string) int {
	if isPD(target) {
		return idleConnGoroutines
	}
	return 0
}

func modeShort(m Mode) string {
	if m == Buffered {
		return "BUFFERED"
	}
	return "FULL_DUPLEX"
}

func goroutineDelta(c *CellResult) string {
	if c.GBefore < 0 || c.GAfter < 0 {
		return "n/a"
	}
	return fmt.Sprintf("%d→%d", c.GBefore, c.GAfter)
}

func errorsCell(c *CellResult) string {
	if c.Errors == 0 {
		return "0"
	}
	return fmt.Sprintf("%d (%.80s)", c.Errors, strings.ReplaceAll(c.FirstErr, "|", "/"))
}

// ms prints a duration in milliseconds with about three significant digits.
func ms(d time.Duration) string {
	v := float64(d) / float64(time.Millisecond)
	switch {
	case v < 1:
		return fmt.Sprintf("%.3f", v)
	case v < 10:
		return fmt.Sprintf("%.2f", v)
	case v < 100:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.0f", v)
}

func mib(b uint64) float64 { return float64(b) / (1 << 20) }

// section starts a section of the report: its title, then its prose, a line
// each.
func section(w io.Writer, title string, lines ...string) {
	fmt.Fprintf(w, "### %s\n\n", title)
	prose(w, lines...)
}

// prose writes lines, then a blank line when there were any.
func prose(w io.Writer, lines ...string) {
	for _, l := range lines {
		fmt.Fprintln(w, l)
	}
	if len(lines) > 0 {
		fmt.Fprintln(w)
	}
}

// tableHead writes a table's header: its columns, right-aligned (figures)
// but those named with a leading "<" (words).
func tableHead(w io.Writer, cols ...string) {
	var names, align strings.Builder
	for _, c := range cols {
		name, left := strings.CutPrefix(c, "<")
		names.WriteString("| " + name + " ")
		if left {
			align.WriteString("|---")
		} else {
			align.WriteString("|--:")
		}
	}
	fmt.Fprintf(w, "%s|\n%s|\n", names.String(), align.String())
}
