package kvevents

import (
	"fmt"
	"maps"
	"runtime"
	"testing"
	"time"
)

// stored is a BlockStored of blocks of 4 tokens: hashes name them, tokens
// are theirs, parent is the block before them (0: none).
func stored(parent uint64, hashes []uint64, tokens []int64) Event {
	return Event{Kind: Stored, Hashes: hashes, Parent: parent, HasParent: parent != 0, Tokens: tokens, BlockSize: 4}
}

func removed(hashes ...uint64) Event { return Event{Kind: Removed, Hashes: hashes} }

func seq(from, n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(from + i)
	}
	return out
}

var (
	a = Publisher{Endpoint: "10.0.0.1:8000"}
	b = Publisher{Endpoint: "10.0.0.2:8000"}
)

// TestLookupFindsTheLongestCachedPrefix: blocks chain by their tokens and
// parents, alike whatever the engines call them, and a prompt finds on each
// endpoint the run of its leading blocks that endpoint holds.
func TestLookupFindsTheLongestCachedPrefix(t *testing.T) {
	prompt := seq(0, 14) // three full blocks and a partial one
	tests := []struct {
		name   string
		events map[Publisher][]Event
		want   map[string]int
	}{
		{"nothing stored", nil, map[string]int{}},
		{"a prompt stored in one event", map[Publisher][]Event{a: {stored(0, []uint64{1, 2, 3}, seq(0, 12))}},
			map[string]int{a.Endpoint: 12}},
		{"a conversation stored turn by turn, chained by parent", map[Publisher][]Event{a: {
			stored(0, []uint64{1}, seq(0, 4)), stored(1, []uint64{2, 3}, seq(4, 8))}},
			map[string]int{a.Endpoint: 12}},
		{"the engines' hashes differ; the tokens decide", map[Publisher][]Event{
			a: {stored(0, []uint64{1, 2}, seq(0, 8))}, b: {stored(0, []uint64{71, 72, 73}, seq(0, 12))}},
			map[string]int{a.Endpoint: 8, b.Endpoint: 12}},
		{"other tokens after the first block", map[Publisher][]Event{a: {stored(0, []uint64{1, 2}, append(seq(0, 4), seq(100, 4)...))}},
			map[string]int{a.Endpoint: 4}},
		{"a removed block ends the prefix there", map[Publisher][]Event{a: {stored(0, []uint64{1, 2, 3}, seq(0, 12)), removed(2)}},
			map[string]int{a.Endpoint: 4}},
		{"all cleared", map[Publisher][]Event{a: {stored(0, []uint64{1, 2, 3}, seq(0, 12)), {Kind: Cleared}}}, map[string]int{}},
		// vLLM does not de-duplicate: requests that compute one prefix at
		// once each cache a copy under the same hashes, each stored and
		// evicted on its own (BlockHashToBlockMap, vllm/v1/core/block_pool.py).
		{"one of two copies evicted: the other is still cached", map[Publisher][]Event{a: {
			stored(0, []uint64{1, 2, 3}, seq(0, 12)), stored(0, []uint64{1, 2, 3}, seq(0, 12)), removed(1, 2, 3)}},
			map[string]int{a.Endpoint: 12}},
		{"a copy of the first blocks evicted, the tail's only one too", map[Publisher][]Event{a: {
			stored(0, []uint64{1, 2, 3}, seq(0, 12)), stored(0, []uint64{1, 2}, seq(0, 8)), removed(3, 2, 1)}},
			map[string]int{a.Endpoint: 8}},
		{"both copies evicted", map[Publisher][]Event{a: {
			stored(0, []uint64{1, 2, 3}, seq(0, 12)), stored(0, []uint64{1, 2, 3}, seq(0, 12)), removed(1, 2, 3), removed(1)}},
			map[string]int{}},
		{"copies cleared with the rest", map[Publisher][]Event{a: {
			stored(0, []uint64{1, 2, 3}, seq(0, 12)), stored(0, []uint64{1, 2, 3}, seq(0, 12)), {Kind: Cleared},
			stored(0, []uint64{1}, seq(0, 4)), removed(1)}},
			map[string]int{}},
		{"a parent the view never saw: not indexed", map[Publisher][]Event{a: {stored(9, []uint64{2, 3}, seq(4, 8))}}, map[string]int{}},
		{"another medium is not the prefix cache", map[Publisher][]Event{a: {{Kind: Stored, Hashes: []uint64{1}, Tokens: seq(0, 4), BlockSize: 4, Medium: "CPU"}}},
			map[string]int{}},
		{"a block with extra keys (LoRA, cache_salt) is not a plain prompt's", map[Publisher][]Event{a: {
			{Kind: Stored, Hashes: []uint64{1, 2}, Tokens: seq(0, 8), BlockSize: 4, Extra: [][]byte{nil, []byte{0x91, 0xa4, 's', 'a', 'l', 't'}}}}},
			map[string]int{a.Endpoint: 4}},
		{"a hybrid model: its full-attention group, not its sliding-window one", map[Publisher][]Event{a: {
			{Kind: Stored, Hashes: []uint64{1, 2, 3}, Tokens: seq(0, 12), BlockSize: 4, Group: 0, SpecKind: "sliding_window"},
			{Kind: Stored, Hashes: []uint64{1, 2}, Tokens: seq(0, 8), BlockSize: 4, Group: 1, SpecKind: "full_attention"},
			{Kind: Removed, Hashes: []uint64{2}, Group: 0}}},
			map[string]int{a.Endpoint: 8}},
		{"a hybrid model's other group evicts nothing of it", map[Publisher][]Event{a: {
			{Kind: Stored, Hashes: []uint64{1, 2}, Tokens: seq(0, 8), BlockSize: 4, Group: 1, SpecKind: "mla_attention"},
			{Kind: Removed, Hashes: []uint64{1}, Group: 2}}},
			map[string]int{a.Endpoint: 8}},
		{"a block size other than the view's is not indexed", map[Publisher][]Event{a: {
			stored(0, []uint64{1}, seq(0, 4)),
			{Kind: Stored, Hashes: []uint64{2}, Parent: 1, HasParent: true, Tokens: seq(4, 2), BlockSize: 2}}},
			map[string]int{a.Endpoint: 4}},
		{"an event of an unknown type changes nothing", map[Publisher][]Event{a: {stored(0, []uint64{1}, seq(0, 4)), {Kind: Unknown}}},
			map[string]int{a.Endpoint: 4}},
		{"a cache cleared may be laid out anew", map[Publisher][]Event{a: {
			{Kind: Stored, Hashes: []uint64{1}, Tokens: seq(0, 4), BlockSize: 4, Group: 1, SpecKind: "full_attention"},
			{Kind: Cleared},
			{Kind: Stored, Hashes: []uint64{1, 2}, Tokens: seq(0, 4), BlockSize: 2, Group: 0, SpecKind: "full_attention"}}},
			map[string]int{a.Endpoint: 4}},
		{"two ranks of one engine", map[Publisher][]Event{a: {stored(0, []uint64{1}, seq(0, 4))},
			{Endpoint: a.Endpoint, Rank: 1}: {stored(0, []uint64{1, 2}, seq(0, 8))}},
			map[string]int{a.Endpoint: 8}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(Bounds{}, time.Minute, nil)
			for _, p := range []Publisher{a, b} {
				x.Reset(p, true)
			}
			for p, events := range tt.events {
				x.Apply(p, events)
			}
			held, known := x.Lookup([]string{a.Endpoint, b.Endpoint}, prompt, Keys{})
			if !known[0] || !known[1] || !maps.Equal(held, tt.want) {
				t.Errorf("Lookup = %v, %v; want %v, both known", held, known, tt.want)
			}
		})
	}
}

