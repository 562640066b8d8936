package scheduling

import (
	"encoding/binary"
	"hash/maphash"
	"slices"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// llmdApprox models llm-d's endpoint picker (EPP) as the baseline
// measured it: the approx-prefix-cache-producer with the prefix-cache-scorer
// (weight 2) and the queue-scorer (weight 1), then the max-score-picker. Read
// from llm-d-router at ebab687:
//
//   - Blocks: the tokenizer-free estimate backend packs 4 bytes of the
//     request into a pseudo-token (tokenizer/estimate.go, bytesPerToken), and
//     blocks are 16 tokens by default but never fewer than 64
//     (approximateprefix/plugin.go, minBlockSizeTokens): 256 bytes. A trailing
//     partial block is hashed too (prefixhash/hashing.go), each block's hash
//     chained to the one before, the first to a hash of the target model and
//     the cache_salt (here, the request's namespace).
//   - The index is this replica's own: per endpoint, an LRU of the block
//     hashes it sent there, 31,250 entries when the engines' cache size is not
//     scraped (approximateprefix/types.go, defaultLRUCapacityPerServer), and
//     for each hash the endpoints whose LRU holds it (indexer.go). The pick is
//     recorded for the chosen endpoint after scheduling.
//   - Match: walking the request's blocks from the first, while some endpoint
//     holds the block, every endpoint holding it scores one more
//     (plugin.go, matchLongestPrefix). The prefix score is matched blocks over
//     the request's blocks (scorer/prefix/plugin.go, matchLengthWeight 0).
//   - The queue score is (max - waiting) / (max - min) over the candidates'
//     scraped waiting queues, 1 for all when they are equal
//     (scorer/queuedepth/queue.go).
//   - The highest total wins, ties broken at random (picker/maxscore).
type llmdApprox struct {
	lrus map[string]*simLRU         // per endpoint
	pods map[uint64]map[string]bool // block hash → endpoints whose LRU holds it
	intn func(int) int
}

const (
	llmdBlockBytes  = 64 * 4
	llmdLRUCapacity = 31_250
	llmdPrefixW     = 2
	llmdQueueW      = 1
)

var llmdModel = simPolicy{name: "llm-d approx", picker: func(_ config.PoolScheduling, intn func(int) int) Picker {
	return &llmdApprox{lrus: map[string]*simLRU{}, pods: map[uint64]map[string]bool{}, intn: intn}
}}

var llmdSeed = maphash.MakeSeed()

func llmdHashes(namespace uint64, prompt string) []uint64 {
	var out []uint64
	var h maphash.Hash
	h.SetSeed(llmdSeed)
	var prev [8]byte
	binary.LittleEndian.PutUint64(prev[:], namespace)
	for i := 0; i < len(prompt); i += llmdBlockBytes {
		h.Reset()
		h.Write(prev[:])
		h.WriteString(prompt[i:min(i+llmdBlockBytes, len(prompt))])
		out = append(out, h.Sum64())
		binary.LittleEndian.PutUint64(prev[:], out[len(out)-1])
	}
	return out
}

func (p *llmdApprox) Pick(req *Request, eps []*Endpoint) *Endpoint {
	hs := llmdHashes(req.namespace(), req.Prompt())
	matched := map[string]int{}
	for _, h := range hs {
		if len(p.pods[h]) == 0 {
			break
		}
		for addr := range p.pods[h] {
			matched[addr]++
		}
	}
	queue := make([]float64, len(eps))
	for i, e := range eps {
		if s := e.scrapedAt(e.cfg().now); s != nil {
			queue[i] = s.Waiting
		}
	}
	lo, hi := slices.Min(queue), slices.Max(queue)
	order := make([]int, len(eps)) // shuffled: ties go at random
	for i := range order {
		j := p.intn(i + 1)
		order[i] = order[j]
		order[j] = i
	}
	best, bestScore := -1, 0.0
	for _, i := range order {
		score := 1.0 * llmdQueueW
		if hi > lo {
			score = llmdQueueW * (hi - queue[i]) / (hi - lo)
		}
		if len(hs) > 0 {
			score += llmdPrefixW * float64(matched[eps[i].Addr]) / float64(len(hs))
		}
		if best < 0 || score > bestScore {
			best, bestScore = i, score
		}
	}
	p.add(hs, eps[best].Addr)
	return eps[best]
}

func (p *llmdApprox) add(hs []uint64, addr string) {
	lru := p.lrus[addr]
	if lru == nil {
		lru = newSimLRU(llmdLRUCapacity)
		p.lrus[addr] = lru
	}
	for _, h := range hs {
		if old, ok := lru.add(h); ok {
			delete(p.pods[old], addr)
			if len(p.pods[old]) == 0 {
				delete(p.pods, old)
			}
		}
		if p.pods[h] == nil {
			p.pods[h] = map[string]bool{}
		}
		p.pods[h][addr] = true
	}
}
