package scheduling

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

var defaultLines = Lines{config.DefaultSaturatedQueue, config.DefaultSaturatedKVCache}

// A hold releases only on a new scrape, as many requests as this replica's
// share of the room the scrape shows (at least one), higher priorities
// first and then by arrival; a request arriving behind held ones waits its
// turn; one whose time is up is refused.
func TestTheHoldReleasesItsShareOfTheRoomByPriority(t *testing.T) {
	const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
	type engine struct{ waiting, running float64 }
	steps := []struct {
		name     string
		scrape   map[string]engine // nil: no new scrape
		add      map[string]int    // name → priority, added in name order
		advance  time.Duration
		released []string
		refused  []string
		held     []string // that Add held, of those it was given
	}{
		{name: "idle: a request goes at once", scrape: map[string]engine{a: {0, 0}, b: {0, 0}}, add: map[string]int{"early": -1}},
		{name: "saturated: every request is held", scrape: map[string]engine{a: {5, 8}, b: {6, 8}},
			add: map[string]int{"x1": -1, "x2": -5, "x3": -1, "x4": -1}, held: []string{"x1", "x2", "x3", "x4"}},
		// Four requests of this replica's in flight (acquired below) of the engines' 16:
		// a share of a quarter of 8 places.
		{name: "room for 8, a quarter of it ours", scrape: map[string]engine{a: {1, 7}, b: {1, 7}}, released: []string{"x1", "x3"}},
		{name: "no scrape since: nothing more", add: map[string]int{"x5": -1}, held: []string{"x5"}},
		{name: "one place: at least one goes", scrape: map[string]engine{a: {4, 20}, b: {5, 20}}, released: []string{"x4"}},
		{name: "time up", advance: 31 * time.Second, refused: []string{"x5", "x2"}},
		{name: "empty again: a request goes at once", scrape: map[string]engine{a: {0, 0}, b: {0, 0}}, add: map[string]int{"late": -1}},
	}
	p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, a, b)
	for range 2 {
		acquire(byAddr(p, a))
		acquire(byAddr(p, b))
	}
	h := holdAt(p, defaultLines, time.Minute)
	var released, refused []string
	for _, st := range steps {
		clock.Advance(time.Second + st.advance)
		for addr, e := range st.scrape {
			byAddr(p, addr).observe(Load{Waiting: e.waiting, Running: e.running, At: clock.Now()})
		}
		var held []string
		names := make([]string, 0, len(st.add))
		for name := range st.add {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			if h.Add(promptRequest(name), st.add[name], "", clock.Now().Add(30*time.Second), func(ok bool) {
				if ok {
					released = append(released, name)
				} else {
					refused = append(refused, name)
				}
			}) {
				held = append(held, name)
			}
		}
		released, refused = nil, nil
		h.Release()
		if !slices.Equal(held, st.held) || !slices.Equal(released, st.released) || !slices.Equal(refused, st.refused) {
			t.Errorf("%s: held %v, released %v, refused %v; want %v, %v, %v", st.name, held, released, refused, st.held, st.released, st.refused)
		}
	}
	if n := h.Len(); n != 0 {
		t.Errorf("%d requests still held", n)
	}
}