// TestIndexBoundsItsMemory: past its bound a publisher forgets its oldest
// blocks, so the index finds less, never more, than is cached.
func TestIndexBoundsItsMemory(t *testing.T) {
	for _, tt := range []struct {
		name   string
		bounds Bounds
		want   int // blocks kept of a's 10, b holding 2
	}{
		{"per publisher", Bounds{PerPublisher: 4}, 4},
		{"in all", Bounds{Total: 6}, 4},
		{"unbounded", Bounds{}, 10},
	} {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(tt.bounds, time.Minute, nil)
			x.Apply(b, []Event{stored(0, []uint64{1, 2}, seq(0, 8))})
			for i := range 10 {
				x.Apply(a, []Event{stored(0, []uint64{uint64(100 + i)}, seq(1000*i, 4))})
			}
			if got := x.Stats().Blocks; got != tt.want+2 {
				t.Errorf("%d blocks kept, want %d", got, tt.want+2)
			}
			held, _ := x.Lookup([]string{a.Endpoint}, seq(9000, 4), Keys{}) // the newest
			if held[a.Endpoint] != 4 {
				t.Errorf("the newest block is forgotten: %v", held)
			}
		})
	}
}

// TestLookupTrustsOnlyViewsItMay: an endpoint not followed yet, a view
// whose gap is being replayed, one rebuilt after a gap it could not replay
// (for staleAfter) and one whose engine stays silent after it was sent work
// (past staleAfter) are not known; the others are.
func TestLookupTrustsOnlyViewsItMay(t *testing.T) {
	now := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	// neverPublished: a's view, as one whose engine never published, is
	// sent a prompt of tokens to compute, then staleAfter passes.
	neverPublished := func(tokens int) func(x *Index) {
		return func(x *Index) {
			x.Forget(a)
			x.Reset(a, true)
			x.Expect(a.Endpoint, 0, tokens)
			now = now.Add(61 * time.Second)
		}
	}
	tests := []struct {
		name string
		do   func(x *Index)
		ok   bool // a is known
	}{
		{"followed", func(x *Index) {}, true},
		{"an endpoint not followed", func(x *Index) { x.Forget(a) }, false},
		{"a gap being replayed", func(x *Index) { x.SetFresh(a, false) }, false},
		{"rebuilt, staleAfter not over", func(x *Index) { x.Rebuild(a); now = now.Add(59 * time.Second) }, false},
		{"rebuilt, staleAfter over", func(x *Index) { x.Rebuild(a); now = now.Add(time.Minute) }, true},
		{"silent since sent work, within staleAfter", func(x *Index) { x.Expect(a.Endpoint, 4, 8); now = now.Add(time.Minute) }, true},
		{"silent since sent work, past staleAfter", func(x *Index) { x.Expect(a.Endpoint, 4, 8); now = now.Add(61 * time.Second) }, false},
		{"sent only what it holds, past staleAfter", func(x *Index) { x.Expect(a.Endpoint, 4, 7); now = now.Add(61 * time.Second) }, true},
		// The first work sent since the engine last published starts the wait; more sent
		// later does not restart it.
		{"sent work twice, past staleAfter from the first", func(x *Index) {
			x.Expect(a.Endpoint, 4, 8)
			now = now.Add(40 * time.Second)
			x.Expect(a.Endpoint, 4, 8)
			now = now.Add(21 * time.Second)
		}, false},
		// An engine started without KV events: its block size unknown, 256 tokens to compute
		// must leave it one to store.
		{"never published, sent 256 tokens, past staleAfter", neverPublished(256), false},
		{"never published, sent 255 tokens, past staleAfter", neverPublished(255), true},
		// vLLM's data-parallel coordinator, not the router, picks the rank that
		// serves a request: whichever rank publishes, the engine did.
		{"two ranks sent work, one published", func(x *Index) {
			a1 := Publisher{Endpoint: a.Endpoint, Rank: 1}
			x.Apply(a1, []Event{stored(0, []uint64{1}, seq(0, 4))})
			x.Expect(a.Endpoint, 4, 8)
			now = now.Add(30 * time.Second)
			x.Apply(a, []Event{stored(1, []uint64{2}, seq(4, 4))})
			now = now.Add(time.Hour)
		}, true},
		{"two ranks sent work, neither published", func(x *Index) {
			x.Apply(Publisher{Endpoint: a.Endpoint, Rank: 1}, []Event{stored(0, []uint64{1}, seq(0, 4))})
			x.Expect(a.Endpoint, 4, 8)
			now = now.Add(61 * time.Second)
		}, false},
		{"sent work, then published", func(x *Index) {
			x.Expect(a.Endpoint, 4, 8)
			now = now.Add(30 * time.Second)
			x.Apply(a, []Event{stored(0, []uint64{5}, seq(50, 4))})
			now = now.Add(time.Hour)
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(Bounds{}, time.Minute, clock)
			x.Reset(a, true)
			x.Reset(b, true)
			x.Apply(a, []Event{stored(0, []uint64{1}, seq(0, 4))})
			tt.do(x)
			held, known := x.Lookup([]string{a.Endpoint, b.Endpoint}, seq(0, 8), Keys{})
			if known[0] != tt.ok || !known[1] {
				t.Errorf("Lookup known = %v, want a %v and b", known, tt.ok)
			}
			if _, found := held[a.Endpoint]; found && !tt.ok {
				t.Errorf("Lookup held = %v for an endpoint not known", held)
			}
		})
	}
}

