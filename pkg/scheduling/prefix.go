package scheduling

import (
	"container/list"
	"encoding/binary"
	"hash/maphash"
	"math"
	"slices"
	"sync"
)

// serversPerBlock is how many recent servers of a block are remembered: a hot
// prefix that the load bound spread over several endpoints is cached on each.
const serversPerBlock = 4

var blockSeed = maphash.MakeSeed()

// prefixIndex remembers which endpoints last served each chain of prompt
// blocks, the approximate stand-in for the engines' prefix caches. A chain
// hash covers a block and everything before it, so a match on block i means
// the endpoint saw the same first i blocks. It is a bounded LRU, and local to
// one replica: prefix affinity uses it only as a hint (affinity.go), and the
// simulation's baseline as the whole policy.
type prefixIndex struct {
	blockChars, capacity int

	mu      sync.Mutex
	entries map[uint64]*list.Element
	lru     list.List // of *prefixEntry, most recent first
}

type prefixEntry struct {
	hash    uint64
	servers [serversPerBlock]holder // most recent first
	// The last request recorded to end in this block: a hash of its text
	// after the block (a partial block, often empty); ends says there is one.
	tail uint64
	ends bool
}

// holder is the engine a block was sent to (Endpoint.engine), and its stamp
// then, against which what it writes later ages the block (prefixIndex.fresh).
type holder struct {
	engine string
	stamp
}

// stamp is how much an engine had written into its cache (Load.Written; 0:
// not known), and how many of its restarts had been seen (scraped.restarts).
type stamp struct {
	written  float64
	restarts uint32
}

func newPrefixIndex(blockChars, capacity int) *prefixIndex {
	return &prefixIndex{blockChars: blockChars, capacity: capacity, entries: map[uint64]*list.Element{}}
}

// hashes returns the chain hashes of the prompt's full blocks, the chain
// started from the hash of its namespace (Request.namespace); a trailing
// partial block is left out, as engines cache only full blocks.
func (x *prefixIndex) hashes(namespace uint64, prompt string) []uint64 {
	n := len(prompt) / x.blockChars
	if n == 0 {
		return nil
	}
	out := make([]uint64, n)
	var h maphash.Hash
	h.SetSeed(blockSeed)
	var prev [8]byte
	binary.LittleEndian.PutUint64(prev[:], namespace)
	for i := range n {
		h.Reset()
		h.Write(prev[:])
		h.WriteString(prompt[i*x.blockChars : (i+1)*x.blockChars])
		out[i] = h.Sum64()
		binary.LittleEndian.PutUint64(prev[:], out[i])
	}
	return out
}

// matched returns, per engine (Endpoint.engine), the number of leading blocks of the
// chain it served last.
func (x *prefixIndex) matched(hs []uint64) map[string]int {
	m := map[string]int{}
	x.mu.Lock()
	defer x.mu.Unlock()
	for i, h := range hs {
		el, ok := x.entries[h]
		if !ok {
			break // record refreshes a chain head last, so it outlives its tail
		}
		for _, s := range el.Value.(*prefixEntry).servers {
			if s.engine != "" {
				m[s.engine] = i + 1
			}
		}
	}
	return m
}

// ended says whether the last request recorded to end where text ends was
// text itself, text being a start of the prompt whose chain hs is: whether
// this replica routed that very request, rather than longer ones that share
// it (a few-shot template, a system prompt).
func (x *prefixIndex) ended(text string, hs []uint64) bool {
	n := len(text) / x.blockChars
	if n == 0 || n > len(hs) {
		return false
	}
	tail := maphash.String(blockSeed, text[n*x.blockChars:])
	x.mu.Lock()
	defer x.mu.Unlock()
	el, ok := x.entries[hs[n-1]]
	return ok && el.Value.(*prefixEntry).ends && el.Value.(*prefixEntry).tail == tail
}

// fresh is how many leading blocks of the chain hs engine holds, as matched
// counts them, by the blocks this replica last sent engine since the stamp
// since (Endpoint.cacheWindow), in the same run: those an engine that keeps
// what it wrote last (vLLM's prefix cache evicts the least recently used
// blocks) still holds, as far as this replica knows. A block sent carries
// the chain before it, which was used again with it.
func (x *prefixIndex) fresh(hs []uint64, engine string, since stamp) int {
	in := func(s holder) bool {
		return s.engine == engine && s.restarts == since.restarts && s.written >= since.written
	}
	n := 0
	x.mu.Lock()
	defer x.mu.Unlock()
	for i, h := range hs {
		el, ok := x.entries[h]
		if !ok {
			break // as matched
		}
		if slices.ContainsFunc(el.Value.(*prefixEntry).servers[:], in) {
			n = i + 1
		}
	}
	return n
}

// record notes that engine, at the stamp at, now holds the chain hs of
// prompt, and that a request ended with prompt.
func (x *prefixIndex) record(prompt string, hs []uint64, engine string, at stamp) {
	if len(hs) == 0 {
		return
	}
	tail := maphash.String(blockSeed, prompt[len(hs)*x.blockChars:])
	x.mu.Lock()
	defer x.mu.Unlock()
	for i := len(hs) - 1; i >= 0; i-- {
		var e *prefixEntry
		if el, ok := x.entries[hs[i]]; ok {
			x.lru.MoveToFront(el)
			e = el.Value.(*prefixEntry)
		} else {
			if x.lru.Len() >= x.capacity {
				old := x.lru.Back()
				delete(x.entries, old.Value.(*prefixEntry).hash)
				x.lru.Remove(old)
			}
			e = &prefixEntry{hash: hs[i]}
			x.entries[hs[i]] = x.lru.PushFront(e)
		}
		withFirst(&e.servers, holder{engine, at})
		if i == len(hs)-1 {
			e.tail, e.ends = tail, true
		}
	}
}

