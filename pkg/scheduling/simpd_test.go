package scheduling

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// A discrete-event simulation of prefill/decode disaggregation, on the
// simulated clock of sim_test.go and with its workloads, engine caches and
// event queue. A prefill pool and a decode pool of engines (or, for the
// aggregated baseline, one pool of them all) sit behind replicas of the
// real router: its Pools pick the decode endpoint, its Decider chooses P/D
// or decode-only on it, and for P/D its prefill pool picks the prefill
// endpoint. Only time, randomness and /metrics scrapes are simulated.
//
//   - A prefill engine computes one prompt at a time, FIFO: PrefillFixed plus
//     the characters its own prefix cache lacks at PrefillCPS × speed.
//   - The KV of the prompt's blocks its decode engine lacks then travels at
//     TransferCPS, concurrently with everything; the decode engine holds
//     them after.
//   - A decode engine runs steps back to back while it has work: a step lasts
//     the longer of TPOT × (1 + batch/64) (memory-bound decoding) and the
//     compute of its tokens, the batch's and the local prefill it takes that
//     step (vLLM's chunked prefill: at most ChunkChars, less the batch's
//     decode tokens), at PrefillCPS. Every running request emits a token a
//     step; a local prefill (decode-only) longer than the step's spare
//     compute delays all of them.

type pdParams struct {
	simParams               // Speeds are unused: every engine is at speed 1
	Prefill, Decode int     // engines per pool; the aggregated baseline has both as one pool
	TransferCPS     float64 // characters of KV per second, prefill engine to decode engine
	ChunkChars      int     // an aggregated engine's step budget (max_num_batched_tokens × 4)
	// DecodeChunkChars is a P/D decode engine's: small, so that a local
	// prefill rides along the memory-bound decode steps (docs/scheduling.md).
	DecodeChunkChars int
	CacheReplies     bool // the decode engine also caches the reply it generated, as vLLM does
}

// The P/D model's constants (see pdRates for the calibration of load).
const (
	// 25 GB/s of RDMA at ~100 KB of KV per token (an 8B model in bf16):
	// 250,000 tokens/s, 4 characters each.
	pdTransferCPS = 1_000_000
	// vLLM's max_num_batched_tokens of 2,048 tokens, and a decode engine's
	// of 256; the batch's decode tokens count against it, as vLLM's scheduler
	// spends the budget on its running requests first.
	pdChunkChars       = 8_192
	pdDecodeChunkChars = 1_024
	pdCharsPerToken    = 4
)

func defaultPDParams() pdParams {
	return pdParams{simParams: defaultSimParams(), Prefill: 4, Decode: 4, TransferCPS: pdTransferCPS,
		ChunkChars: pdChunkChars, DecodeChunkChars: pdDecodeChunkChars, CacheReplies: true}
}

// pdPolicy is a P/D configuration, or the aggregated baseline: every engine
// in one pool, each prefilling its own requests.
type pdPolicy struct {
	name             string
	aggregated       bool
	pd               config.PD
	decodeChunkChars int  // the decode engines' step budget; 0: pdParams'
	events           bool // both pools follow the engines' KV events (sim_test.go's model)
	pinned           bool // a conversation's requests go to one replica (simPolicy.pinned)
}

type pdEngine struct {
	simCache       // and its events when the pools follow them
	chunkChars int // its step's token budget, in characters
	prefiller[*pdReq]
	// decode
	stepping bool
	pending  []*pdReq // decode-only, their prompt still to compute locally
	joining  []*pdReq // KV arrived, to join at the next step
	running  []*pdReq // emitting a token a step
	inbound  int      // KV transfers under way
}

// waiting is the engine's scraped queue: vLLM's num_requests_waiting, which
// counts requests waiting for remote KV and those not yet scheduled.
func (e *pdEngine) waiting() float64 {
	n := len(e.queue) + e.inbound + len(e.joining)
	for _, r := range e.pending {
		if !r.started {
			n++
		}
	}
	return float64(n)
}

type pdReq struct {
	session, turn int
	prompt        string
	after         string // what the engine's sequence is once the reply is generated ("": no later turn reads it)
	hs            []uint64
	req           *Request
	output        int
	arrived       time.Duration
	split         Split
	decode        *Endpoint
	dEng, pEng    *pdEngine
	release       func() // the decode endpoint's
	answered      func() // the prefill leg's answer: its endpoint's report and release
	emitted, left int    // tokens emitted; local prefill characters left
	started       bool   // local prefill begun
	done          func()
	// batch: its objective may be shed (simParams.Batch); first is when its
	// client first sent it.
	batch bool
	first time.Duration
}