// BenchmarkIndexMemory reports the heap one indexed block takes: 8 engines
// storing prompts of 64 blocks of 16 tokens, a million blocks in all, each
// engine's its own, or the same prompts on all eight.
//
//	go test -run '^$' -bench IndexMemory -benchtime 1x ./pkg/kvevents/
func BenchmarkIndexMemory(b *testing.B) {
	const engines, prompts, blocks = 8, 1 << 11, 64
	for _, shared := range []bool{false, true} {
		b.Run(fmt.Sprint("shared=", shared), func(b *testing.B) {
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				x := NewIndex(Bounds{}, time.Minute, nil)
				for e := range engines {
					p := Publisher{Endpoint: fmt.Sprintf("10.0.0.%d:8000", e+1)}
					for q := range prompts {
						hashes := make([]uint64, blocks)
						for i := range hashes {
							hashes[i] = uint64(e)<<48 | uint64(q)<<16 | uint64(i)
						}
						first := (e*prompts + q) * blocks * 16
						if shared {
							first = q * blocks * 16
						}
						x.Apply(p, []Event{{Kind: Stored, Hashes: hashes, Tokens: seq(first, blocks*16), BlockSize: 16}})
					}
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				n := x.Stats().Blocks
				b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(n), "bytes/block")
				b.ReportMetric(float64(n), "blocks")
				runtime.KeepAlive(x)
			}
		})
	}
}