// withFirst puts first at the front of s, the others after it in their
// order: first's older place, or else the last, is given up.
func withFirst(s *[serversPerBlock]holder, first holder) {
	i := slices.IndexFunc(s[:], func(h holder) bool { return h.engine == first.engine })
	if i < 0 {
		i = serversPerBlock - 1
	}
	copy(s[1:i+1], s[:i])
	s[0] = first
}

// coverage is how often this replica routed the previous request of a
// conversation's later turn (prefixIndex.ended): near all when it sees its
// conversations whole, about 1/N when N replicas take turns. The counts decay
// by 1 % a turn, so that it follows the replicas coming and going: a second
// replica taking turns ends the trust within some twenty turns, and trust
// comes back some 150 whole turns after the other left.
type coverage struct {
	mu         sync.Mutex
	held, seen float64 // decayed counts of turns
}

const (
	coverageDecay   = 0.99
	coverageMinSeen = 8   // decayed turns seen before any trust: nine turns
	coverageWhole   = 0.9 // the share held that counts as whole
)

// note counts a later turn, if this is one, as held or not, and says whether
// this replica sees its conversations whole.
func (c *coverage) note(turn, held bool) (whole bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if turn {
		c.seen = coverageDecay*c.seen + 1
		c.held *= coverageDecay
		if held {
			c.held++
		}
	}
	return c.seen >= coverageMinSeen && c.held >= coverageWhole*c.seen
}

// clientCoverages are the coverage counts of the requests that name no
// session, one per client address (Request.Client): the shipped Envoy configs
// hash such a request to a replica by its address, so a client that keeps one
// address has its conversations seen whole by one replica, while one whose
// turns leave from several addresses (an application's pods taking turns)
// has them spread. Counted apart, each is trusted as far as it holds. At most
// maxClients addresses are counted, the least recently seen forgotten first.
type clientCoverages struct {
	mu      sync.Mutex
	clients map[string]*list.Element
	lru     list.List // of *clientCoverage, most recent first
}

type clientCoverage struct {
	client string
	coverage
}

// maxClients bounds the client addresses counted: a forgotten one starts
// again untrusted, at a few hundred bytes each.
const maxClients = 4096

// of is client's coverage, counted from now if it is new.
func (c *clientCoverages) of(client string) *coverage {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.clients[client]; ok {
		c.lru.MoveToFront(el)
		return &el.Value.(*clientCoverage).coverage
	}
	if c.clients == nil {
		c.clients = map[string]*list.Element{}
	}
	if c.lru.Len() >= maxClients {
		old := c.lru.Back()
		delete(c.clients, old.Value.(*clientCoverage).client)
		c.lru.Remove(old)
	}
	cc := &clientCoverage{client: client}
	c.clients[client] = c.lru.PushFront(cc)
	return &cc.coverage
}

// shares estimates, for each prefix key, its share of the requests this
// replica picks for: its count over the count of all requests, both decaying
// by sharesDecay a request (a window of 1 / (1 - sharesDecay) requests,
// about a minute of a busy pool's traffic), as if sharesPrior requests of
// no key had come first. A replica that has seen few requests yet so
// underestimates, and keeps prefixes on fewer endpoints, for its first few
// hundred requests; a prior of a whole window would have it underestimate
// for several windows, and behind eight replicas a window of one is eight
// of the pool's. Behind a round robin every replica sees the same mix, so
// their estimates differ only by sampling.
type shares struct {
	mu     sync.Mutex
	n      float64 // requests noted
	counts map[uint64]shareCount
}

type shareCount struct{ count, at float64 } // decayed count as of request at

const (
	sharesDecay = 0.999
	sharesPrior = 100
	// sharesMax bounds the keys kept; past it, the keys whose decayed count
	// is below sharesForget are dropped.
	sharesMax    = 1 << 14
	sharesForget = 0.05
)

func newShares() *shares { return &shares{counts: map[uint64]shareCount{}} }

// note counts a request with the key whose hash is h and returns the key's
// share.
func (s *shares) note(h uint64) float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n++
	c := s.counts[h]
	c.count = c.count*math.Pow(sharesDecay, s.n-c.at) + 1
	c.at = s.n
	if _, ok := s.counts[h]; !ok && len(s.counts) >= sharesMax {
		for k, v := range s.counts {
			if v.count*math.Pow(sharesDecay, s.n-v.at) < sharesForget {
				delete(s.counts, k)
			}
		}
	}
	s.counts[h] = c
	// Over the decayed count of every request, the prior's included: what is
	// left of a request noted before the first is faded.
	faded := math.Pow(sharesDecay, s.n)
	return c.count / ((1-faded)/(1-sharesDecay) + faded*sharesPrior)
}

// poolShares are the shares of a pool's requests and, for requests that only
// some of its endpoints serve (a pool of several models, models.go), of
// each model's requests among themselves: a prefix's home set is sized
// against the endpoints it is ranked over, so its share must be of the
// traffic those take. At most maxModelShares models are told apart; the
// others share the pool's count.
type poolShares struct {
	all     *shares
	mu      sync.Mutex
	byModel map[string]*shares
}

const maxModelShares = 256

func newPoolShares() *poolShares { return &poolShares{all: newShares(), byModel: map[string]*shares{}} }

// of is the shares req's share is counted in: its model's when only that
// model's endpoints were candidates, else the pool's.
func (ps *poolShares) of(req *Request) *shares {
	if !req.modelOnly {
		return ps.all
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	s, ok := ps.byModel[req.Model]
	if !ok && len(ps.byModel) >= maxModelShares {
		return ps.all
	}
	if !ok {
		s = newShares()
		ps.byModel[req.Model] = s
	}
	return s
}
