package handlers

import (
	"sync/atomic"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// The limits every stream of a Server counts against: the stream slots of
// limits.max_concurrent_streams, and the bytes of request bodies held, of
// limits.max_buffered_bytes. A request holds a slot from its stream's first
// message (not from the stream's opening: a stream that sends nothing costs
// a goroutine, not a request's memory) until the stream ends, or until its
// body runs out of time.

// budget is limits.max_buffered_bytes: the bytes of request bodies held.
type budget struct {
	limit   int64 // 0: no bound
	held    atomic.Int64
	metrics *metrics.Metrics
}

// take counts n more bytes, unless that would pass the limit.
func (b *budget) take(n int64) bool {
	if b == nil || n <= 0 {
		return true
	}
	if v := b.held.Add(n); b.limit > 0 && v > b.limit {
		b.held.Add(-n)
		return false
	}
	b.metrics.BodyBytesHeld(n)
	return true
}

// give returns n bytes taken.
func (b *budget) give(n int64) {
	if b != nil && n > 0 {
		b.held.Add(-n)
		b.metrics.BodyBytesHeld(-n)
	}
}

// holding is what one exchange holds of the server's limits, and the
// deadline of its request: from the first message until the request is
// complete, a timer may refuse it (408) and take back what it holds, from
// another goroutine than the stream's, under the exchange's mu.
type holding struct {
	streams *atomic.Int64 // the Server's streams holding a slot
	started bool          // the first message came: a slot was asked for
	slot    bool          // holds one of the streams
	timer   *time.Timer
	expired bool // the timer refused the request
	// stopped: the deadline is over for good. Only the stream's goroutine
	// touches it, so it may read it without mu, unlike requestDone and
	// expired, which the timer writes.
	stopped bool
}

// admit takes a slot for the stream's first message; it reports false when
// limit (> 0) slots are taken already.
func (h *holding) admit(limit int) bool {
	h.started = true
	if n := h.streams.Add(1); limit > 0 && n > int64(limit) {
		h.streams.Add(-1)
		return false
	}
	h.slot = true
	return true
}

// letGo gives the slot back, once.
func (h *holding) letGo() {
	if h.slot {
		h.slot = false
		h.streams.Add(-1)
	}
}

// stop ends the request's deadline: its body is complete, or it was
// answered. Under mu, with requestDone set, so a timer that fired meanwhile
// finds it and leaves: from here nothing but the stream's goroutine touches
// the exchange.
func (h *holding) stop() {
	if h.timer != nil {
		h.timer.Stop()
		h.timer = nil // a stream held for a generation need not keep it
	}
	h.stopped = true
}

// start admits the stream at its first message and starts the request's
// deadline, limits.body_timeout. Under mu.
func (x *exchange) start() {
	if !x.lim.admit(x.opts.MaxStreams) {
		return // refused at its headers, holding nothing
	}
	if d := x.opts.BodyTimeout; d > 0 {
		x.lim.timer = time.AfterFunc(d, x.expire)
	}
}

// expire refuses a request whose body is still incomplete at its deadline,
// and gives back at once what it holds (letGo: its body never reached
// routing, so no leg reads it and no decode slot was taken): a client may
// keep the stream open after the 408 (Envoy closes it).
func (x *exchange) expire() {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.requestDone {
		return
	}
	x.lim.expired = true
	x.opts.Metrics.LimitRefused(metrics.LimitBodyTime)
	x.send(x.fail(pipeline.BodyTimeout(x.opts.BodyTimeout))) // a stream gone meanwhile has nobody to tell
	x.letGo()
}