// TestIndexRefusesWhatWouldCostItDear: a publisher's malformed or hostile
// events cost the index what they carry and no more: a block size that
// would overflow the check of its tokens is refused, and one block stored
// under many hashes is one holder of its key, so that removing them all
// takes as long as they took to store.
func TestIndexRefusesWhatWouldCostItDear(t *testing.T) {
	t.Run("a block size past any engine's", func(t *testing.T) {
		x := NewIndex(Bounds{}, time.Minute, nil)
		x.Reset(a, true)
		huge := Event{Kind: Stored, Hashes: []uint64{1, 2, 3, 4}, BlockSize: 1 << 62}
		if s := x.Apply(a, []Event{huge}); s.Other != 1 {
			t.Errorf("skipped %+v, want the event counted as malformed", s)
		}
		if got := x.Stats().Blocks; got != 0 {
			t.Errorf("%d blocks indexed from a malformed event", got)
		}
	})
	t.Run("one block under many hashes", func(t *testing.T) {
		const n = 20000
		x := NewIndex(Bounds{}, time.Minute, nil)
		x.Reset(a, true)
		events := make([]Event, n)
		for i := range events {
			events[i] = stored(0, []uint64{uint64(i + 1)}, seq(0, 4))
		}
		x.Apply(a, events)
		key := x.pubs[a].engine[1]
		if got := len(x.blocks[key]); got != 1 {
			t.Errorf("the key names %d holders, want its one publisher once", got)
		}
		for i := range n - 1 {
			x.Apply(a, []Event{removed(uint64(i + 1))})
		}
		if n, _ := held(x, a.Endpoint, seq(0, 4)); n != 4 {
			t.Errorf("with one of its hashes left the block is held for %d tokens, want 4", n)
		}
		x.Apply(a, []Event{removed(n)})
		if n, _ := held(x, a.Endpoint, seq(0, 4)); n != 0 || len(x.blocks) != 0 {
			t.Errorf("with all its hashes removed the block is held for %d tokens (%d keys left)", n, len(x.blocks))
		}
	})
}

