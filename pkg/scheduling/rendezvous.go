package scheduling

import (
	"math/bits"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// rendezvousKeys are the two keys that rank a request's endpoints by
// rendezvous (highest-random-weight) hashing: a hash of the key and the
// endpoint's address. Requests that share a key rank the endpoints alike,
// and every replica ranks them alike: the hash is fixed (xxhash), not seeded
// per process. Removing an endpoint moves only the keys it ranked first.
type rendezvousKeys struct{ blockChars, keyBlocks int }

// keys returns, each at most keyBlocks blocks:
//   - prefix, what the request shares with others: its preamble (tools,
//     system prompt, instructions: an agent's or a template's) when that
//     fills a block, else its head (through the first user message), else
//     its full blocks (a completions prompt, token ids);
//   - conversation, what every turn of its conversation repeats: its head,
//     or its prefix when it has none.
//
// A later turn whose preamble leaves less than a block of the key to the
// first user message keys its conversation by its head with the preamble
// kept whole and keyBlocks blocks after it (wholeHead), so that an agent's
// tools and system prompt, tens of kilobytes, leave room for what tells its
// conversations apart: each then keeps to an endpoint of the prefix's home
// set of its own. A first request (a one-shot one, as far as anyone knows)
// keeps the head cut to the key, so that questions under one long system
// prompt meet on the first of its home set, which then caches the prompt for
// all of them. Both are "" when the request has neither a head nor a full
// block.
func (k rendezvousKeys) keys(req *Request) (prefix, conversation string) {
	prompt, limit := req.Prompt(), k.keyBlocks*k.blockChars
	head := req.Head()
	if head == "" {
		prefix = prompt[:min(len(prompt)/k.blockChars*k.blockChars, limit)]
		return prefix, prefix
	}
	conversation = head[:min(len(head), limit)]
	pre := req.Preamble()
	if len(pre) < k.blockChars {
		return conversation, conversation
	}
	if req.Previous() != "" && k.wholeHead(req) {
		conversation = head[:min(len(head), len(pre)+limit)]
	}
	return pre[:min(len(pre), limit)], conversation
}

// wholeHead says whether the key cut to keyBlocks blocks leaves less than a
// block of the request's first user message to a preamble that is its
// prefix key, so that a later turn keys by more of its head than the
// conversation's first request did.
func (k rendezvousKeys) wholeHead(req *Request) bool {
	limit, pre := k.keyBlocks*k.blockChars, len(req.Preamble())
	return pre >= k.blockChars && pre > limit-k.blockChars && len(req.Head()) > limit
}

// conversationHash is the hash of a request's conversation key, with the
// client's own name for the conversation on a later turn (OpenAI's
// prompt_cache_key: Codex's conversation id, where the first user item is
// the same for every session in a directory).
func conversationHash(req *Request, conversation string, namespace uint64) uint64 {
	h := xxhash.Sum64String(conversation) ^ namespace
	if name := req.conversationName(); name != "" && req.Previous() != "" {
		h ^= mix64(xxhash.Sum64String(name))
	}
	return h
}

// keyedAlike says whether a later turn's previous request was ranked by the
// same conversation key (keys, conversationHash): always when that was a
// later turn too; when it was the conversation's first, only if neither the
// head kept whole nor a name set the two apart.
func (k rendezvousKeys) keyedAlike(req *Request) bool {
	return len(req.Previous()) > len(req.Head()) || req.conversationName() == "" && !k.wholeHead(req)
}

// weighed is an endpoint's rendezvous weight for a key's hash, in the bits
// above the posBits that hold pos, its position among the candidates: one
// integer to sort by (pos parts only weights equal in every bit kept).
func weighed(key uint64, e *Endpoint, pos, posBits int) uint64 {
	h := e.addrHash
	if h == 0 { // a bare Endpoint
		h = xxhash.Sum64String(e.Addr)
	}
	return mix64(key^h)>>posBits<<posBits | uint64(pos)
}

// mix64 is splitmix64's finalizer, so that an endpoint's weight for one key
// says nothing of its weight for another.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// followQueue × queueSlack is the queue over the mean at which a request
// stops following the endpoint that holds its history (the local hint).
const followQueue = 3

// homeSize is how many endpoints a prefix with this share of the pool's
// requests keeps its cache on: share × n × spread, at least 1, rounded up
// to a power of two so that replicas, whose estimates of the share differ
// a little, mostly agree, and at most n.
func homeSize(share float64, n int, spread float64) int {
	k := int(share*float64(n)*spread + 0.999)
	if k <= 1 {
		return 1
	}
	return min(n, 1<<bits.Len(uint(k-1)))
}

// ranked is a candidate endpoint as prefixAffinity orders them.
type ranked struct {
	e            *Endpoint
	busy, queued float64  // busyness
	scrape       *scraped // its engine's last fresh scrape, nil: none
}

// rank orders the candidates for a request: by the weights of its prefix
// (whose hash is prefix), with the first home of them (the prefix's home set)
// reordered by the conversation's (whose hash is conversation). Requests that
// share a prefix share its first home endpoints, so that a system prompt is
// cached on as few engines as its traffic needs; within them each
// conversation has an order of its own, which its turns keep.
//
// It sorts integers (weighed), heaviest first, not the ranked structs: at a
// thousand candidates the pick takes 0.4 of the time (BenchmarkSelectAtScale).
func rank(prefix, conversation uint64, home int, eps []*Endpoint) []ranked {
	posBits := max(1, bits.Len(uint(len(eps)-1)))
	var small [64]uint64 // most pools': no allocation
	keys := small[:0]
	if len(eps) > len(small) {
		keys = make([]uint64, 0, len(eps))
	}
	for i, e := range eps {
		keys = append(keys, weighed(prefix, e, i, posBits))
	}
	slices.Sort(keys)
	slices.Reverse(keys)
	pos := func(k uint64) int { return int(k & (1<<posBits - 1)) }
	if home > 1 {
		for j, k := range keys[:home] {
			keys[j] = weighed(conversation, eps[pos(k)], pos(k), posBits)
		}
		slices.Sort(keys[:home])
		slices.Reverse(keys[:home])
	}
	ordered := make([]*Endpoint, len(keys))
	for j, k := range keys {
		ordered[j] = eps[pos(k)]
	}
	return busyness(ordered)
}