type pdStep struct {
	d time.Duration
	n int // inter-token gaps of this duration
}

type pdSim struct {
	simClock
	p        pdParams
	engines  map[string]*pdEngine
	replicas []*Pools
	holds    [][2]*Hold // each replica's decode and prefill holds, with simParams.HoldFor
	sent     int
	pinned   bool // pdPolicy.pinned

	ttfts              []time.Duration
	byClass            [2][]time.Duration // interactive, batch (simParams.Batch)
	shed               int
	steps              []pdStep
	prefillWork, local time.Duration // compute on prefill engines; local prefill compute on decode engines
	decisions          map[[2]int]bool
	pd                 int
	heldEst, heldReal  float64 // cached_prefix requests: tokens estimated held, and held
	unseen             int     // requests whose decode engine held most of the prompt, estimated to hold none
	reasons            map[metrics.Reason]int
}

// pdResult is one run of a policy.
type pdResult struct {
	Requests                  int
	DecodeOnly                float64 // share of requests
	MeanTTFT, P99TTFT, P99ITL time.Duration
	MeanITL                   time.Duration
	PrefillWork, LocalWork    time.Duration
	PrefillUtil               float64
	HeldRatio                 float64 // cached_prefix: tokens the engine held over those estimated
	Unseen                    float64 // share of requests whose decode engine held most of the prompt, estimated none
	Cached, PrefillBusy       float64 // shares of requests decided cached_prefix and prefill_busy (decode-only)
	DecodeBusy                float64 // and decode_busy (P/D)
	Decisions                 map[[2]int]bool
	// Shed, Interactive and BatchTTFT are as simResult's.
	Shed                   int
	Interactive, BatchTTFT simTTFT
}

func simulatePD(p pdParams, w *workload, policy pdPolicy, replicas int) pdResult {
	s := &pdSim{p: p, engines: map[string]*pdEngine{}, decisions: map[[2]int]bool{}, reasons: map[metrics.Reason]int{}, pinned: policy.pinned}
	var index *kvevents.Index
	if policy.events {
		index = kvevents.NewIndex(kvevents.Bounds{}, time.Minute, func() time.Time { return simEpoch.Add(s.now) })
	}
	addrs := func(subnet, n, chunk int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("10.0.%d.%d:8000", subnet, i+1)
			e := &pdEngine{simCache: simCache{cache: newSimLRU(p.CacheChars / simBlock)}, chunkChars: chunk}
			e.start = func(r *pdReq) { s.prefill(e, r) }
			if index != nil {
				pub := kvevents.Publisher{Endpoint: out[i]}
				index.Reset(pub, true)
				e.events = func(events ...kvevents.Event) { index.Apply(pub, events) }
			}
			s.engines[out[i]] = e
		}
		return out
	}
	pool := func(eps []string) PoolSpec {
		ps := PoolSpec{Endpoints: eps, PoolScheduling: config.PoolScheduling{Policy: config.PolicyPrefixAffinity,
			Metrics: config.EngineMetrics{Interval: config.Duration(p.ScrapeEvery)}}}
		if index != nil {
			// Configured as following events, for the defaults; the index is
			// fed above, as no subscriber runs (Pools.Run is not called).
			ps.KVEvents.ConnectPort = 5557
		}
		return ps
	}
	spec := Spec{PD: policy.pd}
	if policy.aggregated {
		spec.Decode, spec.PD = pool(addrs(0, p.Prefill+p.Decode, p.ChunkChars)), config.PD{Mode: config.PDNever}
	} else {
		decodeChunk := cmp.Or(policy.decodeChunkChars, p.DecodeChunkChars)
		spec.Prefill, spec.Decode = pool(addrs(1, p.Prefill, p.ChunkChars)), pool(addrs(0, p.Decode, decodeChunk))
	}
	spec.Decode.SetDecodeDefaults(spec.PD.Mode) // as pkg/config sets them
	for i := range replicas {
		r := rand.New(rand.NewPCG(p.Seed, 2+uint64(i)))
		ps := NewPools(spec, Deps{Now: func() time.Time { return simEpoch.Add(s.now) }, intn: r.IntN})
		if index != nil {
			ps.Prefill.events.Store(&poolEvents{index: index})
			ps.Decode.events.Store(&poolEvents{index: index})
		}
		s.replicas, s.holds = append(s.replicas, ps), append(s.holds, [2]*Hold{holdAt(ps.Decode, p.shedLines(), p.HoldFor), holdAt(ps.Prefill, p.shedLines(), p.HoldFor)})
	}
	s.every(p.ScrapeEvery, p.scrapedUntil(), func() {
		for _, ps := range s.replicas {
			for _, e := range slices.Concat(ps.Prefill.Endpoints(), ps.Decode.Endpoints()) {
				eng := s.engines[e.Addr]
				size, written := eng.cache.counters(p.CacheChars)
				e.observe(Load{Waiting: eng.waiting(), Running: float64(len(eng.running) + busy(eng.busy)),
					KVUsage: min(1, float64(len(eng.running))/128), At: simEpoch.Add(s.now), CacheTokens: size, Written: written})
			}
		}
		for _, h := range s.holds {
			h[0].Release()
			h[1].Release()
		}
	})
	for i, sess := range w.sessions {
		s.at(sess.started, func() { s.converse(i, sess) })
	}
	s.run()
	return s.result()
}

