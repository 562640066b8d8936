package kvevents

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// testPublisher publishes as vLLM's ZmqEventPublisher does: [topic, seq,
// payload] on a PUB socket, every batch kept for a ROUTER replay socket that
// answers [start] with each kept batch from start, then seq -1.
type testPublisher struct {
	t      *testing.T
	pub    zmq4.Socket
	topic  string
	mu     sync.Mutex
	kept   [][]byte // payloads by seq
	replay int      // the replay socket's port; 0: none
	// hole is a batch the replay socket leaves out, as a ROUTER past its
	// high-water mark drops one; 0: none.
	hole int64
	// stalled, when set, is told of each replay request, which then gets
	// no answer, as from an engine that hangs, or, when release is set, its
	// answer once release is closed.
	stalled, release chan struct{}
}

func newTestPublisher(t *testing.T, ctx context.Context, connect string, replay bool) *testPublisher {
	t.Helper()
	p := &testPublisher{t: t, pub: zmq4.NewPub(ctx)}
	t.Cleanup(func() { p.pub.Close() })
	if connect != "" {
		if err := p.pub.Dial(connect); err != nil {
			t.Fatal(err)
		}
	} else if err := p.pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	if replay {
		p.listenReplay(ctx, "tcp://127.0.0.1:0")
	}
	return p
}

// listenReplay has p answer replay requests on addr.
func (p *testPublisher) listenReplay(ctx context.Context, addr string) {
	r := zmq4.NewRouter(ctx)
	p.t.Cleanup(func() { r.Close() })
	if err := r.Listen(addr); err != nil {
		p.t.Fatal(err)
	}
	p.replay = r.Addr().(*net.TCPAddr).Port
	go p.serveReplay(r)
}

func (p *testPublisher) port() int { return p.pub.Addr().(*net.TCPAddr).Port }

func (p *testPublisher) serveReplay(r zmq4.Socket) {
	for {
		msg, err := r.Recv()
		if err != nil || len(msg.Frames) != 3 {
			return
		}
		id, start := msg.Frames[0], int(binary.BigEndian.Uint64(msg.Frames[2]))
		p.mu.Lock()
		kept, stalled, release := p.kept[min(start, len(p.kept)):], p.stalled, p.release
		p.mu.Unlock()
		if stalled != nil {
			stalled <- struct{}{}
			if release == nil {
				continue
			}
			<-release
		}
		for i, payload := range kept {
			if n := int64(start + i); n != p.hole || n == 0 {
				_ = r.Send(zmq4.NewMsgFrom(id, nil, seqBytes(n), payload))
			}
		}
		_ = r.Send(zmq4.NewMsgFrom(id, nil, seqBytes(-1), nil))
	}
}

func seqBytes(n int64) []byte { return binary.BigEndian.AppendUint64(nil, uint64(n)) }

// publish sends a batch of events as the next message, unless drop: then it
// only keeps it for replay, as if the network lost it. It returns the
// batch's sequence number.
func (p *testPublisher) publish(drop bool, events ...map[string]any) int64 {
	p.t.Helper()
	payload, err := msgpack.Marshal(map[string]any{"ts": 1.0, "events": events})
	if err != nil {
		p.t.Fatal(err)
	}
	p.mu.Lock()
	seq := int64(len(p.kept))
	p.kept = append(p.kept, payload)
	p.mu.Unlock()
	if !drop {
		if err := p.pub.Send(zmq4.NewMsgFrom([]byte(p.topic), seqBytes(seq), payload)); err != nil {
			p.t.Fatal(err)
		}
	}
	return seq
}

// restart starts the sequence over, as a restarted engine does.
func (p *testPublisher) restart() {
	p.mu.Lock()
	p.kept = nil
	p.mu.Unlock()
}

func storedEvent(hash uint64, parent any, tokens []int64) map[string]any {
	return map[string]any{"type": "BlockStored", "block_hashes": []uint64{hash}, "parent_block_hash": parent,
		"token_ids": tokens, "block_size": 4, "lora_id": nil, "medium": "GPU"}
}

