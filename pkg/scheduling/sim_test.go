package scheduling

import (
	"cmp"
	"container/heap"
	"container/list"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// A discrete-event simulation of one pool of aggregated engines on a
// simulated clock: no real time passes. Each engine has a FIFO prefill stage
// whose cost is proportional to the prompt characters not in its prefix
// cache (an LRU of 64-character blocks), then decodes concurrently. The
// router is the real Pool with the real policies, as many independent
// replicas of it as asked, each taking every N-th request in turn (as
// Envoy's round robin spreads ext_proc streams); only time, randomness and
// /metrics scrapes are simulated, and every replica scrapes the same figures.
// The workloads are in simwork_test.go.

type simParams struct {
	Workload     simWorkload
	Seed         uint64
	Duration     time.Duration
	Load         float64   // the workload's rates are multiplied by it
	Speeds       []float64 // per endpoint, 1 = nominal
	PrefillCPS   float64   // prompt characters per second at speed 1
	PrefillFixed time.Duration
	TPOT         time.Duration // time per output token at speed 1, light batch
	CacheChars   int           // prefix cache size per engine, in characters
	FailEndpoint int           // index of the endpoint that goes down
	FailFrom     float64       // share of Duration
	FailTo       float64
	ScrapeEvery  time.Duration
	// Batch makes the workload's completions prompts batch work, of an
	// objective of negative priority; with Shed, a replica refuses such a
	// request while its pool is Saturated, and its client sends it again
	// after the Retry-After (simshed_test.go).
	Batch, Shed bool
	ShedQueue   float64       // the saturation line of the engines' queues; 0: admission's default
	ShedRetry   time.Duration // how long a client waits to send a shed request again; 0: admission's default
	// HoldFor, with Shed, holds a batch request that meets its pool saturated
	// for up to that long (Hold: released on the scrapes, by the replica's
	// share of the room) before it is refused; 0 refuses at once.
	HoldFor time.Duration
}

// shedLines are the saturation lines the simulations shed at.
func (p simParams) shedLines() Lines {
	return Lines{cmp.Or(p.ShedQueue, config.DefaultSaturatedQueue), config.DefaultSaturatedKVCache}
}

// scrapedUntil is when the scrapes may stop once nothing is left to send
// (simClock.every), and when shedding stops: with the window, or, where
// batch work is shed, four windows later, so that the work put off is served
// as the engines catch up after the arrivals stop, refused while they are
// still saturated, rather than all at once at the window's end.
func (p simParams) scrapedUntil() time.Duration {
	if p.Shed {
		return 4 * p.Duration
	}
	return p.Duration
}

// shedWait is how long a refused client waits: the Retry-After.
func (p simParams) shedWait() time.Duration { return cmp.Or(p.ShedRetry, config.DefaultShedRetryAfter) }

// The engines' prefix cache sizes the tables compare, in characters: one
// that holds every system prompt many times over, and one that holds about a
// third of the distinct system prompts of the one-shot workload (48 of them,
// some 550,000 characters), as when a platform has more agents and templates
// than a GPU's KV cache holds beside its running requests.
const (
	largeCache = 1_500_000 // ~375k tokens of KV per engine
	smallCache = 180_000   // ~45k tokens
)

func defaultSimParams() simParams {
	return simParams{
		Workload:     multiTurn,
		Seed:         42,
		Duration:     10 * time.Minute,
		Load:         1,
		Speeds:       []float64{1.6, 1.6, 1.2, 1.0, 1.0, 1.0, 0.6, 0.5},
		PrefillCPS:   40_000, // ~10k tokens/s
		PrefillFixed: 15 * time.Millisecond,
		TPOT:         12 * time.Millisecond,
		CacheChars:   largeCache,
		FailEndpoint: 2,
		FailFrom:     0.4,
		FailTo:       0.7,
		ScrapeEvery:  time.Second,
	}
}

type simResult struct {
	Policy            string
	Replicas          int
	Requests, Failed  int
	Moves             int     // later turns served elsewhere than the turn before
	HitRate           float64 // cached share of prompt characters
	Ceiling           float64 // the hit rate of one engine with an unbounded cache
	Offered           float64 // prompt characters per second over the engines' prefill capacity
	MeanTTFT, P99TTFT time.Duration
	// Shed is how many times a batch request was refused; Interactive and
	// BatchTTFT split the time to first token by class, a batch request's
	// counted from its first attempt (with Batch only).
	Shed                   int
	Interactive, BatchTTFT simTTFT
}

type simTTFT struct{ Mean, P99 time.Duration }

// meanOver adds x's share of a mean over n runs.
func (t *simTTFT) meanOver(x simTTFT, n int) {
	t.Mean += x.Mean / time.Duration(n)
	t.P99 += x.P99 / time.Duration(n)
}

// ttftOf is the mean and p99 of ts, which it sorts.
func ttftOf(ts []time.Duration) simTTFT {
	if len(ts) == 0 {
		return simTTFT{}
	}
	slices.Sort(ts)
	var sum time.Duration
	for _, t := range ts {
		sum += t
	}
	return simTTFT{sum / time.Duration(len(ts)), ts[int(math.Ceil(0.99*float64(len(ts))))-1]}
}

type simMessage struct{ Role, Content string }

// chatRequest is a chat completions request with these messages, read as the
// pipeline reads a client's body.
func chatRequest(msgs []simMessage) *Request {
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	ms := make([]message, len(msgs))
	for i, m := range msgs {
		ms[i] = message(m)
	}
	b, _ := json.Marshal(map[string]any{"model": "m", "messages": ms})
	obj, err := body.Parse(b)
	if err != nil {
		panic(err)
	}
	return NewRequest(api.Chat.Prompt(obj))
}

// simPolicy is a policy as configured (with prefix's keys, when set), or a
// picker built by the simulation itself (a baseline that is not
// configurable).
type simPolicy struct {
	name, config string
	prefix       config.PrefixAffinity
	picker       func(s config.PoolScheduling, intn func(int) int) Picker
	// events: the pools follow the engines' KV events, and every request's
	// tokens are known (its prompt's bytes, as the engines cache them).
	events bool
	// blind: requests are read without their namespace (api.Prompt's), as
	// prefix-affinity read them before it ranked by model and cache_salt.
	blind bool
	// pinned: a conversation's requests all go to one replica, as Envoy's
	// ring hash on the client's session header sends them (docs/envoy.md,
	// "Sessions on one replica"), and say so (Request.Session); other
	// requests go to the replicas in turn.
	pinned bool
	// pinShare, with pinned, is the share of conversations whose client
	// names its session; the others go in turn. 0 pins them all.
	pinShare float64
	// byAddress, with pinned, pins the pinShare of conversations (0: all)
	// by their client's address instead of a session header (Request.Client), as
	// the shipped Envoy configs do for a client that names no session; the
	// others come from one of simPods addresses a turn (an application's
	// pods taking turns), and go to the replica that address hashes to.
	// oneCount reads every such request without its address, so that one
	// count stands for all of them, as before the counts per address.
	byAddress, oneCount bool
}

// simPods is how many addresses an application's requests leave from, and
// simClients how many clients keep one address each, their conversations
// numbered in turn.
const simPods, simClients = 16, 64

func configured(name string) simPolicy { return simPolicy{name: name, config: name} }

// ---- engines ----

const simBlock = 64

type simEngine struct {
	prefiller[*simReq]
	simCache
	speed   float64
	down    bool
	running int
	// computed and prefilling are what vLLM's prefill histograms sum as
	// requests finish: the prompt tokens computed and the seconds spent
	// prefilling them (Load.Computed, Load.Prefilling).
	computed, prefilling float64
}

// simCache is an engine's prefix cache.
type simCache struct {
	cache *simLRU // of block hashes
	// events, when set, is told of every change to cache, as an engine
	// publishes its KV events.
	events func(...kvevents.Event)
}

// prefiller is an engine's prefill: one request at a time, the others
// queued in order of arrival. start begins a request's prefill, whose end
// calls done.
type prefiller[R any] struct {
	queue []R
	busy  bool
	start func(R)
}

func (p *prefiller[R]) add(r R) {
	p.queue = append(p.queue, r)
	p.next()
}

func (p *prefiller[R]) done() {
	p.busy = false
	p.next()
}

func (p *prefiller[R]) next() {
	if p.busy || len(p.queue) == 0 {
		return
	}
	r := p.queue[0]
	p.queue, p.busy = p.queue[1:], true
	p.start(r)
}

// simLRU is a set of at most capacity hashes that forgets the least recently
// added or touched first.
type simLRU struct {
	capacity int
	m        map[uint64]*list.Element
	lru      list.List
	stored   int // hashes added, not touched, since it started: as an engine's Load.Written
}

func newSimLRU(capacity int) *simLRU {
	return &simLRU{capacity: capacity, m: map[uint64]*list.Element{}}
}

func (c *simLRU) has(h uint64) bool { _, ok := c.m[h]; return ok }

// add adds or touches h, and returns the hash it evicted, if any.
func (c *simLRU) add(h uint64) (evicted uint64, ok bool) {
	if el, found := c.m[h]; found {
		c.lru.MoveToFront(el)
		return 0, false
	}
	if c.lru.Len() >= c.capacity {
		old := c.lru.Back()
		evicted, ok = old.Value.(uint64), true
		delete(c.m, evicted)
		c.lru.Remove(old)
	}
	c.m[h] = c.lru.PushFront(h)
	c.stored++
	return evicted, ok
}

// counters are what vLLM's counters report of a cache of cacheChars holding
// c (Load.CacheTokens, Load.Written: cache_config_info's size, and prompt −
// hit + generation tokens, here the blocks stored since it started).
func (c *simLRU) counters(cacheChars int) (size, written float64) {
	return float64(cacheChars / simCharsPerToken), float64(c.stored * simBlock / simCharsPerToken)
}

// simHashes are an engine's block hashes of prompt: the prefix index's own
// chain hashing, on the engines' 64-character blocks.
func simHashes(prompt string) []uint64 { return simIndex.hashes(0, prompt) }

var simIndex = newPrefixIndex(simBlock, 1)

// saltKeys are saltKey's, by salt.
var saltKeys sync.Map

// saltKey is the extra key of a prompt's first block under salt, as an
// engine's BlockStored gives it (its extra_keys) and the decoder reads it;
// nil for no salt.
func saltKey(salt string) []byte {
	if salt == "" {
		return nil
	}
	if k, ok := saltKeys.Load(salt); ok {
		return k.([]byte)
	}
	payload, err := msgpack.Marshal([]any{0.0, []any{map[string]any{"type": "BlockStored", "block_hashes": []int{1},
		"token_ids": []int{0}, "block_size": 1, "extra_keys": []any{[]any{salt}}}}})
	if err != nil {
		panic(err)
	}
	b, err := kvevents.DecodeBatch(payload)
	if err != nil {
		panic(err)
	}
	k := b.Events[0].Extra[0]
	saltKeys.Store(salt, k)
	return k
}

// serve returns the cached prefix length in characters and caches the
// prompt, its tail first so that the head is the most recent. salted is the
// extra key of a salted prompt's first block (saltKey), nil for none: hs
// are hashed with the salt, and the events say it.
func (e *simCache) serve(prompt string, hs []uint64, salted []byte) int {
	hit := 0
	for hit < len(hs) && e.cache.has(hs[hit]) {
		hit++
	}
	var removed []uint64
	for i := len(hs) - 1; i >= 0; i-- {
		if h, evicted := e.cache.add(hs[i]); evicted {
			removed = append(removed, h)
		}
	}
	if e.events != nil && hit < len(hs) {
		stored := kvevents.Event{Kind: kvevents.Stored, Hashes: hs[hit:], Tokens: simTokens(prompt[hit*simBlock : len(hs)*simBlock]), BlockSize: simBlock / simCharsPerToken}
		if hit > 0 {
			stored.Parent, stored.HasParent = hs[hit-1], true
		} else if salted != nil {
			stored.Extra = make([][]byte, len(stored.Hashes))
			stored.Extra[0] = salted
		}
		e.events(stored, kvevents.Event{Kind: kvevents.Removed, Hashes: removed})
	}
	return hit * simBlock
}

// simTokens are a prompt's tokens as the simulated engines cache them: one
// per simCharsPerToken characters, so that a 64-character block is vLLM's
// 16 tokens.
func simTokens(s string) []int64 {
	out := make([]int64, (len(s)+simCharsPerToken-1)/simCharsPerToken)
	for i := range out {
		for _, c := range []byte(s[i*simCharsPerToken : min(len(s), (i+1)*simCharsPerToken)]) {
			out[i] = out[i]<<8 | int64(c)
		}
	}
	return out
}

const simCharsPerToken = 4

// ---- the event loop ----

type simEvent struct {
	at  time.Duration
	seq int
	fn  func()
}

type simQueue []simEvent

func (q simQueue) Len() int { return len(q) }
func (q simQueue) Less(i, j int) bool {
	return q[i].at < q[j].at || q[i].at == q[j].at && q[i].seq < q[j].seq
}
func (q simQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *simQueue) Push(x any)   { *q = append(*q, x.(simEvent)) }
func (q *simQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// simClock is a simulation's time: its events run in time order, those at
// the same time in the order they were set.
type simClock struct {
	now    time.Duration
	seq    int
	events simQueue
}

func (c *simClock) at(t time.Duration, fn func()) {
	c.seq++
	heap.Push(&c.events, simEvent{at: t, seq: c.seq, fn: fn})
}

// every runs fn at 0, then every d until it has run at or past until and no
// other event is left: the scrapes go on while the turns and retries set
// before until are still sent, as an engine's /metrics answers while it
// serves. A clock has one such ticker.
func (c *simClock) every(d, until time.Duration, fn func()) {
	var tick func()
	tick = func() {
		fn()
		if c.now < until || c.events.Len() > 0 {
			c.at(c.now+d, tick)
		}
	}
	c.at(0, tick)
}

// run runs the events, and those they set, until none is left.
func (c *simClock) run() {
	for c.events.Len() > 0 {
		e := heap.Pop(&c.events).(simEvent)
		c.now = e.at
		e.fn()
	}
}

// chat plays a chat session's turns as its client sends them: each with the
// whole history so far, the next after the answer and the turn's think time.
type chat struct {
	clock    *simClock
	sess     simSession
	until    time.Duration // no turn starts after it
	history  string        // as the engine caches it
	messages []simMessage  // as the client sends it
}

func newChat(clock *simClock, sess simSession, until time.Duration) *chat {
	return &chat{clock: clock, sess: sess, until: until, history: sess.system, messages: []simMessage{{"system", sess.system}}}
}

// ask is turn i, its prompt and its messages.
func (c *chat) ask(i int) (t simTurn, prompt string, asked []simMessage) {
	t = c.sess.turns[i]
	return t, c.history + "\nuser\n" + t.user, append(slices.Clip(c.messages), simMessage{"user", t.user})
}

// answered makes turn i, asked with prompt and asked, and its reply the
// history, and sends the next turn with send after the turn's think time.
func (c *chat) answered(i int, prompt string, asked []simMessage, send func(i int)) {
	t := c.sess.turns[i]
	c.history = prompt + "\nassistant\n" + t.reply
	c.messages = append(asked, simMessage{"assistant", t.reply})
	if i+1 < len(c.sess.turns) && c.clock.now < c.until {
		c.clock.at(c.clock.now+t.think, func() { send(i + 1) })
	}
}

type simReq struct {
	prompt  string   // as the engine caches it
	salt    string   // its cache_salt, which the engine keys its blocks with; "" for none
	req     *Request // as the router reads the client's body
	output  int
	arrived time.Duration
	ep      *Endpoint
	engine  *simEngine
	release func()
	done    func(ok bool)
	session int    // its conversation's number, for pinned replicas; 0 for none
	client  string // its client's address (simPolicy.byAddress), "" for none
	// batch: its objective may be shed (simParams.Batch); first is when its
	// client first sent it.
	batch bool
	first time.Duration
}

type sim struct {
	simClock
	p                   simParams
	engines             map[string]*simEngine
	pools               []*Pool // one per replica
	holds               []*Hold // each replica's, with simParams.HoldFor
	sent                int     // requests sent, for the replicas' turns
	chats               int     // conversations started, which numbers them
	tokens              bool    // requests carry their tokens (the policy follows KV events)
	blind               bool    // requests are read without their namespace (simPolicy.blind)
	pinned              bool    // a conversation's requests go to one replica (simPolicy.pinned)
	pinShare            float64 // of the conversations pinned (simPolicy.pinShare), 0 for all
	byAddress, oneCount bool    // simPolicy's

	ttfts          []time.Duration
	byClass        [2][]time.Duration // interactive, batch
	shed           int
	prompt, cached float64
	failed, moves  int
	seen           map[uint64]bool // every block any engine computed, for the ceiling
	ceiling        float64
}

var simEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func simulate(p simParams, w *workload, policy simPolicy, replicas int) simResult {
	s := &sim{p: p, engines: map[string]*simEngine{}, seen: map[uint64]bool{}}
	var addrs []string
	var index *kvevents.Index
	if policy.events {
		index = kvevents.NewIndex(kvevents.Bounds{}, time.Minute, func() time.Time { return simEpoch.Add(s.now) })
	}
	for i, speed := range p.Speeds {
		a := fmt.Sprintf("10.0.0.%d:8000", i+1)
		addrs = append(addrs, a)
		e := &simEngine{speed: speed, simCache: simCache{cache: newSimLRU(p.CacheChars / simBlock)}}
		e.start = func(r *simReq) { s.prefill(e, r) }
		if index != nil {
			pub := kvevents.Publisher{Endpoint: a}
			index.Reset(pub, true)
			e.events = func(events ...kvevents.Event) { index.Apply(pub, events) }
		}
		s.engines[a] = e
	}
	s.tokens, s.blind, s.pinned, s.pinShare = index != nil, policy.blind, policy.pinned, policy.pinShare
	s.byAddress, s.oneCount = policy.byAddress, policy.oneCount
	spec := PoolSpec{Endpoints: addrs, PoolScheduling: config.PoolScheduling{
		Policy:  policy.config,
		Prefix:  policy.prefix,
		Metrics: config.EngineMetrics{Interval: config.Duration(p.ScrapeEvery)},
	}}
	for i := range replicas {
		r := rand.New(rand.NewPCG(p.Seed, 2+uint64(i)))
		pool := poolOf(roleUnknown, spec, Deps{Now: func() time.Time { return simEpoch.Add(s.now) }, intn: r.IntN})
		if policy.picker != nil {
			st := *pool.state.Load()
			st.picker = policy.picker(spec.PoolScheduling, r.IntN)
			pool.state.Store(&st)
		}
		if index != nil {
			pool.events.Store(&poolEvents{index: index})
		}
		s.pools, s.holds = append(s.pools, pool), append(s.holds, holdAt(pool, p.shedLines(), p.HoldFor))
	}

	failing := s.engines[addrs[p.FailEndpoint]]
	s.at(time.Duration(p.FailFrom*float64(p.Duration)), func() { failing.down = true })
	s.at(time.Duration(p.FailTo*float64(p.Duration)), func() {
		failing.down = false
		failing.cache = newSimLRU(p.CacheChars / simBlock) // a restarted engine has a cold cache, and counts anew
		failing.computed, failing.prefilling = 0, 0
		if failing.events != nil {
			failing.events(kvevents.Event{Kind: kvevents.Cleared})
		}
	})
	s.every(p.ScrapeEvery, p.scrapedUntil(), func() {
		for _, pool := range s.pools {
			for _, e := range pool.Endpoints() {
				eng := s.engines[e.Addr]
				if eng.down { // its /metrics refuses connections too
					e.scrapeFailed(scrapeTimeout)
					continue
				}
				size, written := eng.cache.counters(p.CacheChars)
				e.observe(Load{Waiting: float64(len(eng.queue)), Running: float64(eng.running + busy(eng.busy)),
					KVUsage: min(1, float64(eng.running)/128), At: simEpoch.Add(s.now), CacheTokens: size, Written: written,
					Computed: eng.computed, Prefilling: eng.prefilling})
			}
		}
		for _, h := range s.holds {
			h.Release()
		}
	})
	for _, sess := range w.sessions {
		s.at(sess.started, func() { s.converse(sess) })
	}
	s.run()

	var speed float64
	for _, v := range p.Speeds {
		speed += v
	}
	res := simResult{Policy: policy.name, Replicas: replicas, Requests: len(s.ttfts) + s.failed, Failed: s.failed, Moves: s.moves,
		HitRate: s.cached / s.prompt, Ceiling: s.ceiling / s.prompt, Offered: s.prompt / p.Duration.Seconds() / (p.PrefillCPS * speed)}
	all := ttftOf(s.ttfts)
	res.MeanTTFT, res.P99TTFT = all.Mean, all.P99
	res.Shed, res.Interactive, res.BatchTTFT = s.shed, ttftOf(s.byClass[0]), ttftOf(s.byClass[1])
	return res
}

// converse sends a session's turns, each after the answer to the one before
// and its think time, the whole history each time; a failed turn is retried
// after a second, as a client would.
func (s *sim) converse(sess simSession) {
	if sess.completions {
		t := sess.turns[0]
		prompt := sess.system + t.user
		first := s.now
		var send func()
		send = func() {
			s.send(&simReq{prompt: prompt, req: promptRequest(prompt), output: t.output, arrived: s.now, batch: s.p.Batch, first: first, done: func(ok bool) {
				if !ok {
					s.at(s.now+time.Second, send)
				}
			}})
		}
		send()
		return
	}
	c, served := newChat(&s.simClock, sess, s.p.Duration), ""
	s.chats++
	id := s.chats
	if s.pinShare > 0 && float64(mix64(uint64(id)^0x5e55)>>11)/(1<<53) >= s.pinShare {
		id = 0 // its client names no session
	}
	var turn func(i int)
	turn = func(i int) {
		t, prompt, asked := c.ask(i)
		r := &simReq{prompt: prompt, req: chatRequest(asked), output: t.output, arrived: s.now, first: s.now}
		switch {
		case s.byAddress && id != 0:
			r.client = fmt.Sprint("client-", id%simClients)
		case s.byAddress:
			r.client = fmt.Sprint("pod-", s.sent%simPods)
		default:
			r.session, r.req.Session = id, s.pinned && id != 0
		}
		if r.salt = sess.salt; r.salt != "" && !s.blind { // as API.PromptOf reads them
			r.req.prompt.Cache = kvevents.Keys{Model: "m", Salt: sess.salt}
		}
		r.done = func(ok bool) {
			if !ok {
				s.at(s.now+time.Second, func() { turn(i) })
				return
			}
			if served != "" && served != r.ep.Addr {
				s.moves++
			}
			served = r.ep.Addr
			c.answered(i, prompt, asked, turn)
		}
		s.send(r)
	}
	turn(0)
}

func (s *sim) send(r *simReq) {
	replica := s.sent % len(s.pools)
	s.sent++
	if s.pinned && r.session != 0 {
		replica = int(mix64(uint64(r.session)) % uint64(len(s.pools)))
	}
	if r.client != "" {
		replica = int(mix64(xxhash.Sum64String(r.client)) % uint64(len(s.pools)))
		if !s.oneCount {
			r.req.Client = r.client
		}
	}
	pool := s.pools[replica]
	if s.tokens && r.req.Tokens() == nil {
		r.req.SetTokens(simTokens(r.prompt))
	}
	// Past scrapedUntil nothing is shed: what is still sent then is served.
	if !s.p.Shed || !r.batch || s.now >= s.p.scrapedUntil() {
		s.dispatch(pool, r)
		return
	}
	refuse := func() {
		s.shed++
		// done(false) sends it again after a second, as after a failure.
		s.at(s.now+s.p.shedWait()-time.Second, func() { r.done(false) })
	}
	switch {
	case s.p.HoldFor > 0:
		if !s.holds[replica].Add(r.req, -1, "", simEpoch.Add(s.now+s.p.HoldFor), func(released bool) {
			if released {
				s.dispatch(pool, r)
			} else {
				refuse()
			}
		}) {
			s.dispatch(pool, r)
		}
	case pool.Saturated(r.req, s.p.shedLines()):
		refuse()
	default:
		s.dispatch(pool, r)
	}
}

// dispatch sends r to the endpoint pool picks for it.
func (s *sim) dispatch(pool *Pool, r *simReq) {
	ep, err := pool.Select(r.req)
	if err != nil {
		s.failed++
		r.done(false)
		return
	}
	r.ep, r.engine, r.release = ep, s.engines[ep.Addr], acquire(ep)
	if r.engine.down { // connection refused
		s.failed++
		ep.ReportFailure()
		r.release()
		r.done(false)
		return
	}
	r.engine.add(r)
}

// prefill computes r's prompt on e, then decodes it.
func (s *sim) prefill(e *simEngine, r *simReq) {
	var salted uint64 // the engine's chain starts from the salt
	if r.salt != "" {
		salted = xxhash.Sum64String(r.salt)
	}
	hs := simIndex.hashes(salted, r.prompt)
	hit := e.serve(r.prompt, hs, saltKey(r.salt))
	n := float64(len(r.prompt))
	for i, h := range hs {
		if !s.seen[h] {
			s.ceiling += float64(i * simBlock)
			for _, h := range hs[i:] {
				s.seen[h] = true
			}
			break
		}
		if i == len(hs)-1 {
			s.ceiling += float64(len(hs) * simBlock)
		}
	}
	s.prompt += n
	s.cached += float64(hit)
	d := s.p.PrefillFixed + secs((n-float64(hit))/(s.p.PrefillCPS*e.speed))
	s.at(s.now+d, func() {
		s.ttfts = append(s.ttfts, s.now-r.arrived)
		class := 0
		if r.batch {
			class = 1
		}
		s.byClass[class] = append(s.byClass[class], s.now-r.first)
		e.running++
		// Decoding slows as the batch grows; it does not hold up prefill.
		tpot := time.Duration(float64(s.p.TPOT) * (1 + float64(e.running)/64) / e.speed)
		s.at(s.now+time.Duration(r.output)*tpot, func() {
			e.running--
			e.computed += (n - float64(hit)) / simCharsPerToken
			e.prefilling += d.Seconds()
			r.ep.ReportSuccess()
			r.release()
			r.done(true)
		})
		e.done()
	})
}

func busy(b bool) int {
	if b {
		return 1
	}
	return 0
}
