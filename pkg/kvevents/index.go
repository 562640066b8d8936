package kvevents

import (
	"slices"
	"sync"
	"time"
)

// Publisher is one event stream: an engine endpoint (ip:port, as the pool
// names it) and, with data parallelism, the rank that publishes.
type Publisher struct {
	Endpoint string
	Rank     int
}

// Index is what every publisher's cache holds, block by block. A block's key
// is a hash chained over the token ids of it and of every block before it
// (and its extra keys), so one key stands for a whole prefix, alike for
// every engine and every replica of the router. Its memory is bounded: a
// publisher keeps at most maxPerPub blocks and all of them together at most
// maxBlocks; past that, a publisher forgets its oldest blocks first, which
// can only make Lookup find less than is cached. It is safe for concurrent
// use.
type Index struct {
	maxPerPub, maxBlocks int
	staleAfter           time.Duration
	now                  func() time.Time

	mu     sync.RWMutex
	blocks map[uint64][]*pubView // our key → the publishers holding it
	pubs   map[Publisher]*pubView
	// byEndpoint is pubs by endpoint: Lookup takes endpoints, not publishers.
	byEndpoint map[string][]*pubView
	total      int
	ids        []int // pubView ids free for reuse, so that they stay below len(pubs)+len(ids)
	// adapters are the LoRA adapters engines have stored blocks for (at
	// most maxAdapters): a request naming one is keyed by its name (Keys).
	adapters map[string]struct{}
}

// pubView is one publisher's blocks.
type pubView struct {
	Publisher
	id        int // small and unique among the index's views, for Lookup
	blockSize int
	group     int               // the KV cache group indexed, -1 before an event names its kind (indexed)
	engine    map[uint64]uint64 // the engine's hash → our key
	order     []uint64          // the engine's hashes, oldest first (may name removed ones)
	// dups counts, of keys the view holds under several of the engine's
	// hashes, the hashes past the first: the key's holders name the view
	// once, so that a publisher storing one block under many hashes cannot
	// make a holder list, and each removal from it, as long as its blocks.
	dups map[uint64]int
	// copies counts, of the engine's hashes stored more than once, the
	// copies past the first: vLLM does not de-duplicate its cache, so
	// requests that compute one prefix at once each cache and publish a copy
	// under the same hashes, and evict each on its own (BlockHashToBlockMap,
	// vllm/v1/core/block_pool.py, vllm-project/vllm @002f3491); a block
	// leaves the view with its last copy.
	copies map[uint64]int
	// fresh is false while a gap is being replayed (Subscriber).
	fresh bool
	// staleUntil: a view rebuilt after a gap it could not replay is not
	// trusted before then.
	staleUntil time.Time
	// expected is when the engine was first sent work it had to store since
	// the view's last event (Expect); zero when none is awaited.
	expected time.Time
}

// Bounds bound an index's memory, in blocks: per publisher and in all (0:
// unbounded).
type Bounds struct{ PerPublisher, Total int }

// NewIndex returns an empty index. staleAfter is Config.StaleAfter; now is
// the clock (nil: time.Now).
func NewIndex(b Bounds, staleAfter time.Duration, now func() time.Time) *Index {
	if now == nil {
		now = time.Now
	}
	return &Index{maxPerPub: b.PerPublisher, maxBlocks: b.Total, staleAfter: staleAfter, now: now,
		blocks: map[uint64][]*pubView{}, pubs: map[Publisher]*pubView{}, byEndpoint: map[string][]*pubView{}, adapters: map[string]struct{}{}}
}

// Stats is the index's size, and how many of its views routing may not
// trust now.
type Stats struct{ Publishers, Stale, Blocks int }

// Stats reads the index's size.
func (x *Index) Stats() Stats {
	now := x.now()
	x.mu.RLock()
	defer x.mu.RUnlock()
	s := Stats{Publishers: len(x.pubs), Blocks: x.total}
	for _, v := range x.pubs {
		if !x.usable(v, now) {
			s.Stale++
		}
	}
	return s
}

// Skipped counts what Apply could not index.
type Skipped struct {
	Orphans int // stored blocks whose parent the view does not hold: their keys cannot be chained
	Other   int // events of another medium, KV cache group or block size, or malformed
	Unknown int // events of a type the decoder does not know
}

