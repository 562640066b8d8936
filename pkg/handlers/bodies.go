package handlers

import (
	"math/bits"
	"sync"
)

// bodyCollector gathers a request body from its chunks without copying it more
// than once: a body that comes whole (BUFFERED, or a small FULL_DUPLEX body) is
// used as gRPC decoded it; a chunked one goes into a pooled buffer sized once
// from Content-Length, which the limit was checked against, so it never regrows.
type bodyCollector struct {
	buf    []byte
	pooled bool // buf is from takeBuffer
}

// add appends chunk. whole says the first chunk is the whole body; announced
// is the Content-Length, -1 when the client sent none.
func (c *bodyCollector) add(chunk []byte, whole bool, announced int64) {
	switch {
	case c.buf == nil && whole:
		c.buf = chunk
	case c.buf == nil && announced > 0:
		c.buf = takeBuffer(int(max(announced, int64(len(chunk)))))
		c.pooled = true
		fallthrough
	default:
		c.buf = append(c.buf, chunk...)
	}
}

// bytes is the body collected so far; nil before any chunk.
func (c *bodyCollector) bytes() []byte { return c.buf }

// release gives a pooled buffer back once the stream is over, unless held: a
// prefill leg may still be reading it.
func (c *bodyCollector) release(held bool) {
	if c.pooled && !held {
		giveBack(c.buf)
	}
}

// Buffers for FULL_DUPLEX bodies that come in several chunks, which are
// collected into one. A buffer is taken at the first chunk, sized from
// Content-Length, and given back when the stream ends, unless the body went to
// a prefill endpoint (pipeline.Request.BodyHeld). Until then the body is read
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
