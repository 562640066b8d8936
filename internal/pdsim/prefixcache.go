package pdsim

import (
	"container/list"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// The simulated tokenizer and vLLM's automatic prefix caching over it: an
// engine keeps the KV of full blocks of blockSize tokens, each named by a
// hash chained over the model and every token up to the block's end, so a
// prompt that starts with another's finds that one's blocks however the two
// go on (a conversation's later turn finds its earlier turns).

// tokenize stands in for a tokenizer: one token per word of a string, or per
// token id. It walks the prompt in order (a list's elements in turn, a
// message's role first and then its other fields by name), so a prompt that
// extends another, or chat messages that start with another request's
// messages, give tokens that start with the other's. A word's token depends on
// the field it is in, as a chat template marks a role apart from the content,
// and is a hash below 2^31, so it fits where a real vocabulary's ids do; an
// id the client wrote stays itself.
func tokenize(v any) []uint64 { return appendTokens(nil, v, "") }

func appendTokens(out []uint64, v any, field string) []uint64 {
	switch v := v.(type) {
	case string:
		for _, w := range strings.Fields(v) {
			out = append(out, wordToken(field, w))
		}
	case json.Number:
		out = append(out, idToken(v))
	case []any:
		for _, e := range v {
			out = appendTokens(out, e, field)
		}
	case map[string]any:
		for _, k := range fieldOrder(v) {
			out = appendTokens(out, v[k], k)
		}
	}
	return out
}

// fieldOrder is role first, then the other keys sorted, so the order does
// not depend on how a router encoded the object.
func fieldOrder(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int {
		switch {
		case a == b:
			return 0
		case a == "role":
			return -1
		case b == "role":
			return 1
		}
		return strings.Compare(a, b)
	})
	return keys
}

func wordToken(field, word string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(field))
	h.Write([]byte{0})
	h.Write([]byte(word))
	return h.Sum64() % vocabulary
}

// vocabulary bounds the ids of words: a consumer of /tokenize or of the KV
// events may keep token ids in an int32, as real vocabularies allow.
const vocabulary = 1 << 31

// idToken is a token id as written; a number that is not one (a float in a
// chat message, say) is hashed like a word.
func idToken(n json.Number) uint64 {
	if id, err := strconv.ParseInt(string(n), 10, 64); err == nil {
		return uint64(id)
	}
	if id, err := strconv.ParseUint(string(n), 10, 64); err == nil {
		return id
	}
	return wordToken("", string(n))
}

// blockHash names one full block of a prompt: a sha256 digest, as vLLM's
// default prefix-caching hash is, which the KV events carry.
type blockHash [sha256.Size]byte

// blockKeys are what keys a prompt's blocks besides their tokens, as
// vLLM's generate_block_hash_extra_keys (vllm/v1/core/kv_cache_utils.py)
// lists them: the LoRA adapter's name on every block, then the cache_salt
// on the first.
type blockKeys struct {
	adapter   string
	adapterID int // vLLM's lora_id: 1 + its place among the adapters served
	salt      string
}

// extra are the extra keys of the prompt's block i, nil for none.
func (k blockKeys) extra(i int) []string {
	var out []string
	if k.adapter != "" {
		out = append(out, k.adapter)
	}
	if i == 0 && k.salt != "" {
		out = append(out, k.salt)
	}
	return out
}

// blockHashes names each full block of tokens by a hash of its parent's hash,
// its own tokens and its extra keys, as vLLM's hash_block_tokens chains
// them: a block is the same only after the same model and the same tokens
// before it, for the same adapter and cache_salt. The partial block at the
// end is never cached, so it has no name.
func blockHashes(model string, keys blockKeys, tokens []uint64) []blockHash {
	out := make([]blockHash, len(tokens)/blockSize)
	parent := sha256.Sum256([]byte(model))
	buf := make([]byte, 0, len(parent)+8*blockSize)
	for i := range out {
		buf = append(buf[:0], parent[:]...)
		for _, t := range tokens[i*blockSize : (i+1)*blockSize] {
			buf = binary.LittleEndian.AppendUint64(buf, t)
		}
		for _, k := range keys.extra(i) {
			buf = append(append(buf, 0), k...)
		}
		parent = sha256.Sum256(buf)
		out[i] = parent
	}
	return out
}

// prefixCache is one engine's cached blocks, the least recently used evicted
// first once it holds capacity blocks. Concurrent requests share it.
type prefixCache struct {
	mu       sync.Mutex
	capacity int
	order    *list.List // of blockHash, the most recently used at the front
	blocks   map[blockHash]*list.Element
	events   kvSink // hears every change; nil when no one listens
}