// indexed says whether a stored or removed event is of the blocks a view
// indexes: the engine's prefix cache on the GPU, and of a hybrid model's KV
// cache groups the first of full attention that a stored event names (vLLM
// names the kind in BlockStored only: removals go by the group). Engines
// that name no kind (older vLLM, SGLang) are read by group 0. A hybrid
// model's sliding-window and mamba groups may hold less than its
// full-attention group (the engine reuses a prefix only as far as every
// group holds it), so the view of such a model may find more than the
// engine can reuse.
func (v *pubView) indexed(e Event) bool {
	if e.Medium != "" && e.Medium != "GPU" {
		return false
	}
	switch e.SpecKind {
	case "":
	case "full_attention", "mla_attention", "sink_full_attention":
		if v.group < 0 {
			v.group = e.Group
		}
	default:
		return false
	}
	return e.Group == max(v.group, 0)
}

// Apply applies a batch's events to p's view, creating it (fresh) if needed.
// The engine has published: none of its ranks' views awaits an event any
// more (Expect), as its data-parallel coordinator, not the router, picked
// the rank that served the work.
func (x *Index) Apply(p Publisher, events []Event) Skipped {
	x.mu.Lock()
	defer x.mu.Unlock()
	v := x.view(p)
	for _, w := range x.byEndpoint[p.Endpoint] {
		w.expected = time.Time{}
	}
	var s Skipped
	for _, e := range events {
		switch {
		case e.Kind == Unknown:
			s.Unknown++
			continue
		case e.Kind != Cleared && !v.indexed(e):
			s.Other++
			continue
		}
		switch e.Kind {
		case Stored:
			x.store(v, e, &s)
		case Removed:
			for _, h := range e.Hashes {
				x.evict(v, h)
			}
		case Cleared:
			x.clear(v)
		}
	}
	return s
}

func (x *Index) view(p Publisher) *pubView {
	v := x.pubs[p]
	if v == nil {
		id := len(x.pubs)
		if n := len(x.ids); n > 0 {
			id, x.ids = x.ids[n-1], x.ids[:n-1]
		}
		v = &pubView{Publisher: p, id: id, engine: map[uint64]uint64{}, fresh: true, group: -1}
		x.pubs[p] = v
		x.byEndpoint[p.Endpoint] = append(x.byEndpoint[p.Endpoint], v)
	}
	return v
}

// maxBlockTokens bounds the block size an event may state, far above any
// engine's (vLLM's default is 16 tokens): a larger one is malformed, and
// would overflow the check of its tokens against its blocks.
const maxBlockTokens = 1 << 20

// store indexes a BlockStored: each block's key chained from its parent's.
func (x *Index) store(v *pubView, e Event, s *Skipped) {
	if e.BlockSize <= 0 || e.BlockSize > maxBlockTokens || len(e.Tokens) != e.BlockSize*len(e.Hashes) ||
		e.Extra != nil && len(e.Extra) != len(e.Hashes) ||
		v.blockSize != 0 && e.BlockSize != v.blockSize && len(v.engine) > 0 {
		s.Other++ // a block size other than the view's, its blocks cannot be looked up with its others
		return
	}
	var key uint64
	var buf []byte
	var stored []uint64 // the engine's hashes of the blocks new to the view
	if e.HasParent {
		k, ok := v.engine[e.Parent]
		if !ok {
			s.Orphans += len(e.Hashes)
			return
		}
		key = k
	}
	v.blockSize = e.BlockSize
	if _, known := x.adapters[e.Adapter]; e.Adapter != "" && len(e.Adapter) <= maxAdapterName && !known && len(x.adapters) < maxAdapters {
		x.adapters[e.Adapter] = struct{}{}
	}
	for i, h := range e.Hashes {
		var extra []byte
		if e.Extra != nil {
			extra = e.Extra[i]
		}
		key, buf = chain(buf, key, e.Tokens[i*e.BlockSize:(i+1)*e.BlockSize], extra)
		if old, ok := v.engine[h]; ok {
			if old == key { // another copy
				if v.copies == nil {
					v.copies = map[uint64]int{}
				}
				v.copies[h]++
				continue
			}
			x.remove(v, h)
		}
		v.engine[h] = key
		stored = append(stored, h)
		x.total++
		if holders := x.blocks[key]; slices.Contains(holders, v) {
			if v.dups == nil {
				v.dups = map[uint64]int{}
			}
			v.dups[key]++
		} else {
			x.blocks[key] = append(holders, v)
		}
	}
	for _, h := range slices.Backward(stored) { // forgotten tail first, as engines free them
		v.order = append(v.order, h)
	}
	x.bound(v)
}