// The endpoints of a pool answer their scrapes one by one, each stamped as
// it comes: a hold releases once a round, when every healthy endpoint with
// fresh figures has answered again, not once per answer.
func TestTheHoldReleasesOnceAScrapeRound(t *testing.T) {
	const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
	p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, a, b)
	scrape := func(addr string, waiting float64) {
		clock.Advance(5 * time.Millisecond)
		byAddr(p, addr).observe(Load{Waiting: waiting, At: clock.Now()})
	}
	scrape(a, 5)
	scrape(b, 5)
	h := holdAt(p, defaultLines, time.Minute)
	released := 0
	for i := range 4 {
		h.Add(promptRequest(fmt.Sprint("held ", i)), -1, "", clock.Now().Add(time.Minute), func(ok bool) {
			if ok {
				released++
			}
		})
	}
	steps := []struct {
		name    string
		scrape  func()
		release int // in all, after the step
	}{
		{"a round of full queues", func() { scrape(a, 5); scrape(b, 5) }, 0},
		{"a answers with room, b not yet", func() { scrape(a, 4) }, 0},
		{"b answers: the round is whole", func() { scrape(b, 5) }, 1},
		{"a answers again, b not yet", func() { scrape(a, 4) }, 1},
		{"b's scrape fails: a's answer makes the round", func() { byAddr(p, b).scrapeFailed(scrapeTimeout) }, 2},
		{"b answers again, a not yet", func() { scrape(b, 5) }, 2},
		{"a answers: the round is whole", func() { scrape(a, 4) }, 3},
		{"b ejected: a's answers make the rounds", func() {
			for range 3 {
				byAddr(p, b).ReportFailure()
			}
			scrape(a, 4)
		}, 4},
	}
	for _, st := range steps {
		st.scrape()
		h.Release()
		if released != st.release {
			t.Errorf("%s: %d released in all, want %d", st.name, released, st.release)
		}
	}
}

// Within a priority the flows take turns, the one served least lately first
// (a flow that floods the hold does not starve one that sends a request
// now and then), each flow's requests by arrival; a higher priority still
// goes first.
func TestFlowsTakeTurnsInTheHold(t *testing.T) {
	const a = "10.0.0.1:8000"
	p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, a)
	byAddr(p, a).observe(Load{Waiting: 5, At: clock.Now()})
	for range 2 { // the two the engine counts are this replica's: the whole room is its to fill
		acquire(byAddr(p, a))
	}
	h := holdAt(p, defaultLines, time.Minute)
	var released []string
	add := func(name, fairness string, priority int) {
		if !h.Add(promptRequest(name), priority, fairness, clock.Now().Add(time.Minute), func(ok bool) {
			if ok {
				released = append(released, name)
			}
		}) {
			t.Fatalf("%s went at once", name)
		}
	}
	for i := range 4 {
		add(fmt.Sprint("flood-", i), "tenant-a", -1)
	}
	add("b-0", "tenant-b", -1)
	add("none-0", "", -1)
	add("b-1", "tenant-b", -1)
	add("low-0", "tenant-c", -2)
	add("urgent-0", "tenant-a", 0)
	for _, room := range []float64{3, 3, 3} { // three places a scrape
		clock.Advance(time.Second)
		byAddr(p, a).observe(Load{Waiting: 5 - room, At: clock.Now()})
		h.Release()
	}
	want := []string{"urgent-0", "flood-0", "b-0", "none-0", "flood-1", "b-1", "flood-2", "flood-3", "low-0"}
	if !slices.Equal(released, want) {
		t.Errorf("released in the order %v, want %v", released, want)
	}
}

// A flow served lately goes behind those served less lately, even when it
// had nothing held between its turns: one that empties the hold at each
// release and sends again before the next does not take every place from
// a flow that floods it (nor does a flow that goes away and comes back).
func TestAFlowThatComesBackTakesItsTurn(t *testing.T) {
	const a = "10.0.0.1:8000"
	tests := []struct {
		name   string
		rounds [][]string // the flows of the requests added before each release, one place a release
		want   []string   // the flows released, in order
	}{
		{"one request a round against a flood",
			[][]string{{"flood", "flood", "flood", "flood"}, {"steady"}, {"steady"}, {"steady"}, {}},
			[]string{"flood", "steady", "flood", "steady", "flood"}},
		{"a newcomer goes ahead of flows served since it arrived",
			[][]string{{"a", "a", "b", "b"}, {"c"}, {}, {}},
			[]string{"a", "b", "c", "a"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, a)
			h := holdAt(p, defaultLines, time.Minute)
			byAddr(p, a).observe(Load{Waiting: 5, At: clock.Now()})
			var released []string
			for i, add := range tt.rounds {
				for j, flow := range add {
					if !h.Add(promptRequest(fmt.Sprint(flow, i, j)), -1, flow, clock.Now().Add(time.Minute), func(ok bool) {
						if ok {
							released = append(released, flow)
						}
					}) {
						t.Fatalf("round %d: a request of %s went at once", i, flow)
					}
				}
				clock.Advance(time.Second)
				byAddr(p, a).observe(Load{Waiting: 4, Running: 8, At: clock.Now()}) // one place, this replica's share less than one
				h.Release()
			}
			if !slices.Equal(released, tt.want) {
				t.Errorf("released %v, want %v", released, tt.want)
			}
		})
	}
}