// warm publishes empty batches until the subscriber has one (a SUB misses
// what was published before it joined), then one more, and returns once that
// one is handled: whatever handled says next is newer.
func warm(t *testing.T, p *testPublisher, handled <-chan int64) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for joined := false; !joined; {
		p.publish(false)
		select {
		case <-handled:
			joined = true
		case <-time.After(50 * time.Millisecond):
		case <-deadline:
			t.Fatal("the subscriber did not join")
		}
	}
	waitFor(t, handled, p.publish(false))
}

// waitFor waits until handled tells of seq.
func waitFor(t *testing.T, handled <-chan int64, seq int64) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case got := <-handled:
			if got == seq {
				return
			}
		case <-deadline:
			t.Fatalf("batch %d was not handled", seq)
		}
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func held(x *Index, endpoint string, tokens []int64) (int, bool) {
	h, known := x.Lookup([]string{endpoint}, tokens, Keys{})
	return h[endpoint], known[0]
}

// endpoint is the engine the tests' subscribers dial: its host, and the
// publisher's port.
const endpoint = "127.0.0.1:8000"

// follow starts a subscriber of p's engine, which it stops when the test
// ends, and returns its index, itself and what it handles.
func follow(t *testing.T, p *testPublisher) (*Index, *Subscriber, <-chan int64) {
	return followWith(t, Config{ConnectPort: p.port(), ReplayPort: p.replay, StaleAfter: time.Minute})
}

// followWith is follow with a config of the test's, for a pool of the
// endpoints given (endpoint when none).
func followWith(t *testing.T, cfg Config, endpoints ...string) (*Index, *Subscriber, <-chan int64) {
	if len(endpoints) == 0 {
		endpoints = []string{endpoint}
	}
	ctx, cancel := context.WithCancel(t.Context())
	x := NewIndex(Bounds{}, time.Minute, nil)
	s := NewSubscriber(cfg, x, logr.Discard())
	handled := make(chan int64, 1000)
	s.handled = func(_ Publisher, seq int64) { handled <- seq }
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.Run(ctx, func() ([]string, <-chan struct{}) { return endpoints, ctx.Done() })
	}()
	t.Cleanup(func() { cancel(); <-done })
	return x, s, handled
}

// TestSubscriberFollowsAStream: dialled as vLLM's default publisher expects,
// the subscriber indexes what the engine stores; a lost batch is asked of
// the replay socket, or without one the view starts over and is not trusted
// for StaleAfter; a sequence starting over is a restarted, empty engine.
func TestSubscriberFollowsAStream(t *testing.T) {
	for _, tt := range []struct {
		name        string
		replay      bool
		lose        bool // the second batch
		restart     bool // after the second batch
		wantHeld    int
		wantOK      bool
		wantReplays int64
	}{
		{name: "in order", wantHeld: 8, wantOK: true},
		{name: "a lost batch replayed", replay: true, lose: true, wantHeld: 8, wantOK: true, wantReplays: 1},
		{name: "a lost batch without replay", lose: true, wantHeld: 0, wantOK: false},
		{name: "a restarted engine", restart: true, wantHeld: 0, wantOK: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := newTestPublisher(t, t.Context(), "", tt.replay)
			x, s, handled := follow(t, p)
			warm(t, p, handled)
			replays := s.Counts().Replayed.Load() // the start's, asking for what was published before
			p.publish(false, storedEvent(1, nil, seq(0, 4)))
			p.publish(tt.lose, storedEvent(2, uint64(1), seq(4, 4)))
			if tt.restart {
				p.restart()
			}
			waitFor(t, handled, p.publish(false, storedEvent(3, nil, seq(1000, 4)))) // another prompt
			if n, ok := held(x, endpoint, seq(0, 8)); n != tt.wantHeld || ok != tt.wantOK {
				t.Errorf("held %d, ok %v; want %d, %v", n, ok, tt.wantHeld, tt.wantOK)
			}
			if got := s.Counts().Replayed.Load() - replays; got != tt.wantReplays {
				t.Errorf("%d replays, want %d", got, tt.wantReplays)
			}
		})
	}
}

