package main

import (
	"context"
	"log"
	"net/http"
	"slices"
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

// saturate, every o.saturateEvery, has every engine of one pool (the decode
// pool and the prefill pool in turn) report a full queue for longer than
// extproc's hold (soakHold): the requests that may be shed (soakObjective)
// are held, those that arrive early in the window refused after their hold,
// the others let go when it ends. It runs beside the kills: a decode engine
// killed in a window comes back without the queue it reported.
func (s *stack) saturate(ctx context.Context, o options) {
	t := time.NewTicker(o.saturateEvery)
	defer t.Stop()
	for decode := true; ; decode = !decode {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		e := s.engines
		e.mu.Lock()
		sims := slices.Clone(e.prefill)
		if decode {
			sims = slices.Clone(e.decode)
		}
		e.mu.Unlock()
		s.saturated.begin()
		for _, sim := range sims {
			sim.SetQueues(pdsim.Queues{Waiting: soakLine})
		}
		sleep(ctx, soakHold+time.Second)
		for _, sim := range sims {
			sim.SetQueues(pdsim.Queues{})
		}
		s.saturated.end()
	}
}

// window is a span in which some failures are expected.
type window struct{ from, to time.Time }

// windows are the spans of one kind of fault, in which some failures are
// expected.
type windows struct {
	mu    sync.Mutex
	spans []window // the last one open (to zero) while the fault lasts
}

func (k *windows) begin() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.spans = append(k.spans, window{from: time.Now()})
}

func (k *windows) end() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.spans[len(k.spans)-1].to = time.Now()
}

func (k *windows) count() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.spans)
}

// overlaps reports whether a request from from to to overlapped a window.
func (k *windows) overlaps(from, to time.Time) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, w := range k.spans {
		end := w.to
		if end.IsZero() {
			end = time.Now()
		}
		// A grace after the end: streams Envoy had already routed to a killed
		// engine, figures scraped before a saturation ended.
		if from.Before(end.Add(time.Second)) && to.After(w.from) {
			return true
		}
	}
	return false
}
