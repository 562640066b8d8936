package scheduling

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"
)

// The simulation's workloads. Each is a fixed-seed list of sessions: a
// session is one request (a one-shot question) or a conversation's turns,
// sent as chat messages or as a completions prompt. Rates are per second at
// nominal load; simParams.Load multiplies them.

type simWorkload struct {
	name     string
	generate func(r *rand.Rand, w *workload, end, load float64)
}

// The five workloads of docs/scheduling.md's tables.
var (
	// (a) One-shot questions, each under one of 48 tenants' system prompts
	// (Zipf-popular, 2,000-32,000 characters, three in four shorter than
	// the default 16 KiB key): agents, RAG templates, few-shot prompts.
	oneShot = simWorkload{"a one-shot", func(r *rand.Rand, w *workload, end, load float64) {
		w.questions(r, end, 11*load, w.tenants(r, simTenants, 2_000, 32_000))
	}}
	// (b) Multi-turn chat under 8 system prompts of 2,000-8,000 characters,
	// beside unrelated completions prompts: the workload the simulation
	// first modelled.
	multiTurn = simWorkload{"b multi-turn", func(r *rand.Rand, w *workload, end, load float64) {
		w.conversations(r, end, 2.6*load, w.tenants(r, 8, 2_000, 8_000))
		w.randoms(r, end, 2.5*load)
	}}
	// (c) (a) and (b) at half their rates each.
	mixed = simWorkload{"c mixed", func(r *rand.Rand, w *workload, end, load float64) {
		w.questions(r, end, 5.5*load, w.tenants(r, simTenants, 2_000, 32_000))
		w.conversations(r, end, 1.3*load, w.tenants(r, 8, 2_000, 8_000))
		w.randoms(r, end, 1.25*load)
	}}
	// (d) One 40,000-character document, longer than the key, and a
	// different question each time, as completions prompts.
	document = simWorkload{"d document", func(r *rand.Rand, w *workload, end, load float64) {
		doc := text(r, 40_000)
		for t := range arrivals(r, end, 4*load) {
			w.sessions = append(w.sessions, simSession{started: t, completions: true, system: doc + "\nQuestion: ",
				turns: []simTurn{question(r)}})
		}
	}}
	// (e) Unrelated completions prompts: nothing to share.
	random = simWorkload{"e random", func(r *rand.Rand, w *workload, end, load float64) {
		w.randoms(r, end, 20*load)
	}}
	simWorkloads = []simWorkload{oneShot, multiTurn, mixed, document, random}

	// (g) Agent sessions: conversations under 4 agents' preambles (tools
	// and system prompt) of 24,000-40,000 characters, longer than the
	// default 16 KiB key, beside unrelated completions prompts. Not in the
	// tables' workloads: docs/scheduling.md's agents table.
	agents = simWorkload{"g agents", func(r *rand.Rand, w *workload, end, load float64) {
		w.conversations(r, end, load, w.tenants(r, 4, 24_000, 40_000))
		w.randoms(r, end, load)
	}}
	// (f) One-shot questions under 8 agents' system prompts (2,000-16,000
	// characters), each from one of 24 tenants that isolate their caches
	// with a cache_salt (agents and tenants Zipf-popular): the same system
	// prompt under another tenant's salt shares no cache. Not in the
	// tables' workloads: docs/scheduling.md's namespaces table.
	salted = simWorkload{"f salted", func(r *rand.Rand, w *workload, end, load float64) {
		agents := w.tenants(r, 8, 2_000, 16_000)
		for t := range arrivals(r, end, 11*load) {
			w.sessions = append(w.sessions, simSession{started: t, system: agents[zipf(r, len(agents))],
				salt: fmt.Sprint("tenant-", zipf(r, 24)), turns: []simTurn{question(r)}})
		}
	}}
)

const simTenants = 48

type workload struct {
	sessions []simSession
	systems  int // summed length of the distinct system prompts
}

type simSession struct {
	started     time.Duration
	system      string // the system prompt, or a completions prompt's shared start
	completions bool   // sent as one completions prompt: system, then the turn's user text
	salt        string // the cache_salt its chat requests carry, "" for none
	turns       []simTurn
}

type simTurn struct {
	user, reply string
	output      int // tokens
	think       time.Duration
}

func newWorkload(p simParams) *workload {
	r := rand.New(rand.NewPCG(p.Seed, 1))
	w := &workload{}
	p.Workload.generate(r, w, p.Duration.Seconds(), p.Load)
	slices.SortStableFunc(w.sessions, func(a, b simSession) int { return int(a.started - b.started) })
	return w
}

// tenants returns n system prompts of lengths log-uniform in [lo, hi).
func (w *workload) tenants(r *rand.Rand, n, lo, hi int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = text(r, int(float64(lo)*math.Pow(float64(hi)/float64(lo), r.Float64())))
		w.systems += len(out[i])
	}
	return out
}

// questions: one-shot chat requests under Zipf-popular system prompts.
func (w *workload) questions(r *rand.Rand, end, rate float64, systems []string) {
	for t := range arrivals(r, end, rate) {
		w.sessions = append(w.sessions, simSession{started: t, system: systems[zipf(r, len(systems))], turns: []simTurn{question(r)}})
	}
}

// conversations: chat sessions of 3-10 turns under Zipf-popular system
// prompts, each turn a 200-2,000 character question and a 50-400 token
// reply, with 1 s + Exp(4 s) to think between turns.
func (w *workload) conversations(r *rand.Rand, end, rate float64, systems []string) {
	for t := range arrivals(r, end, rate) {
		s := simSession{started: t, system: systems[zipf(r, len(systems))]}
		for range 3 + r.IntN(8) {
			out := 50 + r.IntN(350)
			s.turns = append(s.turns, simTurn{
				user: text(r, 200+r.IntN(1800)), reply: text(r, 4*out), output: out,
				think: secs(1 + 4*r.ExpFloat64()),
			})
		}
		w.sessions = append(w.sessions, s)
	}
}

// randoms: unrelated completions prompts of 500-12,000 characters.
func (w *workload) randoms(r *rand.Rand, end, rate float64) {
	for t := range arrivals(r, end, rate) {
		w.sessions = append(w.sessions, simSession{started: t, completions: true,
			turns: []simTurn{{user: text(r, 500+r.IntN(11500)), output: 50 + r.IntN(350)}}})
	}
}

// question is a one-shot question of 100-1,500 characters.
func question(r *rand.Rand) simTurn {
	return simTurn{user: text(r, 100+r.IntN(1400)), output: 50 + r.IntN(350)}
}

// arrivals yields the times of a Poisson process of rate per second until end.
func arrivals(r *rand.Rand, end, rate float64) func(yield func(time.Duration) bool) {
	return func(yield func(time.Duration) bool) {
		for t := r.ExpFloat64() / rate; t < end; t += r.ExpFloat64() / rate {
			if !yield(secs(t)) {
				return
			}
		}
	}
}

func text(r *rand.Rand, n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyz      "
	b := make([]byte, n)
	for i := range b {
		b[i] = letters[r.IntN(len(letters))]
	}
	return string(b)
}

// zipf picks 0..n-1 with weight 1/(i+1): a few are hot.
func zipf(r *rand.Rand, n int) int {
	var total float64
	for i := range n {
		total += 1 / float64(i+1)
	}
	x := r.Float64() * total
	for i := range n {
		if x -= 1 / float64(i+1); x < 0 {
			return i
		}
	}
	return n - 1
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