// TestBoundSubscriberReadsTheEndpointFromTheTopic: engines that connect to
// the subscriber name their endpoint in their topic; a topic naming no
// endpoint of the pool is dropped and counted.
func TestBoundSubscriberReadsTheEndpointFromTheTopic(t *testing.T) {
	ctx := t.Context()
	port := freePort(t)
	x, s, handled := followWith(t, Config{Bind: "tcp://127.0.0.1:" + strconv.Itoa(port)}, "10.0.0.1:8000")
	known := newTestPublisher(t, ctx, "tcp://127.0.0.1:"+strconv.Itoa(port), false)
	known.topic = "kv@10.0.0.1:8000@pdsim"
	stranger := newTestPublisher(t, ctx, "tcp://127.0.0.1:"+strconv.Itoa(port), false)
	stranger.topic = "kv@10.9.9.9:8000@pdsim"
	warm(t, known, handled)
	waitFor(t, handled, known.publish(false, storedEvent(1, nil, seq(0, 4))))
	if n, ok := held(x, "10.0.0.1:8000", seq(0, 4)); n != 4 || !ok {
		t.Errorf("held %d, ok %v; want 4, true", n, ok)
	}
	eventually(t, "the stranger's batch dropped", func() bool {
		stranger.publish(false, storedEvent(1, nil, seq(0, 4)))
		return s.Counts().UnknownTopics.Load() > 0
	})
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// TestALateSubscriberReadsTheReplayBuffer: a router that starts after the
// engine has cached a prompt learns it from the replay socket, which keeps
// what was published before anyone subscribed. A replay that leaves out a
// batch past its first (vLLM's ROUTER drops what passes its high-water mark)
// may have lost a removal: the view holds nothing from before it (it starts
// over from the rest of the buffer, or, when nothing followed the hole, the
// live stream's gap finds it and the view is rebuilt).
func TestALateSubscriberReadsTheReplayBuffer(t *testing.T) {
	for _, tt := range []struct {
		name     string
		hole     int64
		wantHeld int
	}{
		{"whole", 0, 8},
		{"a batch left out", 2, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := newTestPublisher(t, t.Context(), "", true)
			p.hole = tt.hole
			// Nobody listens yet: the prompt, then a block stored and removed.
			p.publish(false, storedEvent(1, nil, seq(0, 4)), storedEvent(2, uint64(1), seq(4, 4)))
			p.publish(false, storedEvent(3, uint64(2), seq(8, 4)))
			p.publish(false, removed3())
			x, _, handled := follow(t, p)
			warm(t, p, handled)
			if n, ok := held(x, endpoint, seq(0, 12)); n != tt.wantHeld || tt.hole == 0 && !ok {
				t.Errorf("held %d, ok %v; want %d", n, ok, tt.wantHeld)
			}
		})
	}
}

func removed3() map[string]any {
	return map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{3}, "medium": "GPU"}
}

// TestHandleTellsARestartFromALateBatch: batches arrive in order on one
// connection, and a connection made anew cannot deliver batches published
// before it, so a number below what was read before is a restarted engine
// (vLLM numbers each process's batches from 0, and a reconnection can miss
// the first ones), except right after a replay that read ahead of the
// stream. A batch that cannot be read is lost, and so is the view; an event
// of an unknown type is counted and its neighbours applied.
func TestHandleTellsARestartFromALateBatch(t *testing.T) {
	batch := func(events ...map[string]any) []byte {
		payload, err := msgpack.Marshal(map[string]any{"ts": 1.0, "events": events})
		if err != nil {
			t.Fatal(err)
		}
		return payload
	}
	old, fresh := storedEvent(1, nil, seq(0, 4)), storedEvent(2, nil, seq(100, 4))
	for _, tt := range []struct {
		name      string
		st        stream // after batches up to 9, the first of which stored old
		seq       int64
		payload   []byte
		wantOld   int // of old's tokens held after
		wantFresh int
		wantOK    bool
		restarts  int64
	}{
		{"the next batch", stream{next: 10, live: 9}, 10, batch(fresh), 4, 4, true, 0},
		{"a connection made anew, a batch missed: a gap", stream{next: 10, live: -1}, 12, batch(fresh), 0, 0, false, 0},
		{"a connection made anew to a restarted engine", stream{next: 10, live: -1}, 3, batch(fresh), 0, 4, true, 1},
		{"a restarted engine's first batch", stream{next: 10, live: 9}, 0, batch(fresh), 0, 4, true, 1},
		{"a number going down on one connection", stream{next: 10, live: 9}, 5, batch(fresh), 0, 4, true, 1},
		{"a batch a replay at the start read already", stream{next: 10, live: -1, ahead: true}, 7, batch(fresh), 4, 0, true, 0},
		{"the first batch, which a replay at the start read already", stream{next: 10, live: -1, ahead: true}, 0, batch(fresh), 4, 0, true, 0},
		{"a batch that cannot be read", stream{next: 10, live: 9}, 10, []byte{0xc1}, 0, 0, false, 0},
		{"an event of an unknown type", stream{next: 10, live: 9}, 10,
			batch(map[string]any{"type": "BlockMigrated", "block_hashes": []int{1}}, fresh), 4, 4, true, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(Bounds{}, time.Minute, nil)
			s := NewSubscriber(Config{}, x, logr.Discard())
			st := tt.st
			st.pub = Publisher{Endpoint: endpoint}
			x.Reset(st.pub, true)
			s.apply(st.pub, batch(old))
			s.handle(t.Context(), &st, [][]byte{nil, seqBytes(tt.seq), tt.payload})
			n, ok := held(x, endpoint, seq(0, 4))
			m, _ := held(x, endpoint, seq(100, 4))
			if n != tt.wantOld || m != tt.wantFresh || ok != tt.wantOK {
				t.Errorf("held %d and %d, ok %v; want %d and %d, %v", n, m, ok, tt.wantOld, tt.wantFresh, tt.wantOK)
			}
			if got := s.Counts().Restarts.Load(); got != tt.restarts {
				t.Errorf("%d restarts, want %d", got, tt.restarts)
			}
		})
	}
}

