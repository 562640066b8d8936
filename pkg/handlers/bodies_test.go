package handlers

import (
	"context"
	"errors"
	"runtime"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

func TestSizeClassesHoldTheBodyWithAQuarterToSpare(t *testing.T) {
	tests := []struct{ n, size int }{
		{1, 1}, {3, 4}, {4, 4}, {5, 5}, {8, 8}, {9, 10},
		{64 << 10, 64 << 10}, {64<<10 + 1, 80 << 10},
		{2097148, 2 << 20}, // the 2 MiB benchmark body
		{1<<20 + 1, 1<<20 + 256<<10},
	}
	for _, tt := range tests {
		if _, size := sizeClass(tt.n); size != tt.size {
			t.Errorf("sizeClass(%d) size = %d, want %d", tt.n, size, tt.size)
		}
	}
	index := map[int]int{} // pool index -> its size
	for n := 1; n <= 1<<22; n += 1 + n/7 {
		i, size := sizeClass(n)
		if size < n || 4*size > 5*n+12 {
			t.Fatalf("sizeClass(%d) = %d bytes: does not hold it, or wastes over a quarter", n, size)
		}
		if i < 0 || i >= len(bodyBuffers) {
			t.Fatalf("sizeClass(%d) index %d is outside the pools", n, i)
		}
		if other, ok := index[i]; ok && other != size {
			t.Fatalf("pool %d holds %d and %d byte buffers", i, other, size)
		}
		index[i] = size
	}
}

// A collected body's buffer serves a later body once its stream is over,
// unless a prefill leg was sent from it: net/http may still be writing it.
func TestBodyBufferIsReusedOnlyWhenNoLegHoldsIt(t *testing.T) {
	const n = 300 << 10
	for _, tt := range []struct {
		prefill string
		reused  bool
	}{{"", true}, {"10.0.0.7:8000", false}} {
		seen := false
		for range 20 { // sync.Pool may drop an item (always under -race, now and then)
			c := bodyCollector{buf: takeBuffer(n), pooled: true}
			req := pipeline.Request{Report: pipeline.Report{Prefill: tt.prefill}}
			first := &c.buf[:1][0]
			c.release(req.BodyHeld())
			next := takeBuffer(n)
			if &next[:1][0] == first {
				seen = true
			}
		}
		if seen != tt.reused {
			t.Errorf("with prefill %q the buffer was reused: %v, want %v", tt.prefill, seen, tt.reused)
		}
	}
}

// A client announcing a large Content-Length and sending a byte holds a
// first buffer of at most 64 KiB, however much it announced: measured
// with the runtime's own count of what was allocated, over streams held open
// together as slow clients hold them.
func TestContentLengthLieAllocatesLittle(t *testing.T) {
	const (
		streams   = 10
		announced = 32 << 20
		first     = 64 << 10 // the promise: at most 64 KiB whatever Content-Length says
	)
	s := NewServer(lyingRouter{}, Options{}, logr.Discard())
	headers := envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false,
		envoymsg.Post("/v1/chat/completions", announced)...), filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	chunk := envoymsg.Body(envoymsg.Request, []byte("{"), false)

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	open := make([]*exchange, streams)
	for i := range open {
		open[i] = s.open(t.Context(), discard{})
		for _, m := range []*extprocv3.ProcessingRequest{headers, chunk} {
			if done, err := open[i].handle(m); done || err != nil {
				t.Fatalf("stream %d ended: %v", i, err)
			}
		}
	}
	runtime.ReadMemStats(&after)
	allocated := after.TotalAlloc - before.TotalAlloc
	live := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d streams announcing %d bytes and sending 1: %.1f MiB allocated, heap %+.1f MiB",
		streams, announced, float64(allocated)/(1<<20), float64(live)/(1<<20))
	for i, x := range open {
		if c := cap(x.body.bytes()); c > first {
			t.Errorf("stream %d holds a %d-byte buffer for 1 byte received", i, c)
		}
		s.close(x)
	}
	if limit := uint64(streams * (first + 256<<10)); allocated > limit {
		t.Errorf("%d streams allocated %d bytes, want at most %d (a first buffer each, and some)", streams, allocated, limit)
	}
}

// lyingRouter serves the streams of TestContentLengthLieAllocatesLittle,
// which never finish their bodies.
type lyingRouter struct{}

func (lyingRouter) MaxBodyBytes() int64 { return 64 << 20 }
func (lyingRouter) Route(context.Context, *pipeline.Request) (*pipeline.Decision, error) {
	return nil, errors.New("a lying body is never complete")
}
func (lyingRouter) RouteHeaders(*pipeline.Request) (*pipeline.Decision, error) {
	return nil, errors.New("a lying body is never complete")
}

// discard is a sink that keeps nothing.
type discard struct{}

func (discard) Send(*extprocv3.ProcessingResponse) error { return nil }

// A chunked body's buffer grows with what arrives, to no more than an honest
// Content-Length or limits.max_body_bytes; every byte is kept, and what the
// buffer holds is counted against the budget until the stream releases it.
// A body of up to max_body_bytes fits a budget of as much, alone.
func TestBodyBufferGrowsWithWhatArrives(t *testing.T) {
	const mib = 1 << 20
	tests := []struct {
		name      string
		announced int64
		size      int   // bytes sent, in 64 KiB chunks
		limit     int64 // max_body_bytes, and the budget; 0: 64 MiB and none
		wantCap   int
	}{
		{"small, announced: its size class", 1000, 1000, 0, 1024},
		{"3 MiB, announced: 1 MiB, then 2, then 3", 3 * mib, 3 * mib, 0, 3 * mib},
		{"3 MiB, none announced: doubling", -1, 3 * mib, 0, 4 * mib},
		{"more than announced", 100, 200 << 10, 0, 256 << 10},
		{"17 MiB announced, budget of the 32 MiB limit", 17 * mib, 17 * mib, 32 * mib, 20 * mib},
		{"17 MiB, none announced, budget of the 32 MiB limit", -1, 17 * mib, 32 * mib, 32 * mib},
		{"the limit, 17 MiB, none announced: a buffer of the limit exactly", -1, 17 * mib, 17 * mib, 17 * mib},
		{"33 MiB, none announced, the limit a byte more: not its 40 MiB size class", -1, 33 * mib, 33*mib + 1, 33*mib + 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, limit := &budget{limit: tt.limit}, tt.limit
			if limit == 0 {
				limit = 64 * mib
			}
			c := bodyCollector{budget: b}
			sent := make([]byte, tt.size)
			for i := range sent {
				sent[i] = byte(i * 7)
			}
			for off := 0; off < len(sent); off += 64 << 10 {
				if !c.add(sent[off:min(off+64<<10, len(sent))], false, tt.announced, limit) {
					t.Fatalf("refused at %d bytes", off)
				}
			}
			if string(c.bytes()) != string(sent) {
				t.Fatal("the collected body differs from what was sent")
			}
			if got := cap(c.bytes()); got != tt.wantCap {
				t.Errorf("buffer of %d bytes, want %d", got, tt.wantCap)
			}
			if held := b.held.Load(); held != int64(cap(c.bytes())) {
				t.Errorf("%d bytes counted for a %d-byte buffer", held, cap(c.bytes()))
			}
			c.release(false)
			if held := b.held.Load(); held != 0 {
				t.Errorf("%d bytes still counted after the release", held)
			}
		})
	}
}
