// Command soak runs mixed traffic through the Envoy emulator, extproc and
// engine simulators on loopback for a while, with faults injected on
// purpose, and reports whether anything went wrong that should not have.
//
//	go run ./test/soak -duration 60s        # make soak, SOAK_DURATION=10m make soak
//
// One stack per KV connector (kv-nixl, kv-sglang, kv-shared-storage, kv-mooncake): a real
// extproc process, two prefill and two decode simulators, and two Envoy
// emulators in front of it (config/envoy/envoy.yaml, FULL_DUPLEX, and
// envoy-buffered.yaml, BUFFERED). Workers (bounded concurrency) send
// chat and completions, streamed or not, small bodies and 1 MiB ones, plus a
// few bad inputs and clients that give up. Meanwhile:
//
//   - one prefill simulator per stack answers 503 to every Nth request (the
//     retry on the other endpoint must hide it);
//   - the other prefill simulator is slow, and from time to time slower than
//     Envoy's 1 s BUFFERED message timer (override_message_timeout must save it);
//   - one decode simulator per stack is killed and restarted on its address
//     every -kill-every;
//   - every -saturate-every, a pool's engines report full queues for longer
//     than extproc holds the requests that may be shed (one in eight names
//     such an objective): they are held, then let go or refused with 429.
//
// Every outcome is classified. Expected: 200 with a whole completion; the
// 4xx a bad input deserves; a client that gave up; inside a decode kill
// window, Envoy's 503 or a cut stream; and inside a saturation window, a 429
// for a request that may be shed. Anything else is unexpected, and the
// run fails if there is any, or if extproc's goroutines do not come back to
// where they started, or if a stream stays open or a request held.
//
// The files follow the run's jobs: stack.go starts a connector's stack
// (from internal/testbed), faults.go breaks it on schedule, traffic.go sends
// the requests and classifies what comes back, stats.go keeps the outcomes
// and extproc's figures, report.go writes them out.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

type options struct {
	duration      time.Duration
	concurrency   int
	failEvery     int
	killEvery     time.Duration
	saturateEvery time.Duration
	bigEvery      int
	report        string
}

func main() {
	log.SetFlags(0)
	o := options{}
	def := 60 * time.Second
	if v := os.Getenv("SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			log.Fatalf("soak: SOAK_DURATION=%q: %v", v, err)
		}
		def = d
	}
	flag.DurationVar(&o.duration, "duration", def, "how long to send traffic (default $SOAK_DURATION or 60s)")
	flag.IntVar(&o.concurrency, "concurrency", 8, "requests in flight at most (sized for a 2-CPU machine: beyond that extproc is starved past Envoy's 1 s message timer)")
	flag.IntVar(&o.failEvery, "fail-every", 7, "one prefill simulator per stack answers 503 to every Nth request")
	flag.DurationVar(&o.killEvery, "kill-every", 15*time.Second, "kill and restart a decode simulator per stack this often")
	flag.DurationVar(&o.saturateEvery, "saturate-every", 20*time.Second, "have a pool's engines report full queues this often, the decode and the prefill pool in turn, per stack")
	flag.IntVar(&o.bigEvery, "big-every", 20, "one request in N carries a 1 MiB prompt")
	flag.StringVar(&o.report, "report", "", "also write the report (markdown) to this file")
	flag.Parse()
	if err := run(o); err != nil {
		log.Fatal("soak: ", err)
	}
}

func run(o options) error {
	tmp, err := os.MkdirTemp("", "pd-soak")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	bin, err := testbed.BuildExtproc(tmp)
	if err != nil {
		return err
	}

	var cleanups testbed.Cleanups
	defer cleanups.Close()
	var stacks []*stack
	for i, connector := range testbed.Connectors {
		s, err := startStack(context.Background(), &cleanups, tmp, bin, connector, i)
		if err != nil {
			return err
		}
		stacks = append(stacks, s)
	}

	// Warm up (connection pools, the heap's first growth with 1 MiB bodies),
	// then take the baseline.
	warm := newStats()
	drive(context.Background(), stacks, o, warm, min(5*time.Second, o.duration/6), false)
	for _, s := range stacks {
		s.baseline()
	}

	stats := newStats()
	ctx, cancel := context.WithTimeout(context.Background(), o.duration)
	defer cancel()
	var chaos sync.WaitGroup
	for _, s := range stacks {
		chaos.Go(func() { s.faults(ctx, o) })
		chaos.Go(func() { s.saturate(ctx, o) })
		chaos.Go(func() { s.sample(ctx, 5*time.Second) })
	}
	start := time.Now()
	drive(ctx, stacks, o, stats, o.duration, true)
	elapsed := time.Since(start)
	chaos.Wait()

	// Let the last streams close, then read the end figures.
	var problems []string
	for _, s := range stacks {
		// No stream open, no request held.
		for _, name := range []string{"pd_extproc_streams_in_flight", `pd_extproc_held_requests{pool="prefill"}`, `pd_extproc_held_requests{pool="decode"}`} {
			var n float64
			var err error
			if !waitUntil(10*time.Second, func() bool { n, err = s.extproc.Metric(context.Background(), name); return err == nil && n == 0 }) {
				problems = append(problems, fmt.Sprintf("%s: %s is %v, error %v, 10 s after the traffic stopped", s.connector, name, n, err))
			}
		}
	}
	// Background (kv-sglang) prefill legs may still wait on a handshake: give
	// the goroutines up to 10 s to come back to the baseline. Idle connection
	// pools are left out of both figures (see goroutines).
	grown := func(s *stack) (bool, float64, float64) {
		start, _ := s.usage.figures()
		gr := s.working()
		return gr > start.goroutines+5, start.goroutines, gr
	}
	waitUntil(10*time.Second, func() bool {
		for _, s := range stacks {
			if up, _, _ := grown(s); up {
				return false
			}
		}
		return true
	})
	for _, s := range stacks {
		if up, from, to := grown(s); up {
			problems = append(problems, fmt.Sprintf("%s: extproc goroutines (idle connection pools aside) grew from %.0f to %.0f", s.connector, from, to))
		}
	}
	rep := report(o, stacks, stats, elapsed)
	if n := stats.unexpectedTotal(); n > 0 {
		problems = append(problems, fmt.Sprintf("%d unexpected outcomes", n))
	}
	fmt.Print(rep)
	if o.report != "" {
		if err := os.WriteFile(o.report, []byte(rep), 0o644); err != nil {
			return err
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// sleep waits d unless ctx ends first; false when it ended.
func sleep(ctx context.Context, d time.Duration) bool {
	select {
	case <-time.After(d): // collected unfired since Go 1.23: nothing to stop
		return true
	case <-ctx.Done():
		return false
	}
}

// waitUntil polls cond, which reads extproc's state (not this program's),
// for at most d.
func waitUntil(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}