// TestALeavingEndpointTakesItsViewAlong: an endpoint that leaves the pool
// while its follower waits on a replay leaves no view behind, though the
// follower, stopped, rebuilds the view and applies its last batch: the view
// is forgotten once the follower is done, not before.
func TestALeavingEndpointTakesItsViewAlong(t *testing.T) {
	p := newTestPublisher(t, t.Context(), "", true)
	ctx, cancel := context.WithCancel(t.Context())
	x := NewIndex(Bounds{}, time.Minute, nil)
	s := NewSubscriber(Config{ConnectPort: p.port(), ReplayPort: p.replay, StaleAfter: time.Minute, ReplayTimeout: time.Minute}, x, logr.Discard())
	handled := make(chan int64, 1000)
	s.handled = func(_ Publisher, seq int64) { handled <- seq }
	var mu sync.Mutex
	endpoints, changed := []string{endpoint}, make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.Run(ctx, func() ([]string, <-chan struct{}) { mu.Lock(); defer mu.Unlock(); return endpoints, changed })
	}()
	t.Cleanup(func() { cancel(); <-done })
	warm(t, p, handled)
	waitFor(t, handled, p.publish(false, storedEvent(1, nil, seq(0, 4))))

	stalled := make(chan struct{}, 10)
	p.mu.Lock()
	p.stalled = stalled
	p.mu.Unlock()
	p.publish(true, storedEvent(2, uint64(1), seq(4, 4))) // lost
	last := p.publish(false, storedEvent(3, nil, seq(100, 4)))
	<-stalled // the gap's replay is asked for, and hangs

	mu.Lock()
	left := changed
	endpoints, changed = nil, make(chan struct{})
	mu.Unlock()
	close(left)
	waitFor(t, handled, last) // applied by the stopped follower, after a rebuild
	eventually(t, "the view to be forgotten", func() bool { return x.Stats() == Stats{} })
}

