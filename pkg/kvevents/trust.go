package kvevents

import (
	"cmp"
	"slices"
	"time"
)

// usable reports whether routing may go by v now: while it is fresh (no gap
// being replayed), past staleUntil (a rebuild after a gap it could not
// replay), and not silent for staleAfter since its engine was sent work it
// had to store (Expect).
func (x *Index) usable(v *pubView, now time.Time) bool {
	return v.fresh && !now.Before(v.staleUntil) && (v.expected.IsZero() || now.Sub(v.expected) <= x.staleAfter)
}

// Expect notes that endpoint was sent a prompt of tokens tokens of which its
// views held held: when that leaves a full block to compute, the engine
// will store it and publish, and an engine whose publishers (one a
// data-parallel rank, any of which may have served it) all stay silent for
// staleAfter from then on is not trusted until one publishes again. So is
// one that never published (an engine started without KV events): its
// block size unknown, it is taken as unpublishedBlock.
func (x *Index) Expect(endpoint string, held, tokens int) {
	x.mu.RLock()
	awaited := slices.ContainsFunc(x.byEndpoint[endpoint], func(v *pubView) bool { return awaits(v, held, tokens) })
	x.mu.RUnlock()
	if !awaited { // most picks: the engine already owes an event, or has the prompt whole
		return
	}
	now := x.now()
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, v := range x.byEndpoint[endpoint] {
		if awaits(v, held, tokens) {
			v.expected = now
		}
	}
}

// awaits says whether v's engine, sent a prompt of tokens tokens of which
// it held held, now owes an event it did not owe before: the prompt leaves
// a full block to store.
func awaits(v *pubView, held, tokens int) bool {
	block := cmp.Or(v.blockSize, unpublishedBlock)
	return v.expected.IsZero() && tokens/block*block > held
}

// unpublishedBlock is the block size, in tokens, assumed of an engine that
// has not published yet: larger than vLLM's (16 by default), so that a
// prompt leaving it this many tokens to compute leaves a full block to
// store, whatever its engine's block size.
const unpublishedBlock = 256

// Usable reports whether routing may go by any of the index's views now.
func (x *Index) Usable() bool {
	now := x.now()
	x.mu.RLock()
	defer x.mu.RUnlock()
	for _, v := range x.pubs {
		if x.usable(v, now) {
			return true
		}
	}
	return false
}

// SetFresh marks p's view as one routing may trust, or not.
func (x *Index) SetFresh(p Publisher, fresh bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.view(p).fresh = fresh
}
