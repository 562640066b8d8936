package scheduling

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"
)

// holdTick is how often a Hold with requests in it looks for a new scrape
// and for requests whose time is up: reading the endpoints' figures costs
// nothing next to a scrape.
const holdTick = 25 * time.Millisecond

// Hold keeps the requests that met their pool saturated until it has room
// for them or their time is up, rather than refusing them at once: the
// Gateway API Inference Extension's flow control. Higher priorities go
// first; within a priority the flows (the clients' fairness ids) take turns,
// the one served least lately first, and a flow's requests go by arrival. It
// releases only on a new scrape of the engines' figures, as many requests as
// its share of the room they show (budget): several replicas read the same
// figures, and each releasing the whole room would send the engines as many
// times the room as there are replicas.
type Hold struct {
	Pool *Pool // whose requests it holds

	mu         sync.Mutex
	held       []*waiter       // higher priority first, then by arrival
	served     map[flow]uint64 // when each flow with requests held was last served, by serial
	serial     uint64          // releases so far
	round      time.Time       // the scrape last released on
	lines      Lines           // Set's
	hold       time.Duration   // Set's: the longest a request is held, in all
	priorities map[string]int  // Set's: each objective's priority, 0 for one not named
	ticking    bool            // a goroutine runs tick
	closed     bool            // Close: holds nothing any more
	wake       chan struct{}   // nudge's word to tick: judge again now
}

// waiter is a request in a Hold. done is called once, with nil when it is
// released, ErrStillSaturated when its time is up first, ErrHoldClosed at
// Close.
type waiter struct {
	req       *Request
	objective string // Wait's; "" for Add's
	flow      flow
	since     time.Time // when its time in the holds began
	until     time.Time
	done      func(error)
}

// NewHold returns an empty hold for pool's requests.
func NewHold(pool *Pool) *Hold {
	return &Hold{Pool: pool, served: map[flow]uint64{}, wake: make(chan struct{}, 1)}
}

// Set applies the saturation lines, the hold and the objectives'
// priorities, at start and at each reload, to the requests held and to come,
// and has the hold judge those held again at once by the figures in hand
// rather than at the next scrape: a reload that unsaturates a pool releases
// them. A held request whose objective is shed no more (its priority 0 or
// more, or gone) is released at once, its pool saturated or not: no reload
// leaves it to wait, or refuses it at a hold cut to 0 with the last negative
// priority. Another's time is cut to its start + hold where that is sooner,
// never lengthened: Envoy's message timer and the client's were set by the
// hold it met.
func (h *Hold) Set(lines Lines, hold time.Duration, priorities map[string]int) {
	h.mu.Lock()
	if lines != h.lines {
		h.lines, h.round = lines, time.Time{} // the last round's figures are a new round by the new lines
	}
	h.hold, h.priorities = hold, priorities
	var released []*waiter
	h.held = slices.DeleteFunc(h.held, func(x *waiter) bool {
		if x.objective != "" && priorities[x.objective] >= 0 { // Add's keep Add's priority
			released = append(released, x)
			return true
		}
		if end := x.since.Add(hold); end.Before(x.until) {
			x.until = end
		}
		return false
	})
	h.mu.Unlock()
	for _, x := range released {
		x.done(nil)
	}
	h.nudge()
}

// nudge has tick judge the requests held now, not at its next tick.
func (h *Hold) nudge() {
	select {
	case h.wake <- struct{}{}:
	default: // a word is waiting already
	}
}

// Len is the number of requests held.
func (h *Hold) Len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.held)
}

// Wait holds req, of that objective and fairness id, until the pool has room
// for it or Set sheds its objective no more (nil), its time is up
// (ErrStillSaturated: the hold Set gave, less what it was held already) or
// ctx is done (its error); held says it waited. A request goes at once when
// Set's priorities do not shed its objective (0 or more), or when nothing is
// held and its pool is not saturated: one arriving behind held requests
// waits its turn. Once the hold
// is closed, one it would hold ends at once with ErrHoldClosed.
func (h *Hold) Wait(ctx context.Context, req *Request, objective, fairness string, already time.Duration) (held bool, err error) {
	result := make(chan error, 1)
	x := &waiter{req: req, objective: objective, since: h.Pool.deps.Now().Add(-already), done: func(err error) { result <- err }}
	h.mu.Lock()
	priority := h.priorities[objective]
	if priority >= 0 { // shed no more since the caller read its priority
		h.mu.Unlock()
		return false, nil
	}
	x.flow, x.until = flowOf(fairness, priority), x.since.Add(h.hold)
	held, err = h.add(x)
	if held && !h.ticking {
		h.ticking = true
		go h.tick()
	}
	h.mu.Unlock()
	if !held {
		return false, err
	}
	select {
	case err := <-result:
		return true, err
	case <-ctx.Done():
		if !h.remove(x) { // released or ended meanwhile: its answer stands
			return true, <-result
		}
		return true, ctx.Err()
	}
}

var (
	// ErrStillSaturated is Wait's error when a request's time in the hold
	// ran out with its pool still saturated.
	ErrStillSaturated = errors.New("the pool stayed saturated while the request was held")
	// ErrHoldClosed is Wait's error once the hold is closed (Close).
	ErrHoldClosed = errors.New("the server is shutting down and holds no request for room")
)

// Close ends the hold, at shutdown: the requests held end at once with
// ErrHoldClosed, as do those it would hold from now on. No room will come
// in time for them: the shutdown's grace would run out first and cut their
// streams.
func (h *Hold) Close() {
	h.mu.Lock()
	held := h.held
	h.held, h.closed = nil, true
	h.mu.Unlock()
	for _, x := range held {
		x.done(ErrHoldClosed)
	}
	h.nudge() // tick finds the hold empty and stops
}

