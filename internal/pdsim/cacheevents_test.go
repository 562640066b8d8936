package pdsim

import (
	"reflect"
	"testing"
)

type recordedEvents [][]kvEvent

func (r *recordedEvents) add(events []kvEvent) { *r = append(*r, events) }

// prompt is n blocks of tokens of its own.
func prompt(p, n int) ([]blockHash, []uint64) {
	tokens := make([]uint64, n*blockSize)
	for i := range tokens {
		tokens[i] = uint64(p*10_000 + i)
	}
	return blockHashes("m", blockKeys{}, tokens), tokens
}

// What the cache reports of each change, one batch a change: the new blocks
// in runs chained to the block before, each eviction, a reset; nothing for
// blocks it has.
func TestPrefixCacheEvents(t *testing.T) {
	a, aTok := prompt(1, 4)
	b, bTok := prompt(2, 2)
	first := []kvEvent{{kind: blockStored, hashes: a[:2], tokens: aTok[:32]}}
	tests := []struct {
		name     string
		capacity int
		change   func(c *prefixCache)
		want     [][]kvEvent
	}{
		{"a prompt's blocks, the first with no parent; then the rest, chained to the last cached", 8, func(c *prefixCache) {
			c.insert(a[:2], aTok, blockKeys{})
			c.insert(a, aTok, blockKeys{})
		}, [][]kvEvent{first, {{kind: blockStored, hashes: a[2:], parent: &a[1], tokens: aTok[32:], first: 2}}}},
		{"nothing new, nothing reported", 8, func(c *prefixCache) {
			c.insert(a[:2], aTok, blockKeys{})
			c.insert(a[:2], aTok, blockKeys{})
		}, [][]kvEvent{first}},
		{"a run on each side of a block cached", 8, func(c *prefixCache) {
			c.insert(a[:2], aTok, blockKeys{})
			c.reset()
			c.mu.Lock()
			c.touch(a[1:2]) // no prompt leaves such a hole, but runs are what is reported
			c.mu.Unlock()
			c.insert(a[:3], aTok, blockKeys{})
		}, [][]kvEvent{first, {{kind: allBlocksCleared}}, {
			{kind: blockStored, hashes: a[:1], tokens: aTok[:16]},
			{kind: blockStored, hashes: a[2:3], parent: &a[1], tokens: aTok[32:48], first: 2},
		}}},
		{"evictions, the least recently used first, an event each, before the blocks stored (as vLLM evicts while it allocates)", 4, func(c *prefixCache) {
			c.insert(a, aTok, blockKeys{})
			c.insert(b, bTok, blockKeys{})
		}, [][]kvEvent{{{kind: blockStored, hashes: a, tokens: aTok}}, {
			{kind: blockRemoved, hashes: a[3:4]},
			{kind: blockRemoved, hashes: a[2:3]},
			{kind: blockStored, hashes: b, tokens: bTok},
		}}},
		{"a prompt longer than the cache: stored, then its own tail evicted", 1, func(c *prefixCache) {
			c.insert(b, bTok, blockKeys{})
		}, [][]kvEvent{{{kind: blockStored, hashes: b, tokens: bTok}, {kind: blockRemoved, hashes: b[1:2]}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got recordedEvents
			tt.change(newPrefixCache(tt.capacity, &got))
			if !reflect.DeepEqual([][]kvEvent(got), tt.want) {
				t.Errorf("events %+v\nwant %+v", got, tt.want)
			}
		})
	}
}
