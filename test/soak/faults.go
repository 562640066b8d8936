package main

import (
	"context"
	"log"
	"net/http"
	"sync"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// faults runs this stack's fault schedule until ctx ends.
func (s *stack) faults(ctx context.Context, o options) {
	e := s.engines
	e.prefill[0].SetFaults(pdsim.Faults{FailStatus: http.StatusServiceUnavailable, FailEvery: o.failEvery})
	slow := pdsim.Faults{Delay: 20 * time.Millisecond}
	e.prefill[1].SetFaults(slow)
	kill := time.NewTicker(o.killEvery)
	defer kill.Stop()
	spike := time.NewTicker(o.killEvery/2 + 1500*time.Millisecond)
	defer spike.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-spike.C:
			// Slower than the BUFFERED message timer (1 s) for a moment.
			e.prefill[1].SetFaults(pdsim.Faults{Delay: 1200 * time.Millisecond})
			if !sleep(ctx, 2*time.Second) {
				return
			}
			e.prefill[1].SetFaults(slow)
		case <-kill.C:
			if !s.killDecode(ctx) {
				return
			}
		}
	}
}

// killDecode closes the stack's second decode simulator and, a second later,
// starts it again on its address; false when ctx ended meanwhile.
func (s *stack) killDecode(ctx context.Context) bool {
	e := s.engines
	e.mu.Lock()
	victim := e.decode[1]
	e.mu.Unlock()
	addr := victim.Addr()
	s.kills.begin()
	victim.Close()
	restarted := sleep(ctx, time.Second)
	d, err := e.start(pdsim.RoleDecode, 1, addr)
	if err == nil {
		e.mu.Lock()
		e.decode[1] = d
		e.mu.Unlock()
	} else {
		log.Printf("%s: restarting the decode simulator on %s: %v", s.connector, addr, err)
	}
	s.kills.end()
	return restarted
}

// window is a span in which some failures are expected.
type window struct{ from, to time.Time }

// killWindows are the spans in which a stack's decode simulator was down.
type killWindows struct {
	mu    sync.Mutex
	spans []window // the last one open (to zero) while the simulator is down
}

func (k *killWindows) begin() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.spans = append(k.spans, window{from: time.Now()})
}

func (k *killWindows) end() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.spans[len(k.spans)-1].to = time.Now()
}

func (k *killWindows) count() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.spans)
}

// overlaps reports whether a request from from to to overlapped a kill window.
func (k *killWindows) overlaps(from, to time.Time) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, w := range k.spans {
		end := w.to
		if end.IsZero() {
			end = time.Now()
		}
		// A grace after the restart: streams Envoy had already routed there.
		if from.Before(end.Add(time.Second)) && to.After(w.from) {
			return true
		}
	}
	return false
}