// TestAConnectionMadeAnewTellsAnEngineThatStartedOver: an engine that
// restarted while the connection to it was down numbers its batches from 0
// again, and by the time a connection is made anew it may have published
// as many as before, or more: its numbers then read as the old engine's.
// The replay socket tells: it holds another batch under the number of the
// one applied last.
func TestAConnectionMadeAnewTellsAnEngineThatStartedOver(t *testing.T) {
	for _, tt := range []struct {
		name      string
		restart   bool
		published int // batches the engine has published when the connection is made anew
		wantOld   int // of the old engine's first block's tokens held after
		restarts  int64
	}{
		{"the same engine, nothing missed", false, 4, 4, 0},
		{"the same engine, batches missed", false, 8, 4, 0},
		{"an engine that started over, as many batches", true, 4, 0, 1},
		{"an engine that started over, more batches", true, 9, 0, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, x, s, st, deliver := replaying(t, -1)
			for i := range 4 { // the old engine's
				deliver(p.publish(true, storedEvent(uint64(i+1), nil, seq(4*i, 4))))
			}
			if tt.restart {
				p.restart()
			}
			for i := len(p.kept); i < tt.published; i++ {
				p.publish(true, storedEvent(uint64(100+i), nil, seq(1000+4*i, 4)))
			}
			st.live = -1 // the connection made anew
			deliver(p.publish(true, storedEvent(999, nil, seq(9000, 4))))
			if n, _ := held(x, endpoint, seq(0, 4)); n != tt.wantOld {
				t.Errorf("the old engine's first block held for %d tokens, want %d", n, tt.wantOld)
			}
			if n, _ := held(x, endpoint, seq(9000, 4)); n != 4 {
				t.Errorf("the batch delivered last is held for %d tokens, want 4", n)
			}
			if got := s.Counts().Restarts.Load(); got != tt.restarts {
				t.Errorf("%d restarts, want %d", got, tt.restarts)
			}
		})
	}
}

// TestAStoppedSubscriberLeavesNoReader: a subscriber stopped (a reload of
// kv_events, a resync, the endpoint leaving, shutdown) while its engine's
// batches wait unread in the socket's queue, here behind a replay that
// gets no answer, leaves no ZeroMQ reader behind: one blocked on the full
// queue stayed blocked for good, holding its connection's batch.
func TestAStoppedSubscriberLeavesNoReader(t *testing.T) {
	stuck := stuckReaders
	before := stuck()
	p := newTestPublisher(t, t.Context(), "", true)
	stalled := make(chan struct{}, 16)
	p.mu.Lock()
	p.stalled = stalled
	p.mu.Unlock()
	ctx, stop := context.WithCancel(t.Context())
	s := NewSubscriber(Config{ConnectPort: p.port(), ReplayPort: p.replay, ReplayTimeout: time.Minute, StaleAfter: time.Minute},
		NewIndex(Bounds{}, time.Minute, nil), logr.Discard())
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.Run(ctx, func() ([]string, <-chan struct{}) { return []string{endpoint}, ctx.Done() })
	}()
	<-stalled // subscribed, and waiting on its replay: nothing reads the queue
	eventually(t, "a reader blocked on the full queue", func() bool { p.publish(false); return stuck() > before })
	stop()
	<-done
	eventually(t, "the stopped subscriber's readers gone", func() bool { return stuck() <= before })
}

// Each endpoint follows its own engine's publishers: every rank of an
// endpoint alone on its host (one server of several data-parallel ranks),
// and rank i alone of the endpoint on its host's i-th lowest port (a server
// per rank, an InferencePool's targetPorts), which would otherwise be
// credited with every rank's cache.
func TestEachEndpointFollowsItsOwnRanks(t *testing.T) {
	tests := []struct {
		name  string
		addrs []string
		ranks int
		want  []Publisher
	}{
		{"one endpoint per host", []string{"10.0.0.1:8000", "10.0.0.2:8000"}, 1,
			[]Publisher{{"10.0.0.1:8000", 0}, {"10.0.0.2:8000", 0}}},
		{"one server of two ranks", []string{"10.0.0.1:8000"}, 2,
			[]Publisher{{"10.0.0.1:8000", 0}, {"10.0.0.1:8000", 1}}},
		{"a server per rank, by port", []string{"10.0.0.1:8001", "10.0.0.1:8000", "10.0.0.2:8000"}, 2,
			[]Publisher{{"10.0.0.1:8001", 1}, {"10.0.0.1:8000", 0}, {"10.0.0.2:8000", 0}, {"10.0.0.2:8000", 1}}},
		{"IPv6", []string{"[fd00::1]:8000", "[fd00::1]:8001"}, 1,
			[]Publisher{{"[fd00::1]:8000", 0}, {"[fd00::1]:8001", 1}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := publishers(tt.addrs, tt.ranks); !slices.Equal(got, tt.want) {
				t.Errorf("publishers(%v, %d) = %v, want %v", tt.addrs, tt.ranks, got, tt.want)
			}
		})
	}
}

