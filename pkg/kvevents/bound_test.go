package kvevents

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
)

// The engines of the bind tests: a's replay socket is the tests' own, and
// b has none that answers (nothing listens on 127.0.0.2).
const (
	endpointA = "127.0.0.1:8000"
	endpointB = "127.0.0.2:8000"
)

// boundPool is a subscriber bound to a free port, for a pool of engines a
// (with a replay socket) and b, both publishing to it.
type boundPool struct {
	x       *Index
	s       *Subscriber
	a, b    *testPublisher
	handled map[string]chan int64 // each engine's batches handled
	set     func(endpoints ...string)
}

func bindTwo(t *testing.T, cfg Config) *boundPool {
	ctx, cancel := context.WithCancel(t.Context())
	addr, replay := "tcp://127.0.0.1:"+strconv.Itoa(freePort(t)), freePort(t)
	cfg.Bind, cfg.ReplayPort, cfg.ReplayTimeout, cfg.StaleAfter = addr, replay, time.Minute, time.Minute
	bp := &boundPool{x: NewIndex(Bounds{}, time.Minute, nil)}
	bp.s = NewSubscriber(cfg, bp.x, logr.Discard())
	bp.handled = map[string]chan int64{endpointA: make(chan int64, 1000), endpointB: make(chan int64, 1000)}
	bp.s.handled = func(p Publisher, seq int64) { bp.handled[p.Endpoint] <- seq }
	var mu sync.Mutex
	endpoints, changed := []string{endpointA, endpointB}, make(chan struct{})
	bp.set = func(e ...string) {
		mu.Lock()
		defer mu.Unlock()
		close(changed)
		endpoints, changed = e, make(chan struct{})
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		bp.s.Run(ctx, func() ([]string, <-chan struct{}) { mu.Lock(); defer mu.Unlock(); return endpoints, changed })
	}()
	t.Cleanup(func() { cancel(); <-done })
	bp.a = newTestPublisher(t, t.Context(), addr, false)
	bp.a.topic = "kv@" + endpointA + "@pdsim"
	bp.a.listenReplay(t.Context(), "tcp://127.0.0.1:"+strconv.Itoa(replay))
	bp.b = newTestPublisher(t, t.Context(), addr, false)
	bp.b.topic = "kv@" + endpointB + "@pdsim"
	warm(t, bp.a, bp.handled[endpointA])
	warm(t, bp.b, bp.handled[endpointB])
	return bp
}

// stall has a's replay socket tell of each request on the channel returned,
// and answer none until release is closed (never when nil).
func stall(a *testPublisher, release chan struct{}) <-chan struct{} {
	stalled := make(chan struct{}, 16)
	a.mu.Lock()
	a.stalled, a.release = stalled, release
	a.mu.Unlock()
	return stalled
}

// TestABoundEngineReplayHoldsNoOtherEngine: in bind mode one engine's gap,
// waiting on its replay socket, holds that engine's batches alone: another
// engine's are applied meanwhile, and the first one's view is not trusted
// until its replay is done.
func TestABoundEngineReplayHoldsNoOtherEngine(t *testing.T) {
	bp := bindTwo(t, Config{})
	stalled := stall(bp.a, nil)
	bp.a.publish(true, storedEvent(1, nil, seq(0, 4))) // lost
	bp.a.publish(false, storedEvent(2, nil, seq(100, 4)))
	<-stalled // a's replay is asked for, and hangs
	waitFor(t, bp.handled[endpointB], bp.b.publish(false, storedEvent(3, nil, seq(200, 4))))
	if n, ok := held(bp.x, endpointB, seq(200, 4)); n != 4 || !ok {
		t.Errorf("b's batch: held %d, trusted %v; want 4, true while a's replay is pending", n, ok)
	}
	if _, ok := held(bp.x, endpointA, seq(100, 4)); ok {
		t.Errorf("a's view is trusted while its gap's replay is pending")
	}
}

// TestABoundEngineHeldByItsReplayIsBounded: the batches an engine publishes
// while its replay is pending wait for it, in order, up to max_message_bytes
// of them: past that the replay is given up and the batches held are a
// stretch lost, as a gap not replayed (the view is rebuilt, not trusted for
// stale_after, and the replay counted failed), at once rather than at the
// replay's timeout (a minute here).
func TestABoundEngineHeldByItsReplayIsBounded(t *testing.T) {
	for _, tt := range []struct {
		name       string
		maxMessage int
		held       int // a's batches published while its replay is pending
		answer     bool
		wantTokens int // of a's chain, held after its last batch
		wantOK     bool
		wantFailed bool
	}{
		{"within the bound, replayed: applied in order", 64 << 10, 20, true, 4 * 22, true, false},
		{"over the bound: given up", 4 << 10, 200, false, 0, false, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			bp := bindTwo(t, Config{MaxMessageBytes: tt.maxMessage})
			var release chan struct{}
			if tt.answer {
				release = make(chan struct{})
			}
			stalled := stall(bp.a, release)
			failed := bp.s.Counts().ReplayFailed.Load()
			// a's chain of blocks, each the child of the one before: one
			// applied out of order would be an orphan, and the chain end there.
			bp.a.publish(true, storedEvent(1, nil, seq(0, 4))) // lost
			bp.a.publish(false, storedEvent(2, uint64(1), seq(4, 4)))
			<-stalled
			var last int64
			for i := range tt.held {
				last = bp.a.publish(false, storedEvent(uint64(i+3), uint64(i+2), seq(8+4*i, 4)))
			}
			waitFor(t, bp.handled[endpointB], bp.b.publish(false, storedEvent(1000, nil, seq(1000, 4))))
			if release != nil {
				close(release)
			}
			waitFor(t, bp.handled[endpointA], last)
			if n, ok := held(bp.x, endpointA, seq(0, 8+4*tt.held)); n != tt.wantTokens || ok != tt.wantOK {
				t.Errorf("a's chain held for %d tokens, trusted %v; want %d, %v", n, ok, tt.wantTokens, tt.wantOK)
			}
			if got := bp.s.Counts().ReplayFailed.Load() > failed; got != tt.wantFailed {
				t.Errorf("a replay counted failed: %v, want %v", got, tt.wantFailed)
			}
			if n, ok := held(bp.x, endpointB, seq(1000, 4)); n != 4 || !ok {
				t.Errorf("b's batch: held %d, trusted %v; want 4, true", n, ok)
			}
		})
	}
}

// TestABoundEngineLeavingTakesItsViewAlong: an endpoint that leaves the pool
// while its batches wait on its replay takes its view along once its
// goroutine has stopped, which rebuilds the view and applies its last batch
// first; the other engine's view stays.
func TestABoundEngineLeavingTakesItsViewAlong(t *testing.T) {
	bp := bindTwo(t, Config{})
	stalled := stall(bp.a, nil)
	bp.a.publish(true, storedEvent(1, nil, seq(0, 4))) // lost
	last := bp.a.publish(false, storedEvent(2, nil, seq(100, 4)))
	<-stalled
	bp.set(endpointB)
	waitFor(t, bp.handled[endpointA], last)
	eventually(t, "a's view forgotten", func() bool { return bp.x.Stats().Publishers == 1 })
	waitFor(t, bp.handled[endpointB], bp.b.publish(false, storedEvent(3, nil, seq(200, 4))))
	if n, ok := held(bp.x, endpointB, seq(200, 4)); n != 4 || !ok {
		t.Errorf("b's batch: held %d, trusted %v; want 4, true", n, ok)
	}
}