// converse sends a session's turns as sim.converse does, each after the
// answer to the one before and its think time.
func (s *pdSim) converse(i int, sess simSession) {
	if sess.completions {
		prompt := sess.system + sess.turns[0].user
		s.send(&pdReq{session: i, prompt: prompt, req: promptRequest(prompt), output: sess.turns[0].output, done: func() {},
			batch: s.p.Batch, first: s.now})
		return
	}
	c := newChat(&s.simClock, sess, s.p.Duration)
	var turn func(j int)
	turn = func(j int) {
		t, prompt, asked := c.ask(j)
		r := &pdReq{session: i, turn: j, prompt: prompt, req: chatRequest(asked), output: t.output, first: s.now}
		if s.p.CacheReplies {
			r.after = prompt + "\nassistant\n" + t.reply
		}
		r.done = func() { c.answered(j, prompt, asked, turn) }
		s.send(r)
	}
	turn(0)
}

// send routes r as the pipeline does: the decode endpoint first, then the
// decision on it, then for P/D the prefill endpoint. Batch work that meets
// a saturated pool is refused, and sent again after the Retry-After, after
// the decision; or, with simParams.HoldFor, held before the decode pick
// on the decode pool and after the decision on the prefill pool, as
// pkg/pipeline holds it.
func (s *pdSim) send(r *pdReq) {
	replica := s.sent % len(s.replicas)
	s.sent++
	if s.pinned && r.req.Head() != "" { // a chat request: its conversation's replica
		replica = int(mix64(uint64(r.session)+1) % uint64(len(s.replicas)))
	}
	r.arrived, r.hs = s.now, simHashes(r.prompt)
	if s.replicas[replica].Decode.cache() != nil {
		r.req.SetTokens(simTokens(r.prompt))
	}
	if !s.sheds(r) || s.p.HoldFor == 0 || !s.hold(s.holds[replica][0], r, func() { s.route(replica, r) }) {
		s.route(replica, r)
	}
}

// sheds says whether r is batch work that a saturated pool puts off.
func (s *pdSim) sheds(r *pdReq) bool { return s.p.Shed && r.batch && s.now < s.p.scrapedUntil() }

// hold holds r in h, unless it may go at once (false); released, it goes on
// with next; its time up, it is refused.
func (s *pdSim) hold(h *Hold, r *pdReq, next func()) bool {
	return h.Add(r.req, -1, "", simEpoch.Add(s.now+s.p.HoldFor), func(released bool) {
		if released {
			next()
			return
		}
		if r.release != nil { // the decode endpoint picked before the prefill pool held it
			r.release()
			r.release = nil
		}
		s.shed++
		s.at(s.now+s.p.shedWait(), func() { s.send(r) })
	})
}

// route picks r's decode endpoint and decides on it.
func (s *pdSim) route(replica int, r *pdReq) {
	ps := s.replicas[replica]
	eps, err := ps.Decode.SelectN(r.req, 1)
	if err != nil {
		panic(err)
	}
	r.decode, r.dEng, r.release = eps[0], s.engines[eps[0].Addr], acquire(eps[0])
	r.split = ps.Decide(r.req, r.decode)
	switch {
	case !s.sheds(r):
	case s.p.HoldFor > 0:
		if r.split.PD && s.hold(s.holds[replica][1], r, func() { s.legs(ps, r) }) {
			return
		}
	case ps.Decode.Saturated(r.req, s.p.shedLines()) || r.split.PD && ps.Prefill.Saturated(r.req, s.p.shedLines()):
		s.shed++
		r.release()
		s.at(s.now+s.p.shedWait(), func() { s.send(r) })
		return
	}
	s.legs(ps, r)
}

