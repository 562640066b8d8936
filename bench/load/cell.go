package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// Cell is one measurement: a target, a body mode, a body size, a
// concurrency, and for a response cell the token events of each answer.
type Cell struct {
	Target      string
	Mode        Mode
	Size        int // nominal body size, as given with -sizes
	Concurrency int
	Tokens      int // > 0: the response path is played too, an answer of this many token events
	Round       int // response cells run in two rounds, the second in the reverse order
}

func (c Cell) String() string {
	s := fmt.Sprintf("%s %s %s c=%d", c.Target, c.Mode, sizeName(c.Size), c.Concurrency)
	if c.Tokens > 0 {
		s += fmt.Sprintf(" answer=%d tokens round %d", c.Tokens, c.Round+1)
	}
	return s
}

// CellResult is what a cell measured. CPU and memory are of the ext_proc
// server process alone unless named otherwise. In a response cell the
// percentiles are of the answers' chunks, each from its send to its reply.
type CellResult struct {
	Cell
	BodyBytes     int
	Requests      int
	Chunks        int // answer chunks replied to (response cells)
	Errors        int
	FirstErr      string
	Elapsed       time.Duration
	P50, P99, Avg time.Duration
	ServerCPU     float64 // seconds, utime+stime
	PrefillCPU    float64 // seconds, the prefill simulator (pd only)
	DriverCPU     float64 // seconds, this process (client side and its gRPC)
	OtherCPU      float64 // seconds, the rest of the machine: other processes are noise
	Footprint
}

// Footprint is what the server under test holds: memory and goroutines.
type Footprint struct {
	IdleRSS uint64 // right after start, before any request
	PeakRSS uint64 // VmHWM during the measured phase
	GBefore int    // goroutines after warm-up, settled; -1 unknown
	GAfter  int    // goroutines after the measured phase, settled; -1 unknown
}

// Throughput is completed requests per second.
func (r CellResult) Throughput() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Requests) / r.Elapsed.Seconds()
}

// PerInFlight is the peak memory above idle per concurrent request, in units
// of the body size.
func (r CellResult) PerInFlight() float64 {
	if r.PeakRSS < r.IdleRSS || r.BodyBytes == 0 {
		return 0
	}
	return float64(r.PeakRSS-r.IdleRSS) / float64(r.Concurrency) / float64(r.BodyBytes)
}

// warmupWorkers bounds the concurrency of a cell's warm-up.
const warmupWorkers = 16

// CellOptions are the knobs shared by every cell of a run.
type CellOptions struct {
	Launcher *Launcher
	Conns    int
	Warmup   time.Duration
	Duration time.Duration
	Requests int    // per cell; 0: run for Duration
	PprofDir string // when set, save CPU and alloc profiles of servers serving /debug/pprof
}

