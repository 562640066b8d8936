package scheduling

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// loaded returns endpoints with the given requests in flight.
func loaded(inflight ...int) []*Endpoint {
	eps := make([]*Endpoint, len(inflight))
	for i, n := range inflight {
		eps[i] = &Endpoint{Addr: string(rune('a' + i))}
		for range n {
			acquire(eps[i])
		}
	}
	return eps
}

// Busyness is the requests in flight, plus a fresh scrape's queue and KV
// use, or without one the mean of the fresh ones.
func TestBusynessAddsAFreshScrape(t *testing.T) {
	p, clock := testPool(t, config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, "a", "b", "c")
	eps := p.Endpoints()
	acquire(eps[0])
	acquire(eps[0])
	eps[0].observe(Load{Waiting: 1, At: clock.Now()})
	eps[1].observe(Load{Waiting: 3, KVUsage: 0.5, At: clock.Now()})
	eps[2].observe(Load{Waiting: 9, At: clock.Now().Add(-time.Hour)}) // stale: the mean's

	var got []float64
	for _, r := range busyness(eps) {
		got = append(got, r.busy)
	}
	if want := []float64{3, 3.5, 2.25}; !slices.Equal(got, want) {
		t.Fatalf("busyness = %v, want %v", got, want)
	}
}

func TestTwoChoices(t *testing.T) {
	tests := []struct {
		name     string
		inflight []int
		draws    []int // successive intn results
		want     string
	}{
		{"single candidate", []int{5}, nil, "a"},
		{"the less loaded of the pair", []int{4, 1, 0}, []int{0, 0}, "b"},  // pair a, b
		{"the third is not in the pair", []int{4, 1, 0}, []int{1, 0}, "b"}, // pair b, a
		{"second draw skips the first", []int{4, 1, 0}, []int{1, 1}, "c"},  // pair b, c
		{"a tie keeps the first drawn", []int{2, 2, 2}, []int{2, 0}, "c"},  // pair c, a
		{"the busiest is never chosen", []int{9, 1, 1}, []int{0, 1}, "c"},  // pair a, c
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			draws := slices.Clone(tt.draws)
			p := &twoChoices{intn: func(int) int { d := draws[0]; draws = draws[1:]; return d }}
			if got := p.Pick(nil, loaded(tt.inflight...)); got.Addr != tt.want {
				t.Fatalf("Pick() = %s, want %s", got.Addr, tt.want)
			}
		})
	}
}

func TestRoundRobinTakesTurns(t *testing.T) {
	eps := loaded(5, 0, 0)
	p := &roundRobin{}
	var got []string
	for range 4 {
		got = append(got, p.Pick(nil, eps).Addr)
	}
	got = append(got, p.Pick(nil, eps[1:]).Addr) // candidates shrink: still one of them
	if want := []string{"a", "b", "c", "a", "b"}; !slices.Equal(got, want) {
		t.Fatalf("picks = %v, want %v", got, want)
	}
}

// BenchmarkSelect is the cost of one pick on a pool of 16 endpoints, for the
// ext_proc's own latency budget.
func BenchmarkSelect(b *testing.B) {
	addrs := benchAddrs(16)
	requests := []struct {
		name string
		req  *Request
	}{
		{"1000chars", promptRequest(benchText(1_000))},
		{"32000chars", promptRequest(benchText(32_000))},
		{"chat-32000chars", chatRequest(benchConversation())},
	}
	for _, policy := range []string{config.PolicyRoundRobin, config.PolicyLeastLoad, config.PolicyPrefixAffinity} {
		for _, r := range requests {
			b.Run(policy+"/"+r.name, func(b *testing.B) {
				p := NewPools(Spec{Decode: PoolSpec{Endpoints: addrs, PoolScheduling: config.PoolScheduling{Policy: policy}}}, Deps{}).Decode
				benchPick(b, p, r.req, "")
			})
		}
	}
	b.Run(config.PolicyPrefixAffinity+"+events/chat-32000chars", func(b *testing.B) {
		p, req := eventsPool(addrs)
		benchPick(b, p, req, addrs[0])
	})
	// A conversation's first request, its engines' scrapes telling how long
	// they keep what they write (keepsFor reads each one).
	b.Run(config.PolicyPrefixAffinity+"+events/first-request-scraped", func(b *testing.B) {
		p, later := eventsPool(addrs)
		now := time.Now()
		for _, e := range p.Endpoints() {
			e.observe(Load{CacheTokens: 10_000, At: now.Add(-20 * time.Second)})
			e.observe(Load{CacheTokens: 10_000, Written: 100, At: now})
		}
		req := chatRequest(benchConversation()[:2])
		req.SetTokens(later.Tokens()[:2_500])
		benchPick(b, p, req, addrs[0])
	})
	// The same picks from every CPU at once, as a replica's streams make
	// them: the view is read by all and written by its subscriber.
	b.Run(config.PolicyPrefixAffinity+"+events/chat-32000chars/parallel", func(b *testing.B) {
		p, shared := eventsPool(addrs)
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			req := chatRequest(benchConversation()) // a pick notes its estimate on the request
			req.SetTokens(shared.Tokens())
			for pb.Next() {
				if e, err := p.Select(req); err != nil || e.Addr != addrs[0] {
					b.Error(e, err)
					return
				}
			}
		})
	})
}