// legs runs r decode-only or launches its prefill leg.
func (s *pdSim) legs(ps *Pools, r *pdReq) {
	if held := heldBlocks(r.dEng.cache, r.hs); r.req.Held(r.decode) == 0 && 2*held*simBlock > len(r.prompt) {
		s.unseen++
	}
	s.decisions[[2]int{r.session, r.turn}] = r.split.PD
	s.reasons[r.split.Reason]++
	if !r.split.PD {
		r.dEng.pending = append(r.dEng.pending, r)
		s.kick(r.dEng)
		return
	}
	s.pd++
	pe, err := ps.Prefill.Select(r.req)
	if err != nil {
		panic(err)
	}
	release := acquire(pe)
	r.pEng, r.answered = s.engines[pe.Addr], func() { pe.ReportSuccess(); release() }
	r.pEng.add(r)
}

// prefill computes r's prompt on the prefill engine e, which answers, then
// the decode engine pulls the KV.
func (s *pdSim) prefill(e *pdEngine, r *pdReq) {
	hit := e.serve(r.prompt, r.hs, nil)
	d := s.p.PrefillFixed + secs(float64(len(r.prompt)-hit)/s.p.PrefillCPS)
	s.prefillWork += d
	s.at(s.now+d, func() {
		r.answered()
		// The decode engine pulls the blocks it lacks.
		r.dEng.inbound++
		s.at(s.now+secs(float64(len(r.prompt)-heldBlocks(r.dEng.cache, r.hs)*simBlock)/s.p.TransferCPS), func() {
			r.dEng.inbound--
			r.dEng.serve(r.prompt, r.hs, nil)
			r.dEng.joining = append(r.dEng.joining, r)
			s.kick(r.dEng)
		})
		e.done()
	})
}

// heldBlocks is how many leading blocks of hs cache holds.
func heldBlocks(cache *simLRU, hs []uint64) int {
	n := 0
	for n < len(hs) && cache.has(hs[n]) {
		n++
	}
	return n
}

// kick starts a step unless one is under way or there is nothing to do.
func (s *pdSim) kick(e *pdEngine) {
	if !e.stepping && len(e.running)+len(e.joining)+len(e.pending) > 0 {
		s.step(e)
	}
}

func (s *pdSim) step(e *pdEngine) {
	e.stepping = true
	running, joining := e.running, e.joining
	e.joining = nil
	batch := len(running) + len(joining)
	budget, chunk := e.chunkChars-pdCharsPerToken*batch, 0
	var prefilled []*pdReq
	for _, r := range e.pending {
		if budget <= 0 {
			break
		}
		if !r.started {
			r.started = true
			hit := e.serve(r.prompt, r.hs, nil)
			r.left = max(len(r.prompt)-hit, pdCharsPerToken) // the last token is always computed
			if r.split.Reason == metrics.ReasonCachedPrefix {
				s.heldEst += float64(r.split.Held)
				s.heldReal += float64(hit / pdCharsPerToken)
				r.decode.ReportCached(r.split.Held, hit/pdCharsPerToken, true)
			}
		}
		take := min(r.left, budget)
		r.left, budget, chunk = r.left-take, budget-take, chunk+take
		if r.left == 0 {
			prefilled = append(prefilled, r)
		}
	}
	e.pending = e.pending[len(prefilled):]
	local := secs(float64(chunk) / s.p.PrefillCPS)
	s.local += local
	// A step is bound by memory (reading the weights and the batch's KV:
	// TPOT, growing with the batch) or by compute (the batch's tokens and
	// the prefill chunk), whichever is longer: a small chunk rides along
	// nearly free, a large one lengthens the step for every running request.
	d := max(time.Duration(float64(s.p.TPOT)*(1+float64(batch)/64)), secs(float64(chunk+pdCharsPerToken*batch)/s.p.PrefillCPS))
	s.at(s.now+d, func() {
		if len(running) > 0 {
			s.steps = append(s.steps, pdStep{d, len(running)})
		}
		e.running = e.running[:0:0]
		for _, r := range running {
			s.emit(e, r)
		}
		for _, r := range slices.Concat(joining, prefilled) {
			s.ttfts = append(s.ttfts, s.now-r.arrived)
			class := 0
			if r.batch {
				class = 1
			}
			s.byClass[class] = append(s.byClass[class], s.now-r.first)
			s.emit(e, r)
		}
		e.stepping = false
		s.kick(e)
	})
}

// emit counts a token of r, which then runs on or finishes.
func (s *pdSim) emit(e *pdEngine, r *pdReq) {
	if r.emitted++; r.emitted < r.output {
		e.running = append(e.running, r)
		return
	}
	if r.after != "" {
		e.serve(r.after, simHashes(r.after), nil)
	}
	r.decode.ReportSuccess()
	r.release()
	r.done()
}