// Add is Wait without the waiting: it holds req (true), and Release calls
// done, or says it may go at once (false). The simulations drive it with
// their own clock, and never close the hold; a request held by Add names no
// objective, and keeps the priority given whatever Set gives.
func (h *Hold) Add(req *Request, priority int, fairness string, until time.Time, done func(released bool)) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	held, _ := h.add(&waiter{req: req, flow: flowOf(fairness, priority), since: until.Add(-h.hold), until: until,
		done: func(err error) { done(err == nil) }})
	return held
}

func (h *Hold) add(x *waiter) (bool, error) {
	if len(h.held) == 0 && !h.Pool.Saturated(x.req, h.lines) {
		return false, nil
	}
	if h.closed {
		return false, ErrHoldClosed
	}
	i, _ := slices.BinarySearchFunc(h.held, x.flow.priority, func(y *waiter, p int) int {
		if y.flow.priority >= p { // behind those of its priority and higher
			return -1
		}
		return 1
	})
	h.held = slices.Insert(h.held, i, x)
	return true, nil
}

// remove takes x out of the hold, if it is still there.
func (h *Hold) remove(x *waiter) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	i := slices.Index(h.held, x)
	if i < 0 {
		return false
	}
	h.held = slices.Delete(h.held, i, i+1)
	return true
}

// tick releases, every holdTick and when nudged, until the hold is empty.
func (h *Hold) tick() {
	t := time.NewTicker(holdTick)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-h.wake:
		}
		if h.Release() == 0 {
			return
		}
	}
}

// Release ends the time of the requests whose time is up and, when every
// endpoint's figures were scraped again since it last released
// (scrapeSpan) or Set changed the lines, releases as many of the others as
// budget allows (next picks each), each only while its own pool (its
// model's endpoints, its subset) is not saturated. With no healthy endpoint
// left to show room, every request whose pool is not saturated by then
// (Saturated: a pool without one is not) goes on, to the answer routing
// gives it. It returns how many requests are still held; at 0 the ticking
// stops, for the next Wait to start again.
func (h *Hold) Release() int {
	now := h.Pool.deps.Now()
	st := h.Pool.state.Load()
	h.mu.Lock()
	var ended, released []*waiter
	h.held = slices.DeleteFunc(h.held, func(x *waiter) bool {
		if now.Before(x.until) {
			return false
		}
		ended = append(ended, x)
		return true
	})
	oldest, newest := scrapeSpan(st.endpoints)
	if fresh := oldest.After(h.round); fresh || oldest.IsZero() {
		budget := len(h.held)
		if fresh {
			h.round, budget = newest, h.budget(st)
		}
		for ; budget > 0; budget-- {
			i := h.next()
			if i < 0 {
				break
			}
			x := h.held[i]
			h.held = slices.Delete(h.held, i, i+1)
			h.serial++
			h.served[x.flow] = h.serial
			released = append(released, x)
		}
		h.forget()
	}
	left := len(h.held)
	if left == 0 {
		h.ticking = false
	}
	h.mu.Unlock()
	for _, x := range ended {
		x.done(ErrStillSaturated)
	}
	for _, x := range released {
		x.done(nil)
	}
	return left
}

// next is the index of the request to release next, -1 for none: of the
// highest priority that has one whose pool is not saturated, the first of
// the flow served least lately.
func (h *Hold) next() int {
	best := -1
	for i, x := range h.held {
		if best >= 0 && x.flow.priority < h.held[best].flow.priority {
			break
		}
		if (best < 0 || h.served[x.flow] < h.served[h.held[best].flow]) && !h.Pool.Saturated(x.req, h.lines) {
			best = i
		}
	}
	return best
}

// budget is how many held requests one scrape round lets go: this replica's share
// of the room the figures show. The room is what the healthy endpoints'
// queues lack of the line (none on an endpoint whose KV cache is at its
// line); the share is this replica's requests in flight on them over the
// engines' own count of requests, running and waiting, so that replicas
// that read the same room take from it in proportion to what they send. At
// least one while there is room (less than a request's, under a line below
// one: a queue of none is room), so that a replica sending nothing else
// still drains its hold. Figures only estimate: a request picked is in
// flight here before its engine counts it.
func (h *Hold) budget(st *poolState) int {
	var room, mine, engines float64
	for _, e := range st.endpoints {
		l, ok := e.Fresh()
		if !ok || !e.Healthy() {
			continue
		}
		mine += float64(e.InFlight())
		engines += l.Running + l.Waiting
		if l.KVUsage < h.lines.KVCache {
			room += max(0, h.lines.Queue-l.Waiting)
		}
	}
	if room <= 0 {
		return 0
	}
	share := 1.0
	if engines > 0 {
		share = min(1, mine/engines)
	}
	return max(1, int(share*room))
}

// scrapeSpan is when the oldest and the newest of the healthy endpoints'
// fresh figures (Fresh: one whose scrapes fail holds no round back) were
// scraped. The endpoints of a pool are scraped together,
// each answer stamped as it comes: a scrape round is new once the oldest
// is newer than the last round's newest, not as soon as one endpoint
// answers, which would release once per answer.
func scrapeSpan(eps []*Endpoint) (oldest, newest time.Time) {
	for _, e := range eps {
		l, ok := e.Fresh()
		if !ok || !e.Healthy() {
			continue
		}
		if oldest.IsZero() || l.At.Before(oldest) {
			oldest = l.At
		}
		if l.At.After(newest) {
			newest = l.At
		}
	}
	return oldest, newest
}