// A topic names its endpoint as the engine's environment spells it: an IPv6
// pod's $(POD_IP) unbracketed, an address in capitals or IPv4-mapped. Each
// is read in the spelling of the pool's endpoints.
func TestTopicEndpoint(t *testing.T) {
	tests := []struct {
		topic, want string
		ok          bool
	}{
		{"kv@10.0.0.1:8000@pdsim", "10.0.0.1:8000", true},
		{"kv@[fd00::1]:8000@pdsim", "[fd00::1]:8000", true},
		{"kv@fd00::1:8000@pdsim", "[fd00::1]:8000", true},
		{"kv@[FD00:0::1]:8000@pdsim", "[fd00::1]:8000", true},
		{"kv@::ffff:10.0.0.1:8000@pdsim", "10.0.0.1:8000", true},
		{"kv@10.0.0.1:8000", "10.0.0.1:8000", true},
		{"kv@engine:8000@pdsim", "", false},
		{"kv@10.0.0.1@pdsim", "", false},
		{"kv@10.0.0.1:port@pdsim", "", false},
		{"kv@[fe80::1%eth0]:8000@pdsim", "", false},
		{"other@10.0.0.1:8000@pdsim", "", false},
	}
	for _, tt := range tests {
		got, ok := topicEndpoint([][]byte{[]byte(tt.topic), nil, nil})
		if got != tt.want || ok != tt.ok {
			t.Errorf("%s: %q, %v; want %q, %v", tt.topic, got, ok, tt.want, tt.ok)
		}
	}
}

// countedProxy forwards TCP connections to addr and counts them: the
// connections a subscriber makes to a publisher.
func countedProxy(t *testing.T, addr string) (port int, connections *atomic.Int64) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	connections = new(atomic.Int64)
	go func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			connections.Add(1)
			out, err := net.Dial("tcp", addr)
			if err != nil {
				in.Close()
				continue
			}
			go func() { io.Copy(out, in); out.Close() }()
			go func() { io.Copy(in, out); in.Close() }()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port, connections
}

// TestABusyConnectionIsKept: a connection that delivers is not made anew
// at resync, as a new one loses what is published while it joins, and
// without a replay socket a busy engine's view then starts over. One
// silent for resync is made anew (the ZeroMQ library can miss a restarted
// peer, and then delivers nothing).
func TestABusyConnectionIsKept(t *testing.T) {
	const resync = time.Second
	p := newTestPublisher(t, t.Context(), "", false)
	port, connections := countedProxy(t, p.pub.Addr().String())
	_, s, handled := followWith(t, Config{ConnectPort: port, StaleAfter: time.Minute, Resync: resync})
	warm(t, p, handled)
	before := connections.Load()
	for i := range 200 { // 2 resyncs' worth, a batch every 10 ms
		waitFor(t, handled, p.publish(false, storedEvent(uint64(i+1), nil, seq(4*i, 4))))
		time.Sleep(10 * time.Millisecond) // the engine's pace: what is measured is connections while it publishes
	}
	if n := connections.Load() - before; n != 0 {
		t.Errorf("%d connections made anew while the engine published every 10 ms, want none", n)
	}
	if g := s.Counts().Gaps.Load(); g != 0 {
		t.Errorf("%d gaps", g)
	}
	eventually(t, "a connection made anew after a silence", func() bool { return connections.Load() > before })
}

// stuckReaders counts zmq4 readers blocked for good handing a message to a
// socket's full queue (closeDrained).
func stuckReaders() int {
	buf := make([]byte, 8<<20)
	n := 0
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if strings.Contains(g, "zmq4.(*qreader).listen") && strings.Contains(g, "chan send") {
			n++
		}
	}
	return n
}

// A gap's replay reads up to the batch that showed it, while vLLM's replay
// socket sends its whole buffer from the lost one on: what it sends past
// that must not leave the replay socket's reader blocked for good, holding
// its batches (one per gap, on a busy engine).
func TestAGapsReplayLeavesNoReader(t *testing.T) {
	before := stuckReaders()
	p, _, s, _, deliver := replaying(t, 0)
	deliver(p.publish(true))
	p.publish(true) // lost
	gap := p.publish(true)
	for range 30 { // published since, by a busy engine
		p.publish(true)
	}
	deliver(gap)
	if got := s.Counts().Replayed.Load(); got != 1 {
		t.Fatalf("%d replays, want the gap's", got)
	}
	eventually(t, "the replay socket's readers gone", func() bool { return stuckReaders() <= before })
}