func benchAddrs(n int) []string {
	addrs := make([]string, n)
	for i := range addrs {
		addrs[i] = fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250+1)
	}
	return addrs
}

func benchText(chars int) string {
	return strings.Repeat("You are a helpful assistant. ", chars/29+1)[:chars]
}

// benchConversation is a conversation's fifth turn: 32,000 characters of
// content.
func benchConversation() []simMessage {
	messages := []simMessage{{"system", benchText(8_000)}}
	for i := range 5 {
		messages = append(messages, simMessage{"user", fmt.Sprintf("question %d ", i) + benchText(2_000-11)})
		if i < 4 {
			messages = append(messages, simMessage{"assistant", benchText(3_500)})
		}
	}
	return messages
}

// eventsPool is a prefix-affinity pool of addrs that follows the engines' KV
// events, and benchConversation's request with its 8,000 tokens known (the
// /tokenize round trip is measured apart: pd_extproc_tokenize_seconds): the
// first endpoint holds the first 6,000 (its earlier turns), the next three the
// first 2,000 (the system prompt), the others none, as their events said.
func eventsPool(addrs []string) (*Pool, *Request) {
	scrapes := config.EngineMetrics{Interval: config.Duration(time.Second), StaleAfter: config.Duration(time.Hour)} // read only where a test observes a load
	p := NewPools(Spec{Decode: PoolSpec{Endpoints: addrs, PoolScheduling: config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Metrics: scrapes}}}, Deps{}).Decode
	index := kvevents.NewIndex(kvevents.Bounds{}, time.Minute, nil)
	tokens := make([]int64, 8_000)
	for i := range tokens {
		tokens[i] = int64(i*7919) % 150_000
	}
	for i, a := range addrs { // each endpoint's events followed, most holding nothing
		held := 0
		switch {
		case i == 0:
			held = 6_000
		case i < 4:
			held = 2_000
		}
		hashes := make([]uint64, held/16)
		for j := range hashes {
			hashes[j] = uint64(i<<32 | j)
		}
		index.Apply(kvevents.Publisher{Endpoint: a}, []kvevents.Event{{Kind: kvevents.Stored, Hashes: hashes, Tokens: tokens[:held/16*16], BlockSize: 16}})
	}
	p.events.Store(&poolEvents{index: index})
	req := chatRequest(benchConversation())
	req.SetTokens(tokens)
	return p, req
}

// benchPick times p.Select(req), which must pick want when it is not "".
func benchPick(b *testing.B, p *Pool, req *Request, want string) {
	b.ReportAllocs()
	for b.Loop() {
		if e, err := p.Select(req); err != nil || want != "" && e.Addr != want {
			b.Fatal(e, err)
		}
	}
}

// BenchmarkSelectAtScale is one pick on pools of 8, 1,000 and 2,000
// endpoints whose loads are scraped (docs/kubernetes.md): least-load's, with
// three fallbacks (pools.decode.fallbacks), under an endpoint picker's subset
// hint naming every endpoint, and prefix-affinity's pick of BenchmarkSelect's
// conversation, without and with KV events.
//
//	go test -run '^$' -bench SelectAtScale ./pkg/scheduling/
func BenchmarkSelectAtScale(b *testing.B) {
	for _, n := range []int{8, 1000, 2000} {
		addrs := benchAddrs(n)
		hint := addrs
		scraped := func(policy string) *Pool {
			spec := config.PoolScheduling{Policy: policy}
			spec.Metrics.Interval, spec.Metrics.StaleAfter = config.Duration(time.Second), config.Duration(time.Hour)
			p := NewPools(Spec{Decode: PoolSpec{Endpoints: addrs, PoolScheduling: spec}}, Deps{}).Decode
			for i, e := range p.Endpoints() {
				e.observe(Load{Waiting: float64(i % 7), KVUsage: 0.5, At: time.Now()})
			}
			return p
		}
		p := scraped(config.PolicyLeastLoad)
		b.Run(fmt.Sprint(n, "/least-load"), func(b *testing.B) { benchPick(b, p, promptRequest("hello"), "") })
		b.Run(fmt.Sprint(n, "/fallbacks=3"), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if eps, err := p.SelectN(nil, 4); err != nil || len(eps) != 4 {
					b.Fatal(eps, err)
				}
			}
		})
		b.Run(fmt.Sprint(n, "/subset-hint"), func(b *testing.B) {
			req := promptRequest("hello")
			req.Subset = ParseSubset(hint)
			benchPick(b, p, req, "")
		})
		b.Run(fmt.Sprint(n, "/prefix-affinity/chat-32000chars"), func(b *testing.B) {
			benchPick(b, scraped(config.PolicyPrefixAffinity), chatRequest(benchConversation()), "")
		})
		b.Run(fmt.Sprint(n, "/prefix-affinity+events/chat-32000chars"), func(b *testing.B) {
			p, req := eventsPool(addrs)
			benchPick(b, p, req, addrs[0])
		})
	}
}

