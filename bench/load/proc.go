package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// resetPeak sets VmHWM back to the current RSS (Linux >= 4.0), so a cell's
// peak is its own and not the process's lifetime maximum.
func resetPeak(pid int) error {
	return os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0)
}

// rssSampler keeps the largest RSS seen, in case VmHWM cannot be reset.
type rssSampler struct {
	max  uint64
	stop chan struct{}
	done chan struct{}
}

func sampleRSS(pid int, every time.Duration) *rssSampler {
	s := &rssSampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			if rss, _, err := testbed.Memory(pid); err == nil {
				s.max = max(s.max, rss)
			}
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
		}
	}()
	return s
}

// Max stops sampling and returns the largest RSS seen.
func (s *rssSampler) Max() uint64 {
	close(s.stop)
	<-s.done
	return s.max
}

// goroutines reads go_goroutines from a Prometheus /metrics endpoint: extproc
// serves the default registry, whose Go collector exports it (extproc has no
// /debug/pprof).
func goroutines(ctx context.Context, adminAddr string) (int, error) {
	n, err := testbed.Metric(ctx, adminAddr, "go_goroutines")
	return int(n), err
}

// settledGoroutines polls until the count stops falling below want (streams
// end asynchronously after Envoy's reset), for at most wait.
func settledGoroutines(ctx context.Context, adminAddr string, want int, wait time.Duration) (int, error) {
	deadline := time.Now().Add(wait)
	for {
		n, err := goroutines(ctx, adminAddr)
		if err != nil || n <= want || time.Now().After(deadline) {
			return n, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}