// A replay socket that gives nothing when a subscriber first joins (out of
// reach, or an engine that has published nothing) leaves the view as without
// one: the first batch delivered starts the stream, and is no gap that
// would distrust the view for stale_after after every start.
func TestAFirstReplayThatGaveNothingLeavesNoGap(t *testing.T) {
	x := NewIndex(Bounds{}, time.Minute, nil)
	s := NewSubscriber(Config{ReplayPort: freePort(t), ReplayTimeout: time.Second}, x, logr.Discard())
	st := &stream{pub: Publisher{Endpoint: endpoint}, next: -1, live: -1}
	x.Reset(st.pub, true)
	s.catchUp(t.Context(), st)
	payload, err := msgpack.Marshal(map[string]any{"ts": 1.0, "events": []any{storedEvent(1, nil, seq(0, 4))}})
	if err != nil {
		t.Fatal(err)
	}
	s.handle(t.Context(), st, [][]byte{nil, seqBytes(5), payload})
	if gaps, failed := s.Counts().Gaps.Load(), s.Counts().ReplayFailed.Load(); gaps != 0 || failed != 0 {
		t.Errorf("%d gaps and %d failed replays counted, want none", gaps, failed)
	}
	if n, ok := held(x, endpoint, seq(0, 4)); !ok || n != 4 {
		t.Errorf("the view holds %d tokens (trusted %v), want the batch's 4, trusted", n, ok)
	}
}

// replaying is a subscriber of one publisher with a replay socket, its
// stream expecting batch next (-1: none read yet), driven by hand: deliver
// hands it the publisher's batch seq, published or not.
func replaying(t *testing.T, next int64) (p *testPublisher, x *Index, s *Subscriber, st *stream, deliver func(seq int64)) {
	p = newTestPublisher(t, t.Context(), "", true)
	x = NewIndex(Bounds{}, time.Minute, nil)
	s = NewSubscriber(Config{ReplayPort: p.replay, ReplayTimeout: 10 * time.Second}, x, logr.Discard())
	st = &stream{pub: Publisher{Endpoint: endpoint}, next: next, live: -1}
	x.Reset(st.pub, true)
	deliver = func(seq int64) {
		p.mu.Lock()
		payload := p.kept[seq]
		p.mu.Unlock()
		s.handle(t.Context(), st, [][]byte{nil, seqBytes(seq), payload})
	}
	return p, x, s, st, deliver
}

// TestChurnLeavesNoFollower: endpoints that join and leave the pool, over
// and over (discovery churn), leave no goroutine behind: a departed
// endpoint's follower and its connection's readers end with it, and
// everything once the subscriber stops.
func TestChurnLeavesNoFollower(t *testing.T) {
	p := newTestPublisher(t, t.Context(), "", false)
	before := runtime.NumGoroutine()
	ctx, cancel := context.WithCancel(t.Context())
	x := NewIndex(Bounds{}, time.Minute, nil)
	s := NewSubscriber(Config{ConnectPort: p.port(), StaleAfter: time.Minute}, x, logr.Discard())
	var mu sync.Mutex
	addrs, changed := []string{endpoint}, make(chan struct{})
	set := func(a ...string) {
		mu.Lock()
		left := changed
		addrs, changed = a, make(chan struct{})
		mu.Unlock()
		close(left)
		eventually(t, "the pool's views followed", func() bool { return x.Stats().Publishers == len(a) })
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.Run(ctx, func() ([]string, <-chan struct{}) { mu.Lock(); defer mu.Unlock(); return addrs, changed })
	}()
	for _, pool := range [][]string{{endpoint}, {endpoint, "127.0.0.2:8000", "127.0.0.3:8000", "127.0.0.4:9000"}, {"127.0.0.2:8000"}, {}} {
		for range 10 {
			set(pool...)
			set(endpoint, "127.0.0.5:8000")
		}
	}
	set()
	eventually(t, "the departed endpoints' goroutines gone", func() bool { return runtime.NumGoroutine() <= before+1 }) // Run's
	cancel()
	<-done
	eventually(t, "every goroutine gone", func() bool { return runtime.NumGoroutine() <= before })
}
