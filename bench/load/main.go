// Command load is pd-extproc's benchmark driver. ghz cannot express Envoy's
// FULL_DUPLEX_STREAMED exchange (all body chunks sent before the server's held
// headers reply, then many replies to read), so this driver plays Envoy: one
// Process stream per HTTP request with exactly the messages Envoy sends. It
// starts every target as a child process, fresh for each cell, and prints
// Markdown tables. See docs/benchmarks.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

type options struct {
	binDir, targets, modes, sizes, concs, prefill, out, logDir, pprofDir string
	answerTargets, answerConcs                                           string
	duration, warmup                                                     time.Duration
	requests, conns, rttRequests, answerTokens                           int
	keepLogs                                                             bool
}

func main() {
	// The driver re-executes itself as its helper processes (children.go).
	if len(os.Args) > 2 && os.Args[1] == "-child" {
		testbed.Main(os.Args[2], func(ctx context.Context) error { return runChild(ctx, os.Args[2], os.Args[3:]) })
		return
	}
	var o options
	flag.StringVar(&o.binDir, "bin", "bin", "directory holding extproc, echo and pdsim (make bench builds them)")
	flag.StringVar(&o.targets, "targets", "pd,pd-fake,decode,echo",
		"targets: pd (extproc P/D, kv-nixl, -prefill simulator), pd-fake (the same with the fake prefill), decode (extproc decode-only), echo (the floor)")
	flag.StringVar(&o.modes, "modes", "full-duplex,buffered", "Envoy request body modes: full-duplex, buffered")
	flag.StringVar(&o.sizes, "sizes", "4KiB,256KiB,2MiB", "request body sizes")
	flag.StringVar(&o.concs, "conc", "1,64,256", "concurrent streams")
	flag.DurationVar(&o.duration, "duration", 5*time.Second, "measured time per cell (after the warm-up)")
	flag.IntVar(&o.requests, "requests", 0, "requests per cell instead of -duration (0: use -duration)")
	flag.DurationVar(&o.warmup, "warmup", 500*time.Millisecond, "unmeasured load per cell before measuring")
	flag.IntVar(&o.conns, "conns", 2, "gRPC connections to the server (Envoy opens one per worker thread)")
	flag.StringVar(&o.prefill, "prefill", SimPdsim, "prefill simulator of target pd: pdsim (bin/pdsim, every latency zero) or fake (a canned answer)")
	flag.IntVar(&o.rttRequests, "rtt-requests", 2000, "requests for the small-POST loopback round-trip baseline (0: skip the baseline)")
	flag.StringVar(&o.out, "out", "", "also write the Markdown report to this file")
	flag.StringVar(&o.logDir, "logs", "", "directory for the children's logs and configs (default: a new temporary directory)")
	flag.StringVar(&o.pprofDir, "pprof-dir", "", "save a CPU and an allocs profile of the server of each cell here (runs extproc with --pprof)")
	flag.BoolVar(&o.keepLogs, "keep-logs", false, "keep the children's logs of cells that succeed (extproc logs a line per request)")
	flag.IntVar(&o.answerTokens, "answer-tokens", 64, "response cells: token events per streamed answer (0: no response cells)")
	flag.StringVar(&o.answerTargets, "answer-targets", TargetPDFake+","+TargetPDUsage,
		"response cells' targets: pd-fake passes the answer through, pd-usage rewrites its usage (echo: the floor)")
	flag.StringVar(&o.answerConcs, "answer-conc", "1,64", "response cells' concurrent streams")
	flag.Parse()
	testbed.Main("load", func(ctx context.Context) error { return run(ctx, o) })
}