// TestTheTotalBoundTakesFromTheLargest: past the bound of all publishers'
// blocks, the one holding the most forgets its oldest, so an engine that
// joins while the others fill the total keeps what it stores.
func TestTheTotalBoundTakesFromTheLargest(t *testing.T) {
	c := Publisher{Endpoint: "10.0.0.3:8000"}
	x := NewIndex(Bounds{PerPublisher: 4, Total: 8}, time.Minute, nil)
	for _, p := range []Publisher{a, b, c} {
		x.Reset(p, true)
	}
	x.Apply(a, []Event{stored(0, []uint64{1, 2, 3, 4}, seq(0, 16))})
	x.Apply(b, []Event{stored(0, []uint64{1, 2, 3, 4}, seq(100, 16))})
	x.Apply(c, []Event{stored(0, []uint64{9}, seq(500, 4))})
	x.Apply(a, []Event{stored(0, []uint64{5}, seq(900, 4))})
	if n, _ := held(x, c.Endpoint, seq(500, 4)); n != 4 {
		t.Errorf("the new engine holds %d tokens of its one block, want 4", n)
	}
	if got := x.Stats().Blocks; got > 8 {
		t.Errorf("%d blocks kept, past the bound of 8", got)
	}
}

// TestLookupMatchesEachEngineByItsBlockSize: engines of one pool that
// publish different block sizes (vLLM's --block-size, or an attention
// backend that sets its own) are each matched in their own blocks, every
// time: the lookup took one size, whichever view came last, and read 0 for
// the others.
func TestLookupMatchesEachEngineByItsBlockSize(t *testing.T) {
	x := NewIndex(Bounds{}, time.Minute, nil)
	x.Reset(a, true)
	x.Reset(b, true)
	x.Apply(a, []Event{{Kind: Stored, Hashes: []uint64{1, 2, 3}, Tokens: seq(0, 12), BlockSize: 4}})
	x.Apply(b, []Event{{Kind: Stored, Hashes: []uint64{5, 6, 7, 8, 9}, Tokens: seq(0, 10), BlockSize: 2}})
	want := map[string]int{a.Endpoint: 12, b.Endpoint: 10}
	for range 100 { // the views are kept in a map: its order changes
		if held, _ := x.Lookup([]string{a.Endpoint, b.Endpoint}, seq(0, 14), Keys{}); !maps.Equal(held, want) {
			t.Fatalf("Lookup = %v, want %v", held, want)
		}
	}
}

// BenchmarkStoreAtTheBound is the cost of one stored block once the index
// holds max_blocks, with 8 and 1,000 engines publishing: each new batch
// makes the index forget as many blocks. The time is per block.
//
//	go test -run '^$' -bench StoreAtTheBound ./pkg/kvevents/
func BenchmarkStoreAtTheBound(b *testing.B) {
	const batch, total = 16, 1 << 16
	for _, engines := range []int{8, 1000} {
		b.Run(fmt.Sprint("engines=", engines), func(b *testing.B) {
			x := NewIndex(Bounds{Total: total}, time.Minute, nil)
			pubs := make([]Publisher, engines)
			for e := range pubs {
				pubs[e] = Publisher{Endpoint: fmt.Sprintf("10.%d.%d.1:8000", e/256, e%256)}
			}
			var n uint64
			store := func(p Publisher) {
				hashes := make([]uint64, batch)
				for i := range hashes {
					n++
					hashes[i] = n
				}
				x.Apply(p, []Event{{Kind: Stored, Hashes: hashes, Tokens: seq(int(n)*16, batch*16), BlockSize: 16}})
			}
			for i := 0; x.Stats().Blocks < total; i++ {
				store(pubs[i%engines])
			}
			i := 0
			for b.Loop() {
				store(pubs[i%engines])
				i++
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/block")
		})
	}
}
