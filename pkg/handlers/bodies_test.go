package handlers

import (
	"testing"

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