// Wait returns when its request is released, when its time is up
// (ErrStillSaturated) or when its client is gone (the context's error,
// the request no longer held).
func TestWaitEndsOnReleaseTimeOrCancel(t *testing.T) {
	const a = "10.0.0.1:8000"
	tests := []struct {
		name string
		end  func(p *Pool, clock *fakeClock, cancel context.CancelFunc)
		want error
	}{
		{"room", func(p *Pool, clock *fakeClock, _ context.CancelFunc) {
			byAddr(p, a).observe(Load{Waiting: 0, At: clock.Now()})
		}, nil},
		{"time up", func(_ *Pool, clock *fakeClock, _ context.CancelFunc) { clock.Advance(11 * time.Second) }, ErrStillSaturated},
		{"client gone", func(_ *Pool, _ *fakeClock, cancel context.CancelFunc) { cancel() }, context.Canceled},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, a)
			byAddr(p, a).observe(Load{Waiting: 9, At: clock.Now()})
			h := holdAt(p, defaultLines, 10*time.Second)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			done := make(chan error, 1)
			go func() {
				_, err := h.Wait(ctx, promptRequest("held"), "batch", "", 0)
				done <- err
			}()
			for h.Len() == 0 { // held: Wait has added it
				select {
				case err := <-done:
					t.Fatalf("Wait returned %v before it was held", err)
				default:
					runtime.Gosched()
				}
			}
			clock.Advance(time.Second)
			tt.end(p, clock, cancel)
			if err := <-done; !errors.Is(err, tt.want) {
				t.Errorf("Wait: %v, want %v", err, tt.want)
			}
			if n := h.Len(); n != 0 {
				t.Errorf("%d still held", n)
			}
		})
	}
}

// Wait holds only the requests of an objective Set's priorities shed: one
// whose objective a reload stopped shedding after its caller read the old
// priority goes at once, its pool saturated.
func TestWaitHoldsOnlyTheObjectivesSetSheds(t *testing.T) {
	const a = "10.0.0.1:8000"
	tests := []struct {
		objective string
		wantHeld  bool
	}{
		{"batch", true},        // -1
		{"chat", false},        // 0
		{"interactive", false}, // not named
		{"", false},
	}
	for _, tt := range tests {
		t.Run(tt.objective, func(t *testing.T) {
			p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, a)
			byAddr(p, a).observe(Load{Waiting: 9, At: clock.Now()})
			h := NewHold(p)
			h.Set(defaultLines, time.Minute, map[string]int{"batch": -1, "chat": 0})
			ctx, cancel := context.WithCancel(t.Context())
			cancel() // a held request gives up at once, its client gone
			held, err := h.Wait(ctx, promptRequest("r"), tt.objective, "", 0)
			if held != tt.wantHeld || held != (err != nil) {
				t.Errorf("Wait: held %v, %v; want held %v", held, err, tt.wantHeld)
			}
		})
	}
}

