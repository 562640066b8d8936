package pdsim

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// The blocks a prefill engine holds for a decode engine to pull, as the NIXL
// and Mooncake simulations both keep them, and the side channel that
// serves them.

// kvLease is how long a prefill keeps blocks no decode has read (vLLM's kv_lease_duration).
const kvLease = 30 * time.Second

// kvBlocks is what a prefill holds for one request until a decode reads it.
// The side channel serves it so the decode can check it got what it asked for.
type kvBlocks struct {
	EngineID   string    `json:"engine_id"`
	BlockIDs   [][]int64 `json:"block_ids"`
	PromptHash string    `json:"prompt_hash"`
	RequestID  string    `json:"request_id"` // the prefill request's X-Request-Id
	NumTokens  int       `json:"num_tokens"`
	expires    time.Time
}

// blockStore is the prefill's set of blocks waiting for a decode, keyed by
// remote_request_id (NIXL) or transfer_id (Mooncake).
type blockStore struct {
	metrics *metrics
	mu      sync.Mutex
	held    map[string]*kvBlocks
	nextID  int64
	issued  chan struct{} // closed, and made anew, at each issue (await)
}

func newBlockStore(m *metrics) *blockStore {
	return &blockStore{metrics: m, held: map[string]*kvBlocks{}, issued: make(chan struct{})}
}

func (b *blockStore) issue(key, engineID string, req *request) *kvBlocks {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(time.Now())
	n := blocksFor(req.promptTokens)
	ids := make([]int64, n)
	for i := range ids {
		b.nextID++
		ids[i] = b.nextID
	}
	blk := &kvBlocks{EngineID: engineID, BlockIDs: [][]int64{ids}, PromptHash: req.promptHash, RequestID: req.id,
		NumTokens: req.promptTokens, expires: time.Now().Add(kvLease)}
	b.held[key] = blk
	b.metrics.blocks.Add(n)
	close(b.issued)
	b.issued = make(chan struct{})
	return blk
}

func (b *blockStore) release(key string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	blk, ok := b.held[key]
	if ok {
		b.drop(key, blk)
	}
	return ok
}

// expire frees blocks whose lease ran out; checked lazily, so no timers to stop.
func (b *blockStore) expire(now time.Time) {
	for key, blk := range b.held {
		if now.After(blk.expires) {
			b.drop(key, blk)
		}
	}
}

func (b *blockStore) drop(key string, blk *kvBlocks) {
	delete(b.held, key)
	b.metrics.blocks.Add(-blocksFor(blk.NumTokens))
}

const errNoBlocks = "no such blocks: never issued, already read, or lease expired"

// sideChannel stands in for the transfer: a decode GETs the blocks, then
// DELETEs them as NIXL's "done reading" notification frees them. With wait,
// a GET waits that long for blocks not issued yet, as Mooncake's prefill
// worker waits for a transfer it does not know yet (NIXL's answers at once).
func (b *blockStore) sideChannel(wait time.Duration) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /kv/{id}", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), wait)
		defer cancel()
		if blk, ok := b.await(ctx, r.PathValue("id")); ok {
			writeJSON(w, http.StatusOK, blk)
			return
		}
		if wait > 0 {
			http.Error(w, "Timeout waiting for P side ready.", http.StatusNotFound)
			return
		}
		http.Error(w, errNoBlocks, http.StatusNotFound)
	})
	mux.HandleFunc("DELETE /kv/{id}", func(w http.ResponseWriter, r *http.Request) {
		if b.release(r.PathValue("id")) {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		http.Error(w, errNoBlocks, http.StatusNotFound)
	})
	return mux
}

// await returns key's blocks once they are issued, or false when ctx ends first.
func (b *blockStore) await(ctx context.Context, key string) (*kvBlocks, bool) {
	for {
		b.mu.Lock()
		b.expire(time.Now())
		blk, ok := b.held[key]
		issued := b.issued
		b.mu.Unlock()
		if ok {
			return blk, true
		}
		select {
		case <-issued:
		case <-ctx.Done():
			return nil, false
		}
	}
}

// pulled ends a decode's pull of the blocks at blocksURL: the transfer's
// time, then the release that frees them on the prefill engine (else
// their lease does).
func (s *Server) pulled(ctx context.Context, blocksURL string) error {
	if err := wait(ctx, s.cfg.KVTransfer); err != nil {
		return err
	}
	if err := s.callPeer(ctx, http.MethodDelete, blocksURL, nil, nil); err != nil {
		s.log.Warn("releasing KV blocks", "url", blocksURL, "err", err)
	}
	return nil
}