func run(ctx context.Context, o options) error {
	targets := splitList(o.targets)
	modes, errModes := parseList(o.modes, parseMode)
	sizes, errSizes := parseList(o.sizes, parseSize)
	concs, errConcs := parseList(o.concs, parseConc)
	answerConcs, errAnswers := parseList(o.answerConcs, parseConc)
	if err := errors.Join(errModes, errSizes, errConcs, errAnswers); err != nil {
		return err
	}
	answerTargets := splitList(o.answerTargets)
	if o.answerTokens <= 0 {
		answerTargets = nil
	}
	if err := checkBinaries(o, append(slices.Clone(targets), answerTargets...)); err != nil {
		return err
	}
	if o.logDir == "" {
		var err error
		if o.logDir, err = os.MkdirTemp("", "pd-bench-"); err != nil {
			return err
		}
	}
	for _, dir := range []string{o.logDir, o.pprofDir} {
		if err := os.MkdirAll(dir, 0o755); dir != "" && err != nil {
			return err
		}
	}
	l := &Launcher{BinDir: o.binDir, LogDir: o.logDir, Prefill: o.prefill, Pprof: o.pprofDir != "", KeepLogs: o.keepLogs}
	copts := CellOptions{Launcher: l, Conns: o.conns, Warmup: o.warmup, Duration: o.duration, Requests: o.requests, PprofDir: o.pprofDir}

	payloads := map[int]*Payload{}
	for _, s := range sizes {
		payloads[s] = NewPayload(chatBody(s, uint64(s)))
	}
	rep := &Report{Header: header(o, payloads, sizes)}
	start := time.Now()

	if o.rttRequests > 0 {
		for _, sim := range simulators(l, targets) {
			fmt.Fprintf(os.Stderr, "loopback round trip to the prefill simulator %s ...\n", sim)
			rtt, err := loopbackBaseline(ctx, l, sim, o.rttRequests, sizes, payloads)
			if err != nil {
				return fmt.Errorf("loopback baseline, %s: %w", sim, err)
			}
			rep.RTT = append(rep.RTT, rtt...)
		}
	}

	total := len(modes) * len(sizes) * len(concs) * len(targets)
	n := 0
	// Targets are interleaved cell by cell, so slow drift of the machine hits
	// all of them alike.
	for row := range rows(modes, sizes, concs) {
		for _, target := range targets {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			n++
			cell := row.of(target)
			res, ok := tryCell(ctx, copts, rep, cell, payloads[cell.Size], fmt.Sprintf("[%d/%d]", n, total))
			if !ok {
				continue
			}
			rep.Cells = append(rep.Cells, res)
			fmt.Fprintf(os.Stderr, "[%d/%d] %s: %d req, %.0f req/s, p50 %s ms, p99 %s ms, cpu %.2fs, peak %.0f MiB, errors %d (%s elapsed)\n",
				n, total, cell, res.Requests, res.Throughput(), ms(res.P50), ms(res.P99), res.ServerCPU, mib(res.PeakRSS), res.Errors,
				time.Since(start).Round(time.Second))
		}
	}
	if len(answerTargets) > 0 {
		if err := runAnswers(ctx, copts, rep, answerTargets, answerConcs, o.answerTokens, start); err != nil {
			return err
		}
	}
	rep.Header = append(rep.Header, "load average at the end: "+testbed.LoadAverage(),
		fmt.Sprintf("wall time of the run: %s; children's logs: %s", time.Since(start).Round(time.Second), o.logDir))

	var w io.Writer = os.Stdout
	if o.out != "" {
		f, err := os.Create(o.out)
		if err != nil {
			return err
		}
		defer f.Close()
		w = io.MultiWriter(os.Stdout, f)
	}
	rep.Write(w, l, modes, sizes, concs, targets)
	rep.writeAnswers(w, answerTargets, answerConcs)
	return nil
}

// answerSize is the request body of the response cells: what they measure
// is the answer, after an ordinary small request.
const answerSize = 4 << 10

// answerRounds is how often each response cell runs. The difference measured
// is a few percent, less than the drift of a shared machine between two
// cells, so the second round runs the targets in the reverse order
// (A B B A) and the drift cancels out.
const answerRounds = 2

// runAnswers runs the response cells: each target at each concurrency, the
// targets interleaved cell by cell as in the main loop, in two rounds.
func runAnswers(ctx context.Context, copts CellOptions, rep *Report, targets []string, concs []int, tokens int, start time.Time) error {
	p := NewPayload(chatBody(answerSize, answerSize))
	n, total := 0, answerRounds*len(targets)*len(concs)
	for _, conc := range concs {
		for i := range answerRounds * len(targets) {
			round, target := i/len(targets), targets[i%len(targets)]
			if round%2 == 1 {
				target = targets[len(targets)-1-i%len(targets)]
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			n++
			cell := Cell{Target: target, Mode: FullDuplex, Size: answerSize, Concurrency: conc, Tokens: tokens, Round: round}
			res, ok := tryCell(ctx, copts, rep, cell, p, fmt.Sprintf("[answers %d/%d]", n, total))
			if !ok {
				continue
			}
			rep.Answers = append(rep.Answers, res)
			fmt.Fprintf(os.Stderr, "[answers %d/%d] %s: %d answers, %d chunks, chunk p50 %s ms, p99 %s ms, cpu %.2fs, errors %d (%s elapsed)\n",
				n, total, cell, res.Requests, res.Chunks, ms(res.P50), ms(res.P99), res.ServerCPU, res.Errors, time.Since(start).Round(time.Second))
		}
	}
	return nil
}

// tryCell runs cell; a cell that fails is said on stderr after progress and
// kept in rep, and the run goes on.
func tryCell(ctx context.Context, copts CellOptions, rep *Report, cell Cell, p *Payload, progress string) (CellResult, bool) {
	res, err := runCell(ctx, copts, cell, p)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s %s: FAILED: %v\n", progress, cell, err)
		rep.Failed = append(rep.Failed, fmt.Sprintf("%s: %v", cell, err))
		return res, false
	}
	return res, true
}