// An endpoint without fresh figures (its scrapes fail, they are stale, or
// none came yet) is scored by its requests in flight here plus, for its
// engine's queue and KV use, the mean of the candidates' fresh scrapes: it
// neither reads idle and draws the requests (an engine whose /metrics stops
// answering is often one overloaded) nor is left out. Figures are by
// position: the address order for least load (which compares the first two:
// testPool's draws), the prompt's ranking for prefix affinity (bounds: an
// engine queue at most the mean + 1).
func TestEndpointWithoutFreshFiguresScoresThePoolMean(t *testing.T) {
	type figures struct {
		inflight int
		waiting  float64
		scrape   string // "fresh", "failed" (the last scrape failed), "stale", "" (none yet)
	}
	tests := []struct {
		name   string
		policy string
		eps    []figures
		want   int // position
	}{
		{"least load: scrapes failing, idle when they last answered", config.PolicyLeastLoad,
			[]figures{{0, 0, "failed"}, {0, 2, "fresh"}, {0, 6, "fresh"}}, 1}, // 4 against 2
		{"least load: figures stale", config.PolicyLeastLoad,
			[]figures{{0, 0, "stale"}, {0, 2, "fresh"}, {0, 6, "fresh"}}, 1},
		{"least load: never scraped", config.PolicyLeastLoad,
			[]figures{{0, 0, ""}, {0, 2, "fresh"}, {0, 6, "fresh"}}, 1},
		{"least load: the mean is less busy than a busy engine", config.PolicyLeastLoad,
			[]figures{{0, 0, "failed"}, {0, 6, "fresh"}, {0, 2, "fresh"}}, 0}, // 4 against 6
		{"least load: busy when they last answered, a share still", config.PolicyLeastLoad,
			[]figures{{0, 9, "failed"}, {0, 6, "fresh"}, {0, 2, "fresh"}}, 0},
		{"least load: requests in flight here count on top", config.PolicyLeastLoad,
			[]figures{{2, 0, "failed"}, {0, 4, "fresh"}, {0, 2, "fresh"}}, 1}, // 2 + 3 against 4
		{"least load: no fresh figures anywhere, in flight alone", config.PolicyLeastLoad,
			[]figures{{1, 0, "failed"}, {0, 9, "stale"}, {0, 0, ""}}, 1},
		{"affinity: the home stays within the bound, not spilled to scrapes failing", config.PolicyPrefixAffinity,
			[]figures{{0, 5, "fresh"}, {0, 0, "failed"}, {0, 3, "fresh"}, {0, 4, "fresh"}}, 0}, // mean 4 (3 with the failing at 0)
		{"affinity: scrapes failing keep the home's share", config.PolicyPrefixAffinity,
			[]figures{{0, 0, "failed"}, {0, 8, "fresh"}, {0, 8, "fresh"}, {0, 8, "fresh"}}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			addrs := []string{"a", "b", "c", "d"}[:len(tt.eps)]
			p, clock := testPool(t, config.PoolScheduling{Policy: tt.policy,
				Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)},
				Prefix:  config.PrefixAffinity{BlockChars: 16, KeyBlocks: 2, LoadFactor: 1.5, LoadSlack: 2, QueueSlack: 1}}, addrs...)
			prompt := blocks("abc")
			order := addrs
			if tt.policy == config.PolicyPrefixAffinity {
				order = ranking(p, prompt)
				aff := p.state.Load().picker.(*prefixAffinity)
				aff.index.record(prompt[:32], aff.index.hashes(0, prompt[:32]), order[0], stamp{})
			}
			for i, f := range tt.eps {
				e := byAddr(p, order[i])
				for range f.inflight {
					acquire(e)
				}
				switch f.scrape {
				case "fresh":
					e.observe(Load{Waiting: f.waiting, At: clock.Now()})
				case "failed":
					e.observe(Load{Waiting: f.waiting, At: clock.Now()})
					e.scrapeFailed(scrapeTimeout)
				case "stale":
					e.observe(Load{Waiting: f.waiting, At: clock.Now().Add(-time.Minute)})
				}
			}
			got, err := p.Select(promptRequest(prompt))
			if err != nil {
				t.Fatal(err)
			}
			if got.Addr != order[tt.want] {
				t.Fatalf("Select() = %s, want %s (order %v)", got.Addr, order[tt.want], order)
			}
		})
	}
}