// BenchmarkHold is one request held and released per scrape, the cost a
// held request adds to its routing beside the wait itself.
func BenchmarkHold(b *testing.B) {
	addrs := make([]string, 16)
	for i := range addrs {
		addrs[i] = fmt.Sprintf("10.0.0.%d:8000", i+1)
	}
	p, clock := testPool(b, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, addrs...)
	h, req := holdAt(p, defaultLines, time.Minute), promptRequest("held")
	for b.Loop() {
		for _, e := range p.Endpoints() {
			e.observe(Load{Waiting: 5, At: clock.Now()})
		}
		h.Add(req, -1, "", clock.Now().Add(time.Minute), func(bool) {})
		clock.Advance(time.Second)
		p.Endpoints()[0].observe(Load{Waiting: 0, At: clock.Now()})
		h.Release()
	}
}

// A held request goes on as soon as its pool is not saturated, by the same
// measure that held it (Saturated): under a queue line below one request, a
// queue of none is room; and with every endpoint down nothing will show room,
// so the request goes on to its 503. Both waited the whole hold, then 429.
func TestAHeldRequestGoesOnOnceItsPoolIsNotSaturated(t *testing.T) {
	const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
	for _, tt := range []struct {
		name  string
		addrs []string
		lines Lines
		down  bool
	}{
		{"a queue line below one, its engine idle again", []string{a}, Lines{Queue: 0.5, KVCache: 0.8}, false},
		{"every endpoint down", []string{a, b}, defaultLines, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, tt.addrs...)
			scrape := func(waiting float64) {
				for _, x := range tt.addrs {
					byAddr(p, x).observe(Load{Waiting: waiting, Running: 8, At: clock.Now()})
				}
			}
			scrape(9)
			h := holdAt(p, tt.lines, time.Minute)
			var released, refused int
			if !h.Add(promptRequest("x"), -1, "", clock.Now().Add(30*time.Second), func(ok bool) {
				if ok {
					released++
				} else {
					refused++
				}
			}) {
				t.Fatal("not held while every engine's queue is past the line")
			}
			if tt.down {
				checkDown(p, tt.addrs...)
			}
			clock.Advance(time.Second)
			scrape(0)
			if p.Saturated(promptRequest("x"), tt.lines) {
				t.Fatal("the pool still reads as saturated")
			}
			h.Release()
			if released != 1 || refused != 0 {
				t.Errorf("after a scrape of a pool that is not saturated: %d released, %d refused; want it released", released, refused)
			}
		})
	}
}

// A flood of distinct fairness ids, each long, while the pool stays
// saturated (the hold never empties, a flow never served always waits) is
// remembered within bounds: the flows served are forgotten past a number,
// and a long id is kept as a digest, not whole.
func TestAFloodOfFairnessIDsIsRememberedWithinBounds(t *testing.T) {
	const a = "10.0.0.1:8000"
	p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, a)
	h := holdAt(p, defaultLines, time.Minute)
	byAddr(p, a).observe(Load{Waiting: 5, At: clock.Now()})
	long := strings.Repeat("x", 1024)
	released := 0
	for i := range 6_000 {
		for j := range 2 { // two new flows a round, one place a release: the hold never empties
			id := fmt.Sprint(long, i, "-", j)
			if !h.Add(promptRequest(id), -1, id, clock.Now().Add(3*time.Second), func(ok bool) {
				if ok {
					released++
				}
			}) {
				t.Fatalf("round %d: a request went at once", i)
			}
		}
		clock.Advance(time.Second)
		byAddr(p, a).observe(Load{Waiting: 4, Running: 8, At: clock.Now()})
		h.Release()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	bytes := 0
	for f := range h.served {
		bytes += len(f.id)
	}
	if released < 5_000 {
		t.Fatalf("%d released, want one a round", released)
	}
	if n := len(h.served); n > maxFlows+len(h.held) {
		t.Errorf("%d flows remembered after %d released, want at most %d", n, released, maxFlows+len(h.held))
	}
	if bytes > 1<<20 {
		t.Errorf("the flows remembered hold %d bytes of ids, want at most 1 MiB", bytes)
	}
}