// runCell starts a fresh target, checks one exchange end to end, warms up,
// measures, and stops the target.
func runCell(ctx context.Context, o CellOptions, cell Cell, p *Payload) (res CellResult, err error) {
	res = CellResult{Cell: cell, BodyBytes: len(p.Body), Footprint: Footprint{GBefore: -1, GAfter: -1}}
	t, err := o.Launcher.Start(ctx, cell.Target)
	if err != nil {
		return res, err
	}
	defer func() { t.Stop(o.Launcher.KeepLogs || err != nil) }()
	pid := t.Server.Pid()
	client, err := Dial(t.Server.GRPCAddr, o.Conns)
	if err != nil {
		return res, err
	}
	defer client.Close()

	res.IdleRSS, _, _ = testbed.Memory(pid)
	var answer *Answer
	if cell.Tokens > 0 {
		answer = NewAnswer(cell.Tokens)
	}
	if err := verify(ctx, client, cell, p, answer); err != nil {
		return res, fmt.Errorf("%s: the first exchange is wrong: %w", cell, err)
	}
	// The warm-up opens the connections and grows the buffers; a few workers
	// suffice, and full concurrency would cost tens of seconds per big cell.
	id := fmt.Sprintf("%s-%s-%d-%d", cell.Target, sizeName(cell.Size), cell.Mode, cell.Concurrency)
	warm := min(cell.Concurrency, warmupWorkers)
	warmup := Load{Mode: cell.Mode, Payload: p, Answer: answer, Concurrency: warm, Duration: o.Warmup, IDPrefix: id + "-warmup"}
	if o.Requests > 0 {
		warmup.Requests = warm
	}
	client.Run(ctx, warmup)
	res.GBefore = stableGoroutines(ctx, t.Server.AdminAddr)

	peakReset := resetPeak(pid) == nil
	sampler := sampleRSS(pid, 50*time.Millisecond)
	server0, _ := testbed.CPUSeconds(pid)
	driver0, _ := testbed.CPUSeconds(os.Getpid())
	machine0, _ := testbed.MachineCPUSeconds()
	var prefill0 float64
	if t.Prefill != nil {
		prefill0, _ = testbed.CPUSeconds(t.Prefill.Pid())
	}
	profiled := make(chan error, 1)
	if o.PprofDir != "" {
		go func() {
			profiled <- saveProfile(ctx, t.Server.AdminAddr, o.Duration, filepath.Join(o.PprofDir, fileName(cell)+".cpu.pprof"))
		}()
	} else {
		profiled <- nil
	}

	lr := client.Run(ctx, Load{Mode: cell.Mode, Payload: p, Answer: answer, Concurrency: cell.Concurrency, Duration: o.Duration,
		Requests: o.Requests, IDPrefix: id})

	server1, _ := testbed.CPUSeconds(pid)
	driver1, _ := testbed.CPUSeconds(os.Getpid())
	machine1, _ := testbed.MachineCPUSeconds()
	res.ServerCPU, res.DriverCPU = server1-server0, driver1-driver0
	if t.Prefill != nil {
		prefill1, _ := testbed.CPUSeconds(t.Prefill.Pid())
		res.PrefillCPU = prefill1 - prefill0
	}
	res.OtherCPU = max(0, machine1-machine0-res.ServerCPU-res.DriverCPU-res.PrefillCPU)
	sampled := sampler.Max()
	_, hwm, _ := testbed.Memory(pid)
	res.PeakRSS = max(sampled, hwm)
	if !peakReset {
		res.PeakRSS = sampled
	}
	// The CPU profile's request, and its connection, end before the
	// goroutines are counted: they are the harness's, not the server's.
	if err := <-profiled; err != nil {
		fmt.Fprintf(os.Stderr, "%s: profile: %v\n", cell, err)
	}
	// Streams end asynchronously after Envoy's reset: give them time to go.
	if res.GBefore >= 0 {
		res.GAfter, _ = settledGoroutines(ctx, t.Server.AdminAddr, res.GBefore+allowedGrowth(cell.Target), 3*time.Second)
	}
	if o.PprofDir != "" {
		saveProfile(ctx, t.Server.AdminAddr, 0, filepath.Join(o.PprofDir, fileName(cell)+".allocs.pprof"))
	}

	res.Requests, res.Errors, res.Elapsed = len(lr.Latencies), lr.Errors, lr.Elapsed
	if lr.FirstErr != nil {
		res.FirstErr = lr.FirstErr.Error()
	}
	lat := lr.Latencies
	if answer != nil {
		lat, res.Chunks = lr.Chunks, len(lr.Chunks)
	}
	res.P50, res.P99, res.Avg = Percentile(lat, 0.50), Percentile(lat, 0.99), Mean(lat)
	return res, nil
}

// verify runs one exchange and checks what Envoy would forward: the decode
// endpoint in the routing header, the body the target must produce, and the
// answer the client would get.
func verify(ctx context.Context, c *Client, cell Cell, p *Payload, a *Answer) error {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	r, err := roundTrip(ctx, c.procs[0], cell.Mode, p, a, "bench-verify", true)
	if err != nil {
		return err
	}
	if a != nil {
		want := decodeCachedTokens
		if targetSpecs[cell.Target].rewritingUsage {
			want = fakePrefillCached
		}
		if err := checkAnswer(a, r.Answer, want); err != nil {
			return err
		}
	}
	if r.Destination != "127.0.0.1:8201" {
		return fmt.Errorf("%s = %q, want 127.0.0.1:8201", handlers.DestinationHeader, r.Destination)
	}
	switch {
	case isPD(cell.Target):
		if !bytes.Contains(r.Body, []byte(`"kv_transfer_params":{"do_remote_prefill":true`)) {
			return fmt.Errorf("the decode body has no kv_transfer_params from the prefill: %.300s", r.Body)
		}
	default:
		if !bytes.Equal(r.Body, p.Body) {
			return fmt.Errorf("the body came back changed (%d bytes, sent %d)", len(r.Body), len(p.Body))
		}
	}
	return nil
}

// stableGoroutines waits until the goroutine count stops changing (streams end
// asynchronously after Envoy's reset), at most 3 s; -1 when it cannot be read.
func stableGoroutines(ctx context.Context, adminAddr string) int {
	last := -1
	for range 30 {
		n, err := goroutines(ctx, adminAddr)
		if err != nil {
			return -1
		}
		if n == last {
			return n
		}
		last = n
		time.Sleep(100 * time.Millisecond)
	}
	return last
}

// saveProfile fetches /debug/pprof/profile for d, or the allocs profile when d is 0.
func saveProfile(ctx context.Context, adminAddr string, d time.Duration, path string) error {
	url := "http://" + adminAddr + "/debug/pprof/allocs"
	if d > 0 {
		url = fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", adminAddr, max(int(d.Seconds()), 1))
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Close = true // no kept-alive connection left on the server to count as its goroutines
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s (the server may not serve /debug/pprof; see -pprof-dir)", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func fileName(c Cell) string {
	mode := "fd"
	if c.Mode == Buffered {
		mode = "buf"
	}
	name := fmt.Sprintf("%s-%s-%s-c%d", c.Target, mode, sizeName(c.Size), c.Concurrency)
	if c.Tokens > 0 {
		name += fmt.Sprintf("-t%d-r%d", c.Tokens, c.Round+1)
	}
	return name
}