// simulators lists the prefill simulators the P/D targets use.
func simulators(l *Launcher, targets []string) []string {
	var sims []string
	for _, t := range targets {
		if sim := l.prefillSim(t); isPD(t) && !slices.Contains(sims, sim) {
			sims = append(sims, sim)
		}
	}
	return sims
}

// loopbackBaseline measures the small-POST round trip and the round trip of
// each size's prefill leg against a fresh prefill simulator sim.
func loopbackBaseline(ctx context.Context, l *Launcher, sim string, n int, sizes []int, payloads map[int]*Payload) ([]RTTResult, error) {
	var g group
	defer g.Stop(true)
	p, err := l.StartPrefill(ctx, &g, sim)
	if err != nil {
		return nil, err
	}
	small, err := measureRTT(ctx, sim, p.HTTPAddr, "small", smallPrefillLeg, n)
	if err != nil {
		return nil, err
	}
	out := []RTTResult{small}
	for _, s := range sizes {
		leg, err := prefillLeg(payloads[s].Body)
		if err != nil {
			return nil, err
		}
		// Fewer round trips for big legs: each moves and parses megabytes.
		count := max(20, min(n, n*(64<<10)/len(leg)))
		r, err := measureRTT(ctx, sim, p.HTTPAddr, sizeName(s), leg, count)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}

func header(o options, payloads map[int]*Payload, sizes []int) []string {
	var bodies []string
	for _, s := range sizes {
		bodies = append(bodies, fmt.Sprintf("%s = %d bytes (%d FULL_DUPLEX chunks)", sizeName(s), len(payloads[s].Body), len(payloads[s].fullDuplex)))
	}
	cpu := "unknown"
	if b, err := exec.Command("sh", "-c", "lscpu | sed -n 's/^Model name: *//p'").Output(); err == nil {
		cpu = strings.TrimSpace(string(b))
	}
	per := fmt.Sprintf("%s measured after a %s warm-up by at most %d workers", o.duration, o.warmup, warmupWorkers)
	if o.requests > 0 {
		per = fmt.Sprintf("%d requests after at most %d warm-up requests", o.requests, warmupWorkers)
	}
	rev := "unknown"
	if b, err := exec.Command("git", "describe", "--always", "--dirty").Output(); err == nil {
		rev = strings.TrimSpace(string(b))
	}
	return []string{
		"source: " + rev + " (bin/extproc as built by make bench)",
		fmt.Sprintf("%s, %s/%s, %d CPUs (%s), GOMAXPROCS %d in the driver", runtime.Version(), runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), cpu, runtime.GOMAXPROCS(0)),
		fmt.Sprintf("per cell: a fresh target process; %s; %d gRPC connections; closed loop", per, o.conns),
		fmt.Sprintf("prefill simulator of target pd: %s; of pd-fake: fake; bodies: %s", o.prefill, strings.Join(bodies, ", ")),
		"command: " + strings.Join(os.Args, " "),
		"load average at the start (other sessions share this machine): " + testbed.LoadAverage(),
	}
}

func checkBinaries(o options, names []string) error {
	need := map[string]bool{}
	for _, name := range names {
		t, err := targetOf(name)
		if err != nil {
			return err
		}
		need[t.binary] = true
		if t.pd && !t.fakePrefill && o.prefill == SimPdsim {
			need["pdsim"] = true
		}
	}
	for b := range need {
		if _, err := os.Stat(o.binDir + "/" + b); err != nil {
			return fmt.Errorf("%v: build the binaries first (make bench does)", err)
		}
	}
	return nil
}

func parseConc(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("concurrency %q: want a positive integer", s)
	}
	return n, nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func parseList[T any](s string, parse func(string) (T, error)) ([]T, error) {
	var out []T
	for _, f := range splitList(s) {
		v, err := parse(f)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}
