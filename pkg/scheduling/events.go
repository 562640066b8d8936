package scheduling

import (
	"cmp"
	"context"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// poolEvents is a pool's view of its engines' caches, from their KV events
// (pools.<pool>.kv_events): the index prefix-affinity looks requests up in,
// and the subscriber that feeds it.
type poolEvents struct {
	index *kvevents.Index
	sub   *kvevents.Subscriber
	spec  config.KVEvents
}

// cache is the pool's index of its engines' caches, nil unless it follows
// their events.
func (p *Pool) cache() *kvevents.Index {
	if ev := p.events.Load(); ev != nil {
		return ev.index
	}
	return nil
}

// followEvents runs the pool's KV event subscriber while its spec asks for
// one, started anew (with an empty index) when pools.<pool>.kv_events
// changes.
func (p *Pool) followEvents(ctx context.Context) {
	var running config.KVEvents
	stop := func() {}
	defer func() { stop() }()
	for {
		st := p.state.Load()
		if k := st.spec.KVEvents; k != running {
			stop()
			stop, running = func() {}, k
			p.events.Store(nil)
			if k.On() {
				ev := &poolEvents{spec: k, index: kvevents.NewIndex(kvevents.Bounds{PerPublisher: k.MaxBlocksPerEndpoint, Total: k.MaxBlocks},
					k.StaleAfter.D(), p.deps.Now)}
				ev.sub = kvevents.NewSubscriber(kvevents.Config{ConnectPort: k.ConnectPort, Bind: k.Bind, ReplayPort: k.ReplayPort,
					ReplayTimeout: k.ReplayTimeout.D(), Ranks: k.DataParallelSize, StaleAfter: k.StaleAfter.D(), Resync: k.Resync.D(),
					MaxMessageBytes: k.MaxMessageBytes, Counts: &p.eventCounts}, ev.index, p.deps.Log.WithValues("pool", p.Name()))
				p.events.Store(ev)
				sctx, cancel := context.WithCancel(ctx)
				done := make(chan struct{})
				go func() {
					defer close(done)
					ev.sub.Run(sctx, p.addrs)
				}()
				stop = func() { cancel(); <-done }
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-st.changed:
		}
	}
}

// addrs are the pool's endpoints now, and a channel closed when they change.
func (p *Pool) addrs() ([]string, <-chan struct{}) {
	st := p.state.Load()
	out := make([]string, len(st.endpoints))
	for i, e := range st.endpoints {
		out[i] = e.Addr
	}
	return out, st.changed
}

// EventsState is a pool's KV event view, for metrics: nil when it follows
// no events.
type EventsState struct {
	Counts *kvevents.Counts
	Index  kvevents.Stats
}

// Events reads the pool's KV event view; ok is false when it follows none.
func (p *Pool) Events() (s EventsState, ok bool) {
	ev := p.events.Load()
	if ev == nil {
		return EventsState{}, false
	}
	return EventsState{Counts: ev.sub.Counts(), Index: ev.index.Stats()}, true
}

// tokenizeFailures round trips for an API's requests' token ids failed in
// a row (an engine whose /tokenize has no form of them, as SGLang's has none
// of chat messages, a path that is wrong, a tokenizer past its time) pause
// them for that API for the pools' stale_after: its requests meanwhile go by
// the estimates, without a round trip each that cannot help them, and the
// other APIs' go on.
const tokenizeFailures = 3

// tokenizeHealth is, per API (named by its render path), the round trips'
// record (Pools.Tokenized) and whether the engines lack its render endpoint
// (Pools.Unrendered).
type tokenizeHealth struct {
	mu    sync.Mutex
	byAPI map[string]*apiTokenize
}

type apiTokenize struct {
	fails      int       // in a row
	until      time.Time // paused before then
	unrendered time.Time // the render endpoint not asked before then
}

// of is api's record, made when first needed; h.mu is held.
func (h *tokenizeHealth) of(api string) *apiTokenize {
	if h.byAPI == nil {
		h.byAPI = map[string]*apiTokenize{}
	}
	a := h.byAPI[api]
	if a == nil {
		a = &apiTokenize{}
		h.byAPI[api] = a
	}
	return a
}

// Asks says whether to ask an engine for the token ids of a request of api
// (its render path): not while its round trips are paused (Tokenized); and
// whether to ask its render endpoint first: not for the pools' stale_after
// after an engine lacked it (Unrendered).
func (ps *Pools) Asks(api string) (ask, render bool) {
	now := ps.deps.Now()
	h := &ps.tokenize
	h.mu.Lock()
	defer h.mu.Unlock()
	a := h.of(api)
	return !now.Before(a.until), !now.Before(a.unrendered)
}

// Unrendered records an engine without api's render endpoint (an older vLLM,
// SGLang): /tokenize is asked instead, and the endpoint again after the
// pools' stale_after.
func (ps *Pools) Unrendered(api string) {
	ev := ps.followed(false)
	if ev == nil {
		return
	}
	h := &ps.tokenize
	h.mu.Lock()
	defer h.mu.Unlock()
	h.of(api).unrendered = ps.deps.Now().Add(ev.spec.StaleAfter.D())
}

// Tokenized records a round trip for the token ids of a request of api, and
// whether it gave them.
func (ps *Pools) Tokenized(api string, ok bool) {
	ev := ps.followed(false)
	if ev == nil { // no pool follows events since: nothing to pause
		return
	}
	h := &ps.tokenize
	h.mu.Lock()
	defer h.mu.Unlock()
	a := h.of(api)
	if ok {
		a.fails = 0
		return
	}
	if a.fails++; a.fails >= tokenizeFailures {
		a.fails, a.until = 0, ps.deps.Now().Add(ev.spec.StaleAfter.D())
	}
}

// followed is the events of the first pool (prefill, then decode) that
// follows its engines' KV events, with a view routing may trust now if
// usable; nil when none.
func (ps *Pools) followed(usable bool) *poolEvents {
	for _, p := range []*Pool{ps.Prefill, ps.Decode} {
		if ev := p.events.Load(); ev != nil && (!usable || ev.index.Usable()) {
			return ev
		}
	}
	return nil
}

// Tokenizer is where a request's token ids are asked for, when a pool
// follows its engines' KV events: the least busy healthy prefill endpoint
// (the prefill leg's client reaches it), else decode endpoint (as the
// decode pool's checks reach it: a client of few connections, for a pool
// whose prefill endpoints are all down), with the /tokenize path and the
// time allowed of the first pool that follows events. ok is false when no
// pool does, when none of their views may be routed by now (engines that
// publish nothing: no round trip for every request then), or when no
// endpoint is healthy. Of a pool whose engines list req's model, only those
// that do are asked: another model's tokenizer would give other ids.
// Nor is ok for a prompt with an image, audio or video part: vLLM fetches
// and processes the media to answer, and no view holds its blocks from the
// first such part on (uncountedMedia); it goes by the estimates.
// Whether to ask for a request of an API is Asks'.
func (ps *Pools) Tokenizer(req *Request) (e *Endpoint, t Tokenizer, ok bool) {
	ev := ps.followed(true)
	if ev == nil || req.uncountedMedia(0) {
		return nil, Tokenizer{}, false
	}
	model := req.model()
	for _, p := range []*Pool{ps.Prefill, ps.Decode} {
		st := p.state.Load()
		var sc scope // the subset hint is the decode leg's, not this question's
		sc.model, sc.only = st.servingOnly(model)
		var cands []*Endpoint
		for _, c := range st.endpoints {
			if c.Healthy() && sc.admits(c) {
				cands = append(cands, c)
			}
		}
		if len(cands) > 0 {
			e = slices.MinFunc(busyness(cands), func(a, b ranked) int { return cmp.Compare(a.busy, b.busy) }).e
			t := Tokenizer{Path: ev.spec.Tokenize.Path, Timeout: ev.spec.Tokenize.Timeout.D()}
			if p == ps.Decode {
				t.Client, t.Scheme = p.probe.client, p.probe.scheme
			}
			return e, t, true
		}
	}
	return nil, Tokenizer{}, false
}

// Tokenizer is how to ask an engine for a request's token ids: its render
// endpoints (Asks), else /tokenize at Path. A decode engine is asked with
// Client and Scheme, its pool's TLS and API key; a prefill engine's are nil
// and "", as the prefill legs' client reaches it.
type Tokenizer struct {
	Path    string
	Timeout time.Duration
	Client  *http.Client
	Scheme  string
}
