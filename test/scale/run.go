package main

import (
	"context"
	"fmt"
	"time"
)

// result is what one run measured.
type result struct {
	Target, Response string
	Streams          int
	Completed        int64
	Failed, Lost     int64
	FirstFailure     string
	Plateau          time.Duration // how long every stream was held at once
	Idle, Held       footprint     // the replicas together, before the load and while holding
	CPU              float64       // cores the replicas used while holding
	Overflows        uint64        // the emulators' circuit-breaker overflows
	HeapTop          string        // the first replica's heap profile while holding
	Err              error
}

// perStream is the footprint above idle per held stream.
func (r result) perStream() (rss, heap, goroutines float64) {
	d := r.Held.minus(r.Idle)
	n := float64(max(r.Streams, 1))
	return float64(d.RSS) / n, float64(d.Heap) / n, float64(d.Goroutines) / n
}

func (r result) summary() string {
	rss, heap, g := r.perStream()
	return fmt.Sprintf("   %d completed, %d failed, %d lost; held %v; per stream %.1f KiB RSS, %.1f KiB heap, %.2f goroutines; %.2f cores; err %v",
		r.Completed, r.Failed, r.Lost, r.Plateau.Round(time.Second), rss/1024, heap/1024, g, r.CPU, r.Err)
}

// runOne starts a run's processes, holds the streams and measures.
func runOne(ctx context.Context, o options, target, response string) (res result, err error) {
	res = result{Target: target, Response: response, Streams: o.streams}
	defer func() { res.Err = err }()
	s, err := startStack(ctx, o, target, response)
	if err != nil {
		return res, err
	}
	defer s.close()
	time.Sleep(settle) // start-up allocations and the first engine scrapes settle
	if res.Idle, err = measure(ctx, s.replicas); err != nil {
		return res, err
	}

	var urls []string
	for _, e := range s.emulators {
		urls = append(urls, "http://"+e.addr)
	}
	gen := time.Duration(o.tokens) * o.tpot
	start := time.Now()
	l := openStreams(ctx, urls, o.streams, o.ramp, chatBody(o.bodyBytes), start.Add(o.ramp+gen+2*time.Minute))
	defer func() {
		l.wait()
		res.Completed, res.Failed, res.Lost = l.completed.Load(), l.failed.Load(), l.lost.Load()
		res.FirstFailure = l.first()
		if n, oerr := s.overflows(context.Background()); oerr == nil {
			res.Overflows = n
		} else if err == nil {
			err = oerr
		}
	}()

	all := int64(o.streams)
	if !poll(ctx, o.ramp+time.Minute, func() bool { return l.streaming.Load() == all || l.over() > 0 }) || l.streaming.Load() != all {
		return res, fmt.Errorf("only %d of %d streams were streaming at once (%d over: %s)", l.streaming.Load(), all, l.over(), l.first())
	}
	heldSince := time.Now()
	cpu0, err := cpuSeconds(s.replicas)
	if err != nil {
		return res, err
	}
	// Measure halfway between now and when the first stream is due to end.
	time.Sleep(time.Until(start.Add(gen)) / 2)
	cpu1, err := cpuSeconds(s.replicas)
	if err != nil {
		return res, err
	}
	res.CPU = (cpu1 - cpu0) / time.Since(heldSince).Seconds()
	if res.Held, err = measure(ctx, s.replicas); err != nil {
		return res, err
	}
	if o.pprofDir != "" {
		if res.HeapTop, err = heapTop(ctx, s.replicas[0], o.pprofDir, target+"-response-"+response); err != nil {
			return res, err
		}
	}
	poll(ctx, gen+time.Minute, func() bool { return l.over() > 0 })
	res.Plateau = time.Since(heldSince)
	if res.Plateau < o.minHold {
		return res, fmt.Errorf("every stream was held at once for %v only, below -min-hold %v", res.Plateau.Round(time.Second), o.minHold)
	}
	return res, nil
}

// poll checks cond every 100 ms until it holds, for at most d; it reports
// whether it held. The driver waits on other processes' progress.
func poll(ctx context.Context, d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
	return true
}