// bound makes v forget its oldest blocks past its own bound, and, past the
// bound of them all, the publisher holding the most its oldest: the
// publisher storing is not always the one to give way, else a new engine's
// first blocks would be forgotten as it stores them while the others fill
// the total. The largest gives up the whole excess, a batch's worth: one
// look over the publishers per batch, not per block, which with a thousand
// engines cost 17 times the block's own store.
func (x *Index) bound(v *pubView) {
	for x.maxPerPub > 0 && len(v.engine) > x.maxPerPub {
		x.forgetOldest(v)
	}
	for x.maxBlocks > 0 && x.total > x.maxBlocks {
		largest := v
		for _, w := range x.pubs {
			if len(w.engine) > len(largest.engine) {
				largest = w
			}
		}
		for x.total > x.maxBlocks && len(largest.engine) > 0 {
			x.forgetOldest(largest)
		}
	}
}

// forgetOldest removes v's oldest block, compacting v.order when removed
// hashes pile up in it.
func (x *Index) forgetOldest(v *pubView) {
	for len(v.order) > 0 {
		h := v.order[0]
		v.order = v.order[1:]
		if _, ok := v.engine[h]; ok {
			x.remove(v, h)
			break
		}
	}
	if len(v.order) > 2*len(v.engine)+64 {
		live := v.order[:0]
		for _, h := range v.order {
			if _, ok := v.engine[h]; ok {
				live = append(live, h)
			}
		}
		v.order = live
	}
}

// evict removes one copy of the engine's block h, the block with the last.
func (x *Index) evict(v *pubView, h uint64) {
	switch n := v.copies[h]; n {
	case 0:
		x.remove(v, h)
	case 1:
		delete(v.copies, h)
	default:
		v.copies[h] = n - 1
	}
}

// remove removes the engine's block h, every copy of it.
func (x *Index) remove(v *pubView, h uint64) {
	key, ok := v.engine[h]
	if !ok {
		return
	}
	delete(v.engine, h)
	delete(v.copies, h)
	x.total--
	if n := v.dups[key]; n > 0 {
		if n == 1 {
			delete(v.dups, key)
		} else {
			v.dups[key] = n - 1
		}
		return
	}
	holders := x.blocks[key]
	for i, w := range holders {
		if w == v {
			holders = append(holders[:i], holders[i+1:]...)
			break
		}
	}
	if len(holders) == 0 {
		delete(x.blocks, key)
	} else {
		x.blocks[key] = holders
	}
}

func (x *Index) clear(v *pubView) {
	for h := range v.engine {
		x.remove(v, h)
	}
	v.order, v.dups, v.copies, v.group, v.blockSize = nil, nil, nil, -1, 0 // a restarted engine may lay its cache out anew
}

// Reset forgets p's blocks, and marks its view fresh or not.
func (x *Index) Reset(p Publisher, fresh bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	v := x.view(p)
	x.clear(v)
	v.fresh = fresh
}

// Rebuild forgets p's blocks after a gap that could not be replayed: the view
// starts anew from the next event, and is not trusted for staleAfter.
func (x *Index) Rebuild(p Publisher) {
	x.mu.Lock()
	defer x.mu.Unlock()
	v := x.view(p)
	x.clear(v)
	v.fresh, v.staleUntil = true, x.now().Add(x.staleAfter)
}

// Forget drops p's view, as when its endpoint leaves the pool.
func (x *Index) Forget(p Publisher) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if v := x.pubs[p]; v != nil {
		x.clear(v)
		delete(x.pubs, p)
		if others := slices.DeleteFunc(x.byEndpoint[p.Endpoint], func(w *pubView) bool { return w == v }); len(others) > 0 {
			x.byEndpoint[p.Endpoint] = others
		} else {
			delete(x.byEndpoint, p.Endpoint)
		}
		x.ids = append(x.ids, v.id)
	}
}
