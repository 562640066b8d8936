package kvevents

import (
	"encoding/binary"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// chain is a block's key: a hash of its parent's key, its token ids and its
// extra keys. Token ids are folded in two at a time as 64-bit words (ids are
// far below 2^32), over two independent lanes, FNV-1a style, then mixed: a
// few nanoseconds a block, as the lookup of a long prompt hashes hundreds of
// them per request. buf is scratch space for the extra keys, returned for
// the next block.
func chain(buf []byte, parent uint64, tokens []int64, extra []byte) (uint64, []byte) {
	const prime = 0x100000001b3
	a, b := mix64(parent^0x9e3779b97f4a7c15), parent
	i := 0
	for ; i+3 < len(tokens); i += 4 {
		a = (a ^ (uint64(uint32(tokens[i])) | uint64(uint32(tokens[i+1]))<<32)) * prime
		b = (b ^ (uint64(uint32(tokens[i+2])) | uint64(uint32(tokens[i+3]))<<32)) * prime
	}
	for ; i < len(tokens); i++ {
		a = (a ^ uint64(uint32(tokens[i]))) * prime
	}
	h := a ^ mix64(b^uint64(len(tokens)))
	if len(extra) > 0 {
		buf = binary.LittleEndian.AppendUint64(buf[:0], h)
		buf = append(buf, extra...)
		h = xxhash.Sum64(buf)
	}
	return mix64(h), buf
}

// keysPool keeps the lookups' block keys, a few kilobytes per long prompt.
var keysPool = sync.Pool{New: func() any { return new([]uint64) }}

// mix64 is splitmix64's finalizer: every bit of x moves every bit of the key.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// Lookup returns, for each of endpoints whose view routing may trust now
// (known, by position in endpoints), how many leading tokens of the prompt
// its engine holds in its prefix cache (held, by address, the endpoints that
// hold a block), over all its publishers, of the blocks keyed as a request
// with keys k is (an adapter's, a salted prompt's). A view is not known before any of
// the endpoint's publishers has been followed, while a gap is replayed, for
// staleAfter after a gap it could not replay, or while its engine stays
// silent past staleAfter after work it had to store; the caller goes by
// other means there. Engines that publish different block sizes (a pool of
// mixed GPUs or attention backends) are each matched by their own.
func (x *Index) Lookup(endpoints []string, tokens []int64, k Keys) (held map[string]int, known []bool) {
	now := x.now()
	usable := make([]int8, len(endpoints)) // 0: no publisher seen, 1: all usable, -1: one is not
	x.mu.RLock()
	defer x.mu.RUnlock()
	views := make([]int, len(x.pubs)+len(x.ids)) // by view id: 1 + the endpoint's position, 0 for none

	var sizes []int // the usable views' block sizes, most often one
	known = make([]bool, len(endpoints))
	for i, e := range endpoints {
		for _, v := range x.byEndpoint[e] {
			if !x.usable(v, now) {
				usable[i] = -1
				break
			}
			usable[i] = 1
			views[v.id] = i + 1
			if v.blockSize > 0 && !slices.Contains(sizes, v.blockSize) {
				sizes = append(sizes, v.blockSize)
			}
		}
		known[i] = usable[i] > 0
	}
	// Not sized to the endpoints: few of them hold a block.
	held = map[string]int{}
	matched := make([]int, len(endpoints)) // leading blocks each endpoint holds, at one size
	for _, size := range sizes {
		clear(matched)
		x.match(tokens, size, k, views, usable, matched)
		for i, e := range endpoints {
			if matched[i] > 0 && usable[i] > 0 {
				held[e] = max(held[e], matched[i]*size)
			}
		}
	}
	return held, known
}

// match counts into matched, per endpoint position, the leading blocks of
// blockSize tokens that its views of that block size hold; views maps a view
// id to 1 + its endpoint's position (0: not looked up). x.mu is held.
func (x *Index) match(tokens []int64, blockSize int, k Keys, views []int, usable []int8, matched []int) {
	// The blocks' keys, each chained from the one before, as far as the
	// lookup needs them.
	kp := keysPool.Get().(*[]uint64)
	keys := (*kp)[:0]
	defer func() { *kp = keys[:0]; keysPool.Put(kp) }()
	_, adapter := x.adapters[k.Model] // never "": store keeps no empty name
	first, rest := k.extra(adapter)
	var buf []byte
	keyAt := func(b int) uint64 {
		for len(keys) <= b {
			n := len(keys)
			var parent uint64
			extra := first
			if n > 0 {
				parent, extra = keys[n-1], rest
			}
			var key uint64
			key, buf = chain(buf, parent, tokens[n*blockSize:(n+1)*blockSize], extra)
			keys = append(keys, key)
		}
		return keys[b]
	}
	blocks := len(tokens) / blockSize
	holds := func(i, b int) bool {
		for _, v := range x.blocks[keyAt(b)] {
			if views[v.id]-1 == i && v.blockSize == blockSize {
				return true
			}
		}
		return false
	}
	for b := 0; b < blocks; b++ {
		extended, last := 0, -1
		for _, v := range x.blocks[keyAt(b)] {
			if i := views[v.id] - 1; i >= 0 && usable[i] > 0 && v.blockSize == blockSize && matched[i] == b {
				matched[i] = b + 1
				extended, last = extended+1, i
			}
		}
		if extended == 1 {
			// One engine goes on alone (a conversation's history): find its
			// last block by galloping, as an engine that holds a block holds
			// the ones before it (vLLM frees a sequence's blocks tail first;
			// the index forgets an event's blocks tail first).
			lo, step := b, 1 // it holds block lo
			for lo+step < blocks && holds(last, lo+step) {
				lo, step = lo+step, 2*step
			}
			for hi := min(lo+step, blocks); hi-lo > 1; {
				if mid := (lo + hi) / 2; holds(last, mid) {
					lo = mid
				} else {
					hi = mid
				}
			}
			matched[last] = lo + 1
			break
		}
		if extended == 0 {
			break
		}
	}
}
