package handlers

import (
	"math/bits"
	"sync"
	"sync/atomic"
)

// firstBuffer bounds the first buffer of a body that comes in chunks,
// whatever its Content-Length announces: a client announcing 32 MiB and
// sending one byte holds 64 KiB, not 32 MiB, and so would 4,096 of them to
// pin a 256 MiB budget, past limits.max_concurrent_streams' default. A
// larger buffer is taken only as the bytes arrive, each at least twice the
// last (so the body is copied about once more in all) and never past what
// Content-Length announced.
const firstBuffer = 64 << 10

// bodyCollector gathers a request body from its chunks without copying it more
// than it must: a body that comes whole (BUFFERED, or a small FULL_DUPLEX body)
// is used as gRPC decoded it; a chunked one goes into pooled buffers that grow
// with what arrives. What it holds is counted against the server's budget
// (limits.max_buffered_bytes) until no one reads the body any more: the
// stream, and a background prefill leg that holds it (Hold).
type bodyCollector struct {
	seen   bool // a body message came, even an empty one: Envoy awaits a body reply
	buf    []byte
	pooled bool // buf is from takeBuffer
	budget *budget
	taken  int64 // bytes of buf counted against budget
	// readers are the holds on the body besides the stream's (background
	// legs), less one once the stream has released it: the hold that takes
	// it to -1 is the last.
	readers  atomic.Int32
	released bool // by the stream
}

// add appends chunk, unless the budget refuses the memory it needs. whole
// says the first chunk is the whole body; announced is the Content-Length,
// -1 when the client sent none; limit is limits.max_body_bytes, which the
// body with chunk must not pass (the caller refuses it first).
func (c *bodyCollector) add(chunk []byte, whole bool, announced, limit int64) bool {
	switch need := len(c.buf) + len(chunk); {
	case c.buf == nil && whole:
		if !c.budget.take(int64(len(chunk))) {
			return false
		}
		c.buf, c.taken = chunk, int64(len(chunk))
		return true
	case need > cap(c.buf):
		if !c.grow(need, announced, int(limit)) {
			return false
		}
	}
	c.buf = append(c.buf, chunk...)
	return true
}

// grow moves the body into a buffer that holds need bytes, need being at
// most limit: a pooled one of its size class, or, where that class would
// pass limit, one of limit bytes exactly, so that a body of
// limits.max_body_bytes fits a budget of as much. The budget counts the new
// buffer in place of the old: both are held only while the body is copied.
func (c *bodyCollector) grow(need int, announced int64, limit int) bool {
	size := max(need, 2*cap(c.buf))
	switch {
	case c.buf == nil:
		size = max(need, int(min(announced, firstBuffer)))
	case announced >= int64(need):
		size = min(size, int(announced)) // an honest Content-Length is never passed
	}
	size = min(size, max(need, limit))
	_, held := sizeClass(size)
	exact := held > limit
	if exact {
		held = size
	}
	if !c.budget.take(int64(held) - c.taken) {
		return false
	}
	var next []byte
	if exact {
		next = make([]byte, 0, size) // not a size class: giveBack will not pool it
	} else {
		next = takeBuffer(size)
	}
	next = append(next, c.buf...)
	if c.pooled {
		giveBack(c.buf)
	}
	c.buf, c.pooled, c.taken = next, true, int64(held)
	return true
}

// bytes is the body collected so far; nil before any chunk.
func (c *bodyCollector) bytes() []byte { return c.buf }

// Hold counts one more reader of the body after the stream (a background
// prefill leg); the function it returns ends that reader's hold. It is called
// before the stream releases the body (pipeline.Request.Keep).
func (c *bodyCollector) Hold() (release func()) {
	c.readers.Add(1)
	return c.unhold
}

// unhold ends one hold; the last gives the bytes back to the budget.
func (c *bodyCollector) unhold() {
	if c.readers.Add(-1) == -1 {
		c.budget.give(c.taken)
	}
}

// release ends the stream's hold once the request is routed or the stream is
// over, whichever is first: the bytes go back
// to the budget unless a background leg still reads them, and a pooled
// buffer to the pool unless a request to an engine was sent from it that
// net/http may still be writing (held: pipeline.Request.BodyHeld). Once
// only; later calls do nothing.
func (c *bodyCollector) release(held bool) {
	if c.released {
		return
	}
	c.released = true
	c.unhold()
	if c.pooled && !held {
		giveBack(c.buf)
	}
	c.buf, c.pooled = nil, false
}

// Buffers for FULL_DUPLEX bodies that come in several chunks, which are
// collected into one. A buffer is taken at the first chunk, at most
// firstBuffer whatever Content-Length says, replaced by a larger one as the
// body outgrows it, and given back once the request is routed (or the stream
// ends before that), unless a request to an engine sent from it may still be
// written (pipeline.Request.BodyHeld: a prefill leg, a failed render). Until then the body is read
// only on the stream's goroutine: by the pipeline while it routes, and by gRPC,
// which copies each reply as it is sent (no stats handler is installed that
// could keep a sent message).
//
// Sizes are pooled in classes a quarter of an octave apart, so a buffer is at
// most 25 % larger than its body.
var bodyBuffers [4 * 64]sync.Pool // of *[]byte, by sizeClass

// sizeClass returns the pool index and buffer size for a body of n > 0 bytes:
// the least size of the form 2^(k-1) × (1 + q/4), q = 1..4, that holds n.
func sizeClass(n int) (index, size int) {
	k := bits.Len(uint(n - 1)) // 2^(k-1) < n <= 2^k
	if k < 3 {
		return k, 1 << k
	}
	base, step := 1<<(k-1), 1<<(k-3)
	q := (n - base + step - 1) / step
	return 4*k + q - 1, base + q*step
}

// takeBuffer returns an empty buffer that holds n bytes.
func takeBuffer(n int) []byte {
	i, size := sizeClass(n)
	if p, ok := bodyBuffers[i].Get().(*[]byte); ok {
		return (*p)[:0]
	}
	return make([]byte, 0, size)
}

// giveBack makes b, from takeBuffer, available to a later body.
func giveBack(b []byte) {
	i, size := sizeClass(cap(b))
	if size == cap(b) { // else grown past its class by a body longer than announced
		bodyBuffers[i].Put(&b)
	}
}