// kvEvent is one change to a prefix cache.
type kvEvent struct {
	kind   kvEventKind
	hashes []blockHash
	parent *blockHash // BlockStored: the block before the first; nil at a prompt's start
	tokens []uint64   // BlockStored: the blocks' tokens, blockSize each
	keys   blockKeys  // BlockStored: what else keys the prompt's blocks
	first  int        // BlockStored: the place of the first block in its prompt
}

type kvEventKind int

const (
	blockStored kvEventKind = iota
	blockRemoved
	allBlocksCleared
)

// kvSink hears a cache's changes in the order they happen, under the cache's
// lock: it must not block.
type kvSink interface{ add(events []kvEvent) }

func newPrefixCache(capacity int, events kvSink) *prefixCache {
	return &prefixCache{capacity: capacity, order: list.New(), blocks: map[blockHash]*list.Element{}, events: events}
}

// match counts the leading blocks of hashes the cache holds, stopping at the
// first it does not (the blocks after it cannot be used without it), and
// marks them used.
func (c *prefixCache) match(hashes []blockHash) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for n < len(hashes) && c.blocks[hashes[n]] != nil {
		n++
	}
	c.touch(hashes[:n])
	return n
}

// insert caches a prompt's full blocks (or marks them used again); tokens
// and keys are the prompt's.
func (c *prefixCache) insert(hashes []blockHash, tokens []uint64, keys blockKeys) {
	c.mu.Lock()
	defer c.mu.Unlock()
	stored := c.stored(hashes, tokens, keys)
	c.touch(hashes)
	// vLLM evicts as it allocates a step's blocks and caches them after, so a
	// batch names the blocks removed before those stored; a block of this very
	// prompt that the cache cannot keep (a prompt longer than the cache) is
	// removed after it was stored.
	var removed, own []kvEvent
	for c.order.Len() > c.capacity {
		h := c.order.Remove(c.order.Back()).(blockHash)
		delete(c.blocks, h)
		if c.events == nil {
			continue
		}
		ev := kvEvent{kind: blockRemoved, hashes: []blockHash{h}} // one event a block, as vLLM evicts them
		if slices.Contains(hashes, h) {
			own = append(own, ev)
		} else {
			removed = append(removed, ev)
		}
	}
	if events := slices.Concat(removed, stored, own); len(events) > 0 {
		c.events.add(events)
	}
}

// stored is what vLLM reports of the blocks of hashes the cache does not
// hold yet: a BlockStored for each run of them, its parent the block before.
func (c *prefixCache) stored(hashes []blockHash, tokens []uint64, keys blockKeys) []kvEvent {
	if c.events == nil {
		return nil
	}
	var out []kvEvent
	for i := 0; i < len(hashes); {
		j := i
		for j < len(hashes) && c.blocks[hashes[j]] == nil {
			j++
		}
		if j > i {
			ev := kvEvent{kind: blockStored, hashes: hashes[i:j], tokens: tokens[i*blockSize : j*blockSize], keys: keys, first: i}
			if i > 0 {
				ev.parent = &hashes[i-1]
			}
			out = append(out, ev)
		}
		i = j + 1
	}
	return out
}

// len is how many blocks the cache holds.
func (c *prefixCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.order.Len()
}

// reset forgets every block, as vLLM's POST /reset_prefix_cache does.
func (c *prefixCache) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.order.Init()
	clear(c.blocks)
	if c.events != nil {
		c.events.add([]kvEvent{{kind: allBlocksCleared}})
	}
}

// touch makes hashes the most recently used, the first block most recent of
// all: vLLM frees a request's blocks tail first, so eviction eats a prefix
// from its end and never orphans the blocks after a lost one.
func (c *prefixCache) touch(hashes []blockHash) {
	for _, h := range slices.Backward(hashes) {
		if e := c.blocks[h]; e != nil {
			c.order.MoveToFront(e)
			continue
		}
		c.blocks[h] = c.order.PushFront(h)
	}
}

// lookup is what vLLM reports as cached for a prompt this engine computes
// itself: its leading full blocks found in the cache, at most those before
// the last token, which vLLM always computes to sample from. It is counted
// in the prefix cache queries and hits, in tokens.
func (m *metrics) lookup(req *request) int {
	usable := req.blocks[:min(len(req.blocks), (req.promptTokens-1)/blockSize)]
	hit := m.cache.match(usable) * blockSize
	m.prefixQueries.Add(int64(req.promptTokens))
	m.prefixHits.Add(int64(hit))
	return hit
}
