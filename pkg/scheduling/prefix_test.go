package scheduling

import (
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// blocks builds a prompt of 16-character blocks from letters: "ab" is two
// blocks, "aaaaaaaaaaaaaaaa" then "bbbbbbbbbbbbbbbb".
func blocks(letters string) string {
	var b strings.Builder
	for _, c := range letters {
		b.WriteString(strings.Repeat(string(c), 16))
	}
	return b.String()
}

func TestPrefixHashes(t *testing.T) {
	x := newPrefixIndex(16, 100)
	ab, abc, xbc := x.hashes(0, blocks("ab")), x.hashes(0, blocks("abc")), x.hashes(0, blocks("xbc"))
	if len(ab) != 2 || len(abc) != 3 || len(x.hashes(0, blocks("ab")+"partial")) != 2 || x.hashes(0, "short") != nil {
		t.Fatal("one hash per full block, a trailing partial block left out")
	}
	if ab[0] != abc[0] || ab[1] != abc[1] {
		t.Error("a shared prefix does not hash alike")
	}
	if abc[1] == xbc[1] || abc[2] == xbc[2] {
		t.Error("equal blocks after a different first block hash alike: the chain is lost")
	}
}

func TestPrefixIndexMatch(t *testing.T) {
	tests := []struct {
		name     string
		capacity int
		served   []struct{ prompt, addr string }
		prompt   string
		want     map[string]int
	}{
		{name: "nothing served", capacity: 100, prompt: blocks("abc"), want: map[string]int{}},
		{name: "longest served prefix per endpoint", capacity: 100,
			served: []struct{ prompt, addr string }{{blocks("ab"), "e1"}, {blocks("abcd"), "e2"}, {blocks("xbcd"), "e3"}},
			prompt: blocks("abcz"), want: map[string]int{"e1": 2, "e2": 3}},
		{name: "the four most recent servers of a block are kept", capacity: 100,
			served: []struct{ prompt, addr string }{{blocks("a"), "e1"}, {blocks("a"), "e2"}, {blocks("a"), "e3"}, {blocks("a"), "e4"}, {blocks("a"), "e5"}},
			prompt: blocks("a"), want: map[string]int{"e2": 1, "e3": 1, "e4": 1, "e5": 1}},
		{name: "serving again moves an endpoint to the front", capacity: 100,
			served: []struct{ prompt, addr string }{{blocks("a"), "e1"}, {blocks("a"), "e2"}, {blocks("a"), "e3"}, {blocks("a"), "e4"}, {blocks("a"), "e1"}, {blocks("a"), "e5"}},
			prompt: blocks("a"), want: map[string]int{"e1": 1, "e3": 1, "e4": 1, "e5": 1}},
		{name: "the LRU bound evicts the least recent blocks, tails first", capacity: 3,
			served: []struct{ prompt, addr string }{{blocks("ab"), "e1"}, {blocks("xy"), "e2"}},
			prompt: blocks("ab"), want: map[string]int{"e1": 1}},
		{name: "an evicted head ends the match", capacity: 2,
			served: []struct{ prompt, addr string }{{blocks("ab"), "e1"}, {blocks("xy"), "e2"}},
			prompt: blocks("ab"), want: map[string]int{}},
		{name: "a chain longer than the index", capacity: 2,
			served: []struct{ prompt, addr string }{{blocks("abcde"), "e1"}},
			prompt: blocks("abcde"), want: map[string]int{"e1": 2}},
		{name: "a chain's head outlives its tail", capacity: 3,
			served: []struct{ prompt, addr string }{{blocks("xyz"), "e2"}, {blocks("a"), "e1"}},
			prompt: blocks("xyz"), want: map[string]int{"e2": 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := newPrefixIndex(16, tt.capacity)
			for _, s := range tt.served {
				x.record(s.prompt, x.hashes(0, s.prompt), s.addr, stamp{})
			}
			if got := x.matched(x.hashes(0, tt.prompt)); !maps.Equal(got, tt.want) {
				t.Fatalf("matched() = %v, want %v", got, tt.want)
			}
		})
	}
}

// fresh counts, of what matched counts for an endpoint, the blocks it was
// sent since the window's oldest stamp, in the same run of its engine: up to
// the deepest such block, a chain carrying the blocks before it, even where
// more recent endpoints took the endpoint's place in a popular block's list.
func TestPrefixIndexFresh(t *testing.T) {
	type send struct {
		prompt, addr string
		at           stamp
	}
	tests := []struct {
		name  string
		sent  []send
		since stamp
		want  int
	}{
		{name: "within the window", sent: []send{{blocks("abc"), "e1", stamp{100, 0}}}, since: stamp{50, 0}, want: 3},
		{name: "written over since", sent: []send{{blocks("abc"), "e1", stamp{100, 0}}}, since: stamp{150, 0}, want: 0},
		{name: "a restart since", sent: []send{{blocks("abc"), "e1", stamp{100, 0}}}, since: stamp{-900, 1}, want: 0},
		{name: "sent before the engine's first answer, a restart since", sent: []send{{blocks("abc"), "e1", stamp{}}}, since: stamp{-900, 1}, want: 0},
		{name: "sent past the window's end, no restart (vLLM's Written back for a while)",
			sent: []send{{blocks("abc"), "e1", stamp{500, 2}}}, since: stamp{-100, 2}, want: 3},
		{name: "the head sent again since, the rest written over",
			sent: []send{{blocks("abc"), "e1", stamp{100, 0}}, {blocks("a"), "e1", stamp{300, 0}}}, since: stamp{150, 0}, want: 1},
		{name: "the chain sent again carries its head", sent: []send{{blocks("a"), "e1", stamp{100, 0}}, {blocks("abc"), "e1", stamp{300, 0}}}, since: stamp{150, 0}, want: 3},
		{name: "the head's list taken over by four other endpoints",
			sent:  []send{{blocks("abc"), "e1", stamp{100, 0}}, {blocks("a"), "e2", stamp{}}, {blocks("a"), "e3", stamp{}}, {blocks("a"), "e4", stamp{}}, {blocks("a"), "e5", stamp{}}},
			since: stamp{50, 0}, want: 3},
		{name: "another endpoint's fresh blocks do not count", sent: []send{{blocks("abc"), "e2", stamp{100, 0}}}, since: stamp{50, 0}, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := newPrefixIndex(16, 100)
			for _, s := range tt.sent {
				x.record(s.prompt, x.hashes(0, s.prompt), s.addr, s.at)
			}
			hs := x.hashes(0, blocks("abc"))
			if got := x.fresh(hs[:x.matched(hs)["e1"]], "e1", tt.since); got != tt.want {
				t.Fatalf("fresh() = %d, want %d", got, tt.want)
			}
		})
	}
}

// A later turn's previous request counts as routed here only if a request
// with exactly its text was: sharing its blocks is not enough.
func TestPrefixIndexKnowsWhichRequestsItRouted(t *testing.T) {
	tests := []struct {
		name     string
		routed   []string
		previous string
		want     bool
	}{
		{name: "that very request", routed: []string{blocks("ab") + "partial"}, previous: blocks("ab") + "partial", want: true},
		{name: "that request, whole blocks", routed: []string{blocks("ab")}, previous: blocks("ab"), want: true},
		{name: "a longer request that starts with it", routed: []string{blocks("abc")}, previous: blocks("ab")},
		{name: "a request with its blocks, another tail", routed: []string{blocks("ab") + "other"}, previous: blocks("ab") + "partial"},
		{name: "a later request ending in the same block", routed: []string{blocks("ab") + "partial", blocks("ab") + "other"}, previous: blocks("ab") + "partial"},
		{name: "no full block", routed: []string{"partial"}, previous: "partial"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := newPrefixIndex(16, 100)
			for _, r := range tt.routed {
				x.record(r, x.hashes(0, r), "e1", stamp{})
			}
			prompt := tt.previous + blocks("zz") // the turn that follows it
			if got := x.ended(tt.previous, x.hashes(0, prompt)); got != tt.want {
				t.Errorf("ended() = %v, want %v", got, tt.want)
			}
		})
	}
}

// ranking is the order prefix affinity tries the pool's endpoints in for
// prompt, by address; nil when the prompt has no key.
func ranking(p *Pool, prompt string) []string { return rankingOf(p, promptRequest(prompt), 1) }

// rankingOf is the order prefix affinity tries the pool's endpoints in for
// req, when nothing is in flight or queued and its prefix's home set has home
// endpoints.
func rankingOf(p *Pool, req *Request, home int) []string {
	aff := p.state.Load().picker.(*prefixAffinity)
	prefix, conversation := aff.keys.keys(req)
	if prefix == "" {
		return nil
	}
	var out []string
	for _, r := range rank(xxhash.Sum64String(prefix), xxhash.Sum64String(conversation), home, p.Endpoints()) {
		out = append(out, r.e.Addr)
	}
	return out
}

func TestPrefixAffinityPick(t *testing.T) {
	// Four endpoints; bounds: busyness at most 1.5 × the mean + 2, engine
	// queue at most the mean + 1; keys of two 16-char blocks. Positions name
	// the endpoints in the prompt's ranking; least load is two-choices over
	// the first two candidates (testPool's draws). Unless a case says
	// otherwise, this replica has routed the prompt's key before (to the
	// first-ranked), as a prompt without messages needs to be ranked.
	type served struct {
		prompt string
		rank   int
	}
	tests := []struct {
		name     string
		unrouted bool
		served   []served
		prompt   string
		inflight []int // by rank
		queued   []int // by rank, scraped
		want     int   // rank, or -1: least load (the less busy of a and b)
	}{
		{name: "no full block: least load", prompt: "short", inflight: []int{0, 0, 0, 0}, want: -1},
		{name: "a prompt without messages never routed here: least load", unrouted: true, prompt: blocks("abc"), inflight: []int{0, 1, 0, 0}, want: -1},
		{name: "the first-ranked, though busier", prompt: blocks("abc"), inflight: []int{4, 0, 1, 1}, want: 0},
		{name: "first over the bound: the second", prompt: blocks("abc"), inflight: []int{9, 1, 1, 1}, want: 1},                                              // bound 6.5
		{name: "first's engine queue over the mean + 1: the second", prompt: blocks("abc"), inflight: []int{0, 0, 0, 0}, queued: []int{3, 0, 1, 0}, want: 1}, // bound 2
		{name: "a queue within the bound", prompt: blocks("abc"), inflight: []int{0, 0, 0, 0}, queued: []int{1, 0, 0, 0}, want: 0},                           // bound 1.25
		{name: "a hint that knows more than the key wins",
			served: []served{{blocks("abcd"), 2}}, prompt: blocks("abcde"), inflight: []int{0, 0, 3, 0}, want: 2},
		{name: "a hint over the bound is ignored",
			served: []served{{blocks("abcd"), 2}}, prompt: blocks("abcde"), inflight: []int{0, 0, 9, 0}, want: 0},
		{name: "a hint no longer than the key is ignored",
			served: []served{{blocks("abz"), 2}}, prompt: blocks("abcde"), inflight: []int{0, 0, 0, 0}, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, config.PoolScheduling{Policy: config.PolicyPrefixAffinity,
				Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)},
				Prefix:  config.PrefixAffinity{BlockChars: 16, KeyBlocks: 2, LoadFactor: 1.5, LoadSlack: 2, QueueSlack: 1}}, "a", "b", "c", "d")
			aff := p.state.Load().picker.(*prefixAffinity)
			rank := ranking(p, tt.prompt)
			if key := tt.prompt[:min(len(tt.prompt), 32)]; !tt.unrouted && len(key) == 32 {
				aff.index.record(key, aff.index.hashes(0, key), rank[0], stamp{})
			}
			for _, s := range tt.served {
				aff.index.record(s.prompt, aff.index.hashes(0, s.prompt), rank[s.rank], stamp{})
			}
			for i, n := range tt.inflight {
				for range n {
					acquire(byAddr(p, rank[i]))
				}
			}
			for i, n := range tt.queued {
				byAddr(p, rank[i]).observe(Load{Waiting: float64(n), At: clock.Now()})
			}
			got, err := p.Select(promptRequest(tt.prompt))
			if err != nil {
				t.Fatal(err)
			}
			want := "a"
			if tt.want >= 0 {
				want = rank[tt.want]
			}
			if got.Addr != want {
				t.Fatalf("Select() = %s, want %s (ranking %v)", got.Addr, want, rank)
			}
			if n := len(tt.prompt) / 16; n > 0 {
				if m := aff.index.matched(aff.index.hashes(0, tt.prompt)); m[got.Addr] != n {
					t.Errorf("the pick was not remembered: matched = %v", m)
				}
			}
		})
	}
}

// TestRendezvousRanking: the ranking is a function of the key (the first
// key_blocks full blocks) and the endpoints' addresses, nothing else, and the
// same in every process.
func TestRendezvousRanking(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000", "10.0.0.5:8000"}
	pool := func(addrs ...string) *Pool {
		p, _ := testPool(t, config.PoolScheduling{Policy: config.PolicyPrefixAffinity,
			Prefix: config.PrefixAffinity{BlockChars: 16, KeyBlocks: 2}}, addrs...)
		return p
	}
	reversed := slices.Clone(addrs)
	slices.Reverse(reversed)
	p := pool(addrs...)
	// Pinned: a hash seeded per process would rank differently on every replica.
	golden := []string{"10.0.0.5:8000", "10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.2:8000", "10.0.0.4:8000"}
	if got := ranking(p, blocks("abcd")); !slices.Equal(got, golden) {
		t.Fatalf("ranking of %q = %v, want %v: the key hash changed, and replicas of two versions disagree", blocks("abcd"), got, golden)
	}
	tests := []struct {
		name   string
		pool   *Pool
		prompt string
	}{
		{"another replica", pool(addrs...), blocks("abcd")},
		{"the endpoints listed in another order", pool(reversed...), blocks("abcd")},
		{"the same key, another tail", p, blocks("abxyz")},
		{"the key alone", p, blocks("ab") + "partial"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := ranking(tc.pool, tc.prompt); !slices.Equal(got, golden) {
				t.Errorf("ranking = %v, want %v", got, golden)
			}
		})
	}
	t.Run("an endpoint removed: the others keep their order", func(t *testing.T) {
		without := slices.DeleteFunc(slices.Clone(golden), func(a string) bool { return a == golden[1] })
		if got := ranking(pool(without...), blocks("abcd")); !slices.Equal(got, without) {
			t.Errorf("ranking = %v, want %v", got, without)
		}
	})
	t.Run("other keys rank otherwise", func(t *testing.T) {
		first := map[string]int{}
		for c := 'a'; c <= 'z'; c++ {
			for d := 'a'; d <= 'z'; d += 5 {
				first[ranking(p, blocks(string([]rune{c, d})))[0]]++
			}
		}
		for a, n := range first {
			if n > 26*6/len(addrs)*2 {
				t.Errorf("%s is first for %d of %d keys: %v", a, n, 26*6, first)
			}
		}
		if len(first) != len(addrs) {
			t.Errorf("only %d endpoints are ever first: %v", len(first), first)
		}
	})
}

// A single hot prefix must not pile every request onto one endpoint.
func TestHotPrefixSpillsOver(t *testing.T) {
	p, _ := testPool(t, config.PoolScheduling{Policy: config.PolicyPrefixAffinity,
		Prefix: config.PrefixAffinity{LoadFactor: 1.5, LoadSlack: 2}}, "a", "b", "c", "d")
	hot := promptRequest(strings.Repeat("the same long system prompt ", 100))
	counts := map[string]int{}
	for range 200 {
		e, err := p.Select(hot)
		if err != nil {
			t.Fatal(err)
		}
		acquire(e) // none finish: load only grows
		counts[e.Addr]++
	}
	for addr, n := range counts {
		if n > 200/4*3/2+2+1 {
			t.Errorf("%s took %d of 200 requests: over the 1.5 × mean + 2 bound", addr, n)
		}
	}
	// Each endpoint may hold up to 1.5 × the mean, so three of four suffice.
	if len(counts) < 3 {
		t.Errorf("requests went to %d endpoints, want at least 3: %v", len(counts), counts)
	}
}

// A conversation is ranked by its head (through the first user message),
// which every turn repeats: its turns go to one endpoint on every replica
// however long the history grows past the key. A first request's head
// longer than the key is cut to key_blocks blocks, so that requests sharing
// a long system prompt meet the engine that caches it (here the home set is
// one endpoint, so later turns meet there too).
func TestConversationsKeepTheirEndpoint(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Prefix: config.PrefixAffinity{BlockChars: 16, KeyBlocks: 4}}
	long := strings.Repeat("a long shared system prompt. ", 4) // over 4 blocks of 16
	tests := []struct {
		name  string
		turns []*Request
	}{
		{"chat, one short turn, then longer", []*Request{
			conversation("Be brief.", "Hi"),
			conversation("Be brief.", "Hi", "Hello! How can I help?", "Tell me about prefix caches, at length."),
			conversation("Be brief.", "Hi", "Hello! How can I help?", "Tell me about prefix caches, at length.", "They keep KV blocks.", "And then?"),
		}},
		{"chat without a system prompt", []*Request{
			conversation("", "What is rendezvous hashing?"),
			conversation("", "What is rendezvous hashing?", "Highest random weight hashing.", "Who came up with it, and when?"),
		}},
		{"chat, a system prompt longer than the key, whatever the user says", []*Request{
			conversation(long, "Hi"),
			conversation(long, "Something else entirely, and longer"),
			conversation(long, "Hi", "Hello", "More"),
		}},
		{"responses", []*Request{
			read(t, api.Responses, `{"instructions":"Be brief.","input":"Hi"}`),
			read(t, api.Responses, `{"instructions":"Be brief.","input":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello! How can I help?"},{"role":"user","content":"Tell me more, at length."}]}`),
		}},
		{"messages", []*Request{
			read(t, api.Messages, `{"system":"Be brief.","messages":[{"role":"user","content":"Hi"}]}`),
			read(t, api.Messages, `{"system":"Be brief.","messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello! How can I help?"},{"role":"user","content":"Tell me more, at length."}]}`),
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Each turn on a replica of its own, which saw none of the others.
			var first string
			for i, req := range tt.turns {
				p, _ := testPool(t, sched, addrs...)
				e, err := p.Select(req)
				if err != nil {
					t.Fatal(err)
				}
				if i == 0 {
					first = e.Addr
				} else if e.Addr != first {
					t.Errorf("turn %d went to %s, turn 1 to %s", i+1, e.Addr, first)
				}
			}
		})
	}
}

// Later turns rank by their whole conversation: under an agent's preamble
// longer than the key (its tools and system prompt), by the first user
// message after it, and by the client's own name for the conversation
// (prompt_cache_key: Codex's conversation id, whose sessions in one
// directory share their first user item). So conversations spread over the
// prefix's home set, and each keeps to its endpoint whichever replica routes
// its turns, while first requests (one-shot ones, for all anyone knows)
// still meet on one. A replica does not assume that the endpoint a second
// turn ranks first holds the first, which was ranked otherwise; from the
// third turn on it does.
func TestLaterTurnsRankByTheWholeConversation(t *testing.T) {
	var addrs []string
	for i := range 8 {
		addrs = append(addrs, fmt.Sprintf("10.0.0.%d:8000", i+1))
	}
	sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Prefix: config.PrefixAffinity{BlockChars: 16, KeyBlocks: 4, Spread: 1e6}}
	long := strings.Repeat("an agent's tools and system prompt. ", 4) // over the key's 4 blocks of 16
	tests := []struct {
		name string
		turn func(i, n int) *Request // conversation i's nth request
	}{
		{"chat under a preamble longer than the key", func(i, n int) *Request {
			msgs := []string{fmt.Sprint("task ", i)}
			for k := 1; k < n; k++ {
				msgs = append(msgs, fmt.Sprint("reply ", k), fmt.Sprint("next ", k))
			}
			return conversation(long, msgs...)
		}},
		{"Responses named by prompt_cache_key, one first item for all", func(i, n int) *Request {
			input := []map[string]string{{"role": "user", "content": "<environment_context><cwd>/src</cwd></environment_context>"}}
			for k := 1; k < n; k++ {
				input = append(input, map[string]string{"role": "assistant", "content": fmt.Sprint("reply ", k)},
					map[string]string{"role": "user", "content": fmt.Sprint("next ", k)})
			}
			b, _ := json.Marshal(map[string]any{"instructions": "Be brief.", "input": input, "prompt_cache_key": fmt.Sprint("conversation-", i)})
			obj, err := body.Parse(b)
			if err != nil {
				t.Fatal(err)
			}
			return NewRequest(api.Responses.PromptOf(obj, api.VLLM))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Each request on a replica of its own, which saw none of the others.
			selectAlone := func(req *Request) *Endpoint {
				p, _ := testPool(t, sched, addrs...)
				e, err := p.Select(req)
				if err != nil {
					t.Fatal(err)
				}
				return e
			}
			firsts, laters := map[string]bool{}, map[string]bool{}
			for i := range 16 {
				firsts[selectAlone(tt.turn(i, 1)).Addr] = true
				second, third := tt.turn(i, 2), tt.turn(i, 3)
				e2, e3 := selectAlone(second), selectAlone(third)
				if e3.Addr != e2.Addr {
					t.Errorf("conversation %d: turn 2 went to %s, turn 3 to %s", i, e2.Addr, e3.Addr)
				}
				if second.Held(e2) != 0 || third.Held(e3) < len(third.Previous()) {
					t.Errorf("conversation %d: estimated %d characters held for turn 2, whose first turn was ranked otherwise, and %d for turn 3 (previous %d)",
						i, second.Held(e2), third.Held(e3), len(third.Previous()))
				}
				laters[e2.Addr] = true
			}
			if len(firsts) != 1 {
				t.Errorf("first requests went to %d endpoints, want them on one: %v", len(firsts), firsts)
			}
			if len(laters) < 3 {
				t.Errorf("the later turns of 16 conversations went to %d endpoints, want them spread over the home set of 8: %v", len(laters), laters)
			}
		})
	}
}

// TestDecodeTurnsAgreeWhereReplicasSizeAHomeSetApart: each replica sizes a
// system prompt's home set from the share of the requests it sees, and two
// replicas that size it apart (here 2 and 4 endpoints of 4) rank a
// conversation's later turns on different endpoints. The decode pool of the
// cache rule (pd.mode auto) ranks later turns over the whole pool instead, so
// both send each third turn to one endpoint and estimate it holds the turn
// before; under always-P/D the decode pool keeps the home set, and the two
// part. A system prompt few requests share keeps a home set of one endpoint:
// a conversation's turns stay where its first went, on whichever replica.
func TestDecodeTurnsAgreeWhereReplicasSizeAHomeSetApart(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	system := strings.Repeat("You review pull requests for the platform team. ", 20)
	replica := func(mode string, shared int) *Pool {
		sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity}
		ps := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000"}, PoolScheduling: sched},
			Decode: PoolSpec{Endpoints: addrs, PoolScheduling: sched}, PD: config.PD{Mode: mode}}, Deps{Now: newFakeClock().Now})
		for i := range 200 { // shared of them under the system prompt, the others each under one of its own
			req := conversation(fmt.Sprint("Agent ", i, ". ", system), "Hello")
			if i < shared {
				req = conversation(system, fmt.Sprint("Question ", i))
			}
			if _, err := ps.Decode.Select(req); err != nil {
				t.Fatal(err)
			}
		}
		return ps.Decode
	}
	turn := func(c, n int) *Request { // conversation c's nth request
		msgs := []string{fmt.Sprint("Review change ", c)}
		for k := 1; k < n; k++ {
			msgs = append(msgs, fmt.Sprint("Reply ", k), fmt.Sprint("Follow-up ", k))
		}
		return conversation(system, msgs...)
	}
	tests := []struct {
		name   string
		mode   string
		shared [2]int // of 200 requests each replica saw, under the system prompt
		agree  bool
	}{
		{"cache rule, home sets of 2 and 4", config.PDAuto, [2]int{30, 60}, true},
		{"always P/D, home sets of 2 and 4", config.PDAlways, [2]int{30, 60}, false},
		{"cache rule, a system prompt few requests share", config.PDAuto, [2]int{1, 2}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			few := tt.shared[1] < 10
			a, b := replica(tt.mode, tt.shared[0]), replica(tt.mode, tt.shared[1])
			apart := 0
			for c := range 16 {
				if few {
					// Replicas of its own, whose own turns leave the share few.
					a, b = replica(tt.mode, tt.shared[0]), replica(tt.mode, tt.shared[1])
				}
				first, err := a.Select(turn(c, 1))
				if err != nil {
					t.Fatal(err)
				}
				for n := 2; n <= 3; n++ {
					reqA, reqB := turn(c, n), turn(c, n)
					ea, errA := a.Select(reqA)
					eb, errB := b.Select(reqB)
					if err := cmp.Or(errA, errB); err != nil {
						t.Fatal(err)
					}
					if ea.Addr != eb.Addr {
						apart++
						continue
					}
					if !tt.agree {
						continue
					}
					if n == 3 && (reqA.Held(ea) < len(reqA.Previous()) || reqB.Held(eb) < len(reqB.Previous())) {
						t.Errorf("conversation %d, turn 3 on %s: estimated %d and %d characters held, want the previous request's %d",
							c, ea.Addr, reqA.Held(ea), reqB.Held(eb), len(reqA.Previous()))
					}
					if few && ea.Addr != first.Addr {
						t.Errorf("conversation %d: turn %d went to %s, its first to %s", c, n, ea.Addr, first.Addr)
					}
				}
			}
			if tt.agree && apart > 0 {
				t.Errorf("the replicas sent %d of 32 later turns to different endpoints, want none", apart)
			}
			if !tt.agree && apart == 0 {
				t.Error("the replicas sent every later turn to one endpoint: the test does not size their home sets apart")
			}
		})
	}
}

// TestLaterTurnsStayWithTheirHistoryUnderLoad: on the decode pool of the
// cache rule, with queue_slack left out, a later turn's history is on the
// endpoint its conversation ranks first, whichever replica routed the turn
// before; it stays there while that engine's queue is within the bound of a
// followed history (the mean + 3 × the decode pool's default slack, 4),
// where a request that starts a conversation (or a one-shot one) spills at
// the mean + 1, the usual bound. Under always-P/D every request spills at
// the mean + 4, but a later turn whose engines keep what they write for 90 s
// or more (by their scraped counters) takes the looser bound there too. On
// the prefill pool, under either mode, a later turn takes the decode pool's
// looser bound (the mean + 12) while its engines keep what they write for
// 30 s or more, and spills at the mean + 1 otherwise; past the looser bound
// a later turn spills anyway.
func TestLaterTurnsStayWithTheirHistoryUnderLoad(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	prefillAddrs := []string{"10.0.1.1:8000", "10.0.1.2:8000", "10.0.1.3:8000", "10.0.1.4:8000"}
	system := strings.Repeat("You answer questions about the build. ", 20)
	later := conversation(system, "Why did it fail?", "A flaky test.", "Which one?")
	first := conversation(system, "Why did it fail?")
	tests := []struct {
		name   string
		mode   string
		req    *Request
		queued float64 // the first endpoint's scraped queue; the others' are 0
		// rewrite: the seconds in which the engines write their caches over,
		// by their scrapes; 0: not read.
		rewrite float64
		stays   bool
		prefill bool // the P/D prefill pool's pick, else the decode pool's
	}{
		{"cache rule, a later turn above the mean + 4", config.PDAuto, later, 8, 0, true, false},     // mean 2: 6 < 8 ≤ 14
		{"cache rule, a later turn above the mean + 12", config.PDAuto, later, 24, 0, false, false},  // mean 6: 24 > 18
		{"cache rule, a first request above the mean + 1", config.PDAuto, first, 4, 0, false, false}, // mean 1: 2 < 4
		{"always P/D, a later turn above the mean + 4", config.PDAlways, later, 8, 0, false, false},
		{"always P/D, a later turn above the mean + 4, caches written over in 10 s", config.PDAlways, later, 8, 10, false, false},
		{"always P/D, a later turn above the mean + 4, caches written over in 10 min", config.PDAlways, later, 8, 600, true, false},
		{"always P/D, a later turn above the mean + 12, caches written over in 10 min", config.PDAlways, later, 24, 600, false, false},
		{"always P/D, a first request above the mean + 4, caches written over in 10 min", config.PDAlways, first, 8, 600, false, false},
		{"always P/D, a first request within the mean + 4", config.PDAlways, first, 4, 0, true, false},                                  // mean 1: 4 ≤ 5
		{"prefill pool, a later turn above the mean + 4, caches written over in 10 min", config.PDAlways, later, 8, 600, true, true},    // mean 2: 8 ≤ 14
		{"prefill pool, a later turn above the mean + 4, caches written over in 40 s", config.PDAlways, later, 8, 40, true, true},       // 40 s < keptLong, ≥ keptTurn
		{"prefill pool, a later turn above the mean + 12, caches written over in 10 min", config.PDAlways, later, 24, 600, false, true}, // mean 6: 24 > 18
		{"prefill pool, a later turn above the mean + 1, caches written over in 10 s", config.PDAlways, later, 4, 10, false, true},      // mean 1: 4 > 2
		{"prefill pool, a later turn above the mean + 1, caches not read", config.PDAlways, later, 4, 0, false, true},
		{"prefill pool, cache rule, a later turn above the mean + 4, caches written over in 10 min", config.PDAuto, later, 8, 600, true, true},
		{"prefill pool, a first request above the mean + 1, caches written over in 10 min", config.PDAlways, first, 4, 600, false, true},
		{"prefill pool, a later turn within the mean + 1", config.PDAlways, later, 1, 0, true, true}, // mean 0.25: 1 ≤ 1.25
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}
			sched.SetDecodeDefaults(tt.mode) // queue_slack left out, as pkg/config fills it in
			prefill := config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Metrics: sched.Metrics}
			ps := NewPools(Spec{Prefill: PoolSpec{Endpoints: prefillAddrs, PoolScheduling: prefill},
				Decode: PoolSpec{Endpoints: addrs, PoolScheduling: sched}, PD: config.PD{Mode: tt.mode}}, Deps{Now: clock.Now})
			pool := ps.Decode
			if tt.prefill {
				pool = ps.Prefill
			}
			var written float64 // in the last 15 s
			if tt.rewrite > 0 {
				for _, e := range pool.Endpoints() {
					e.observe(Load{CacheTokens: 9000, At: clock.Now()})
				}
				clock.Advance(15 * time.Second)
				written = 9000 / tt.rewrite * 15
			}
			ranked, err := pool.Select(tt.req)
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range pool.Endpoints() {
				waiting := 0.0
				if e == ranked {
					waiting = tt.queued
				}
				e.observe(Load{Waiting: waiting, At: clock.Now(), CacheTokens: 9000 * min(1, tt.rewrite), Written: written})
			}
			got, err := pool.Select(tt.req)
			if err != nil {
				t.Fatal(err)
			}
			if stayed := got == ranked; stayed != tt.stays {
				t.Errorf("the request went to %s (it ranks %s first, queue %v): stayed %v, want %v", got.Addr, ranked.Addr, tt.queued, stayed, tt.stays)
			}
		})
	}
}

// conversation is a chat request: the system prompt (none when empty), then
// messages alternately from the user and the assistant.
func conversation(system string, msgs ...string) *Request {
	var ms []simMessage
	if system != "" {
		ms = append(ms, simMessage{"system", system})
	}
	for i, m := range msgs {
		ms = append(ms, simMessage{[]string{"user", "assistant"}[i%2], m})
	}
	return chatRequest(ms)
}

// read reads a client's body as its API does.
func read(t *testing.T, a *api.API, b string) *Request {
	t.Helper()
	obj, err := body.Parse([]byte(b))
	if err != nil {
		t.Fatal(err)
	}
	return NewRequest(a.Prompt(obj))
}

// A replica that sees its conversations whole (alone, or each conversation
// reaching only it) sends a new conversation where its system
// prompt is cached; one whose conversations other replicas continue leaves
// it to the ranking, which they would all follow. A spread of a million
// makes a home set of every endpoint, whatever the system prompt's share,
// so that the ranking of a new conversation can differ from the memory's
// choice.
func TestFirstTurnsGoWhereTheSystemPromptIsWhenConversationsAreWhole(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Prefix: config.PrefixAffinity{BlockChars: 16, Spread: 1e6},
		Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}
	const system = "Answer in French, and cite the page you read it on."
	pick := func(p *Pool, req *Request) string {
		t.Helper()
		e, err := p.Select(req)
		if err != nil {
			t.Fatal(err)
		}
		return e.Addr
	}
	tests := []struct {
		name string
		// seen is how many of each earlier conversation's three turns
		// this replica routed: 3, or the first and last (another replica
		// took the second).
		seen          int
		conversations int
		// fewShot one-shot requests follow, each with the same example
		// exchange after its first user message, which reads as an
		// earlier turn that every replica has seen.
		fewShot int
		// busy requests are in flight on the endpoint that holds the
		// system prompt when the new conversation comes.
		busy int
		// named: the earlier conversations, and the new one unless
		// newUnnamed, name their sessions (Request.Session); unnamed more
		// conversations that do not are continued elsewhere beside them.
		named, newUnnamed bool
		unnamed           int
		// clients: instead of naming sessions, the earlier conversations
		// come from one client address and the unnamed ones from another
		// (Request.Client); the new one from the first unless newUnnamed.
		clients bool
		// writtenSince, when not 0, is what the engines, scraped with a
		// cache of 1,000 tokens, have written since the system prompt's
		// engine was sent it.
		writtenSince float64
		// stale: the system prompt's engine's scrapes fail for longer than
		// stale_after once it was sent it, the others' answer.
		stale bool
		// neverAnswered: its scrapes never answer, failing for longer
		// than stale_after after the first, the others' answer.
		neverAnswered bool
		wantMemory    bool
	}{
		{name: "whole conversations: where the system prompt is", seen: 3, conversations: 8, wantMemory: true},
		{name: "whole, and the engine wrote less than its cache since: where the system prompt is", seen: 3, conversations: 8,
			writtenSince: 900, wantMemory: true},
		{name: "whole, but the engine has since written its cache over: the ranking", seen: 3, conversations: 8, writtenSince: 1100},
		{name: "whole, but the engine's counters stale: the ranking", seen: 3, conversations: 8, stale: true},
		{name: "whole, but the engine's scrapes never answered: the ranking", seen: 3, conversations: 8, neverAnswered: true},
		{name: "conversations continued elsewhere: the ranking", seen: 2, conversations: 8},
		{name: "too few conversations to tell: the ranking", seen: 3, conversations: 3},
		{name: "continued elsewhere, and few-shot requests: the ranking", seen: 2, conversations: 8, fewShot: 100},
		{name: "whole, but the system prompt's endpoint over the load bound: the ranking", seen: 3, conversations: 8, busy: 20},
		{name: "named sessions whole beside unnamed ones continued elsewhere: where the system prompt is", seen: 3, conversations: 8,
			named: true, unnamed: 8, wantMemory: true},
		{name: "an unnamed conversation beside whole named ones: the ranking", seen: 3, conversations: 8,
			named: true, unnamed: 8, newUnnamed: true},
		{name: "a client's conversations whole beside another's continued elsewhere: where the system prompt is", seen: 3, conversations: 8,
			clients: true, unnamed: 8, wantMemory: true},
		{name: "a conversation of the client whose others were continued elsewhere: the ranking", seen: 3, conversations: 8,
			clients: true, unnamed: 8, newUnnamed: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, sched, addrs...)
			other, _ := testPool(t, sched, addrs...)
			session := func(req *Request, first bool) *Request {
				req.Session = tt.named && first
				if tt.clients {
					req.Client = map[bool]string{true: "192.0.2.1", false: "192.0.2.2"}[first]
				}
				return req
			}
			for i := range tt.conversations + tt.unnamed {
				named, seen := i < tt.conversations, tt.seen
				if i >= tt.conversations {
					seen = 2
				}
				q := fmt.Sprintf("Question %d, which is long enough to fill a block.", i)
				pick(p, session(conversation("Be brief.", q), named))
				second := session(conversation("Be brief.", q, "Réponse.", "And the next one?"), named)
				if seen == 3 {
					pick(p, second)
				} else {
					pick(other, second)
				}
				pick(p, session(conversation("Be brief.", q, "Réponse.", "And the next one?", "Réponse.", "Thanks."), named))
			}
			for i := range tt.fewShot {
				pick(p, conversation("Translate to French.", "cat", "chat", fmt.Sprintf("dog number %d", i)))
			}
			scrape := func(written float64) {
				for _, e := range p.Endpoints() {
					e.observe(Load{CacheTokens: 1000, Written: written, At: clock.Now()})
				}
			}
			if tt.writtenSince > 0 || tt.stale {
				scrape(5000)
			}
			cached := pick(p, conversation(system, "Where is the Louvre?"))
			if tt.writtenSince > 0 {
				scrape(5000 + tt.writtenSince)
			}
			if tt.stale || tt.neverAnswered {
				for range 5 { // stale_after: three intervals, from the first failure where none answered
					clock.Advance(time.Second)
					byAddr(p, cached).scrapeFailed(scrapeTimeout)
				}
				for _, e := range p.Endpoints() {
					if e.Addr != cached {
						e.observe(Load{CacheTokens: 1000, Written: 5000, At: clock.Now()})
					}
				}
			}
			for range tt.busy {
				acquire(byAddr(p, cached))
			}
			// A new conversation with that system prompt whose own
			// ranking puts another endpoint first.
			var q, ranked string
			for i := 0; q == ""; i++ {
				question := fmt.Sprintf("Where is museum number %d?", i)
				if first := rankingOf(p, conversation(system, question), len(addrs))[0]; first != cached {
					q, ranked = question, first
				}
			}
			want := ranked
			if tt.wantMemory {
				want = cached
			}
			named := !tt.newUnnamed
			if got := pick(p, session(conversation(system, q), named)); got != want {
				t.Errorf("the new conversation went to %s, want %s (its system prompt is on %s, its ranking starts at %s)", got, want, cached, ranked)
			}
			// Its next turn follows it, on this replica.
			if got := pick(p, session(conversation(system, q, "Near the river.", "Which one?"), named)); got != want {
				t.Errorf("its second turn went to %s, the first to %s", got, want)
			}
		})
	}
}

func TestCoverageSaysWhetherConversationsAreWhole(t *testing.T) {
	tests := []struct {
		name string
		held string // of each later turn in order: h held, m missed
		want bool
	}{
		{name: "nothing seen", want: false},
		{name: "every turn held, but too few", held: "hhhhhhhh", want: false}, // 7.7 decayed
		{name: "every turn held", held: "hhhhhhhhh", want: true},
		{name: "one of two held (two replicas)", held: strings.Repeat("hm", 50), want: false},
		{name: "nearly all held", held: strings.Repeat("hhhhhhhhhhhhhhhhhhhm", 10), want: true},
		{name: "whole, until a second replica came", held: strings.Repeat("h", 200) + strings.Repeat("hm", 10), want: false},
		{name: "shared, and the other replica just went", held: strings.Repeat("hm", 100) + strings.Repeat("h", 100), want: false},
		{name: "shared, until the other replica went", held: strings.Repeat("hm", 100) + strings.Repeat("h", 160), want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c coverage
			for _, h := range tt.held {
				c.note(true, h == 'h')
			}
			if got := c.note(false, false); got != tt.want {
				t.Errorf("whole() = %v, want %v (held %.1f of %.1f)", got, tt.want, c.held, c.seen)
			}
		})
	}
}

// The prefix key is what a request shares with others, the conversation key
// what every turn of its conversation repeats.
func TestRendezvousKeys(t *testing.T) {
	long := strings.Repeat("s", 40)    // over two blocks of 16
	longer := strings.Repeat("s", 100) // over the key's four
	k := rendezvousKeys{blockChars: 16, keyBlocks: 4}
	tests := []struct {
		name                    string
		req                     *Request
		wantPrefix, wantConvKey string
	}{
		{"a system prompt of a block or more: it, and the head",
			conversation(long, "Hi"), "system\n" + long + "\n", "system\n" + long + "\nuser\nHi\n"},
		{"a later turn keys as its first",
			conversation(long, "Hi", "Hello", "More"), "system\n" + long + "\n", "system\n" + long + "\nuser\nHi\n"},
		{"a first request under a preamble over the key: its head cut to the key",
			conversation(longer, "Hi"), ("system\n" + longer)[:64], ("system\n" + longer)[:64]},
		{"a later turn under a preamble over the key: the key's length after it",
			conversation(longer, "Hi", "Hello", "More"), ("system\n" + longer)[:64], "system\n" + longer + "\nuser\nHi\n"},
		{"a later turn under a preamble that leaves a block of the key: cut as its first request",
			conversation(long, strings.Repeat("q", 100), "Hello", "More"), "system\n" + long + "\n", ("system\n" + long + "\nuser\n" + strings.Repeat("q", 100))[:64]},
		{"a system prompt shorter than a block: the head for both",
			conversation("Brief.", "Hi"), "system\nBrief.\nuser\nHi\n", "system\nBrief.\nuser\nHi\n"},
		{"no system prompt: the head",
			conversation("", "What is rendezvous hashing?"), "user\nWhat is rendezvous hashing?\n", "user\nWhat is rendezvous hashing?\n"},
		{"a head over the key is cut",
			conversation("", strings.Repeat("q", 100)), ("user\n" + strings.Repeat("q", 100))[:64], ("user\n" + strings.Repeat("q", 100))[:64]},
		{"no messages: the full blocks, at most the key",
			promptRequest(blocks("abcdef") + "partial"), blocks("abcd"), blocks("abcd")},
		{"no messages and no full block: none", promptRequest("short"), "", ""},
		{"tools are part of the preamble",
			read(t, api.Chat, `{"tools":[{"type":"function","function":{"name":"lookup"}}],"messages":[{"role":"user","content":"Hi"}]}`),
			`[{"type":"function","function":{"name":"lookup"}}]` + "\n", `[{"type":"function","function":{"name":"lookup"}}]` + "\nuser\nHi\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefix, conv := k.keys(tt.req)
			if prefix != tt.wantPrefix || conv != tt.wantConvKey {
				t.Errorf("keys() = %q, %q; want %q, %q", prefix, conv, tt.wantPrefix, tt.wantConvKey)
			}
		})
	}
	// A key of one block, under a preamble shorter than a block: the head is
	// the prefix key of every turn, cut to the key.
	one := rendezvousKeys{blockChars: 16, keyBlocks: 1}
	head := "system\nBrief.\nuser\n" + strings.Repeat("q", 100) + "\n"
	if prefix, conv := one.keys(conversation("Brief.", strings.Repeat("q", 100), "Hello", "More")); prefix != head[:16] || conv != head[:16] {
		t.Errorf("one-block keys of a later turn = %q, %q; want %q for both", prefix, conv, head[:16])
	}
}

func TestHomeSize(t *testing.T) {
	tests := []struct {
		share  float64
		n      int
		spread float64
		want   int
	}{
		{0, 8, 2, 1},
		{0.05, 8, 2, 1},  // 0.8
		{0.07, 8, 2, 2},  // 1.1
		{0.125, 8, 2, 2}, // 2
		{0.13, 8, 2, 4},  // 2.1
		{0.3, 8, 2, 8},   // 4.8
		{1, 8, 2, 8},
		{1, 3, 2, 3}, // at most n
		{0.5, 3, 2, 3},
		{0.2, 3, 2, 2}, // 1.2
	}
	for _, tt := range tests {
		if got := homeSize(tt.share, tt.n, tt.spread); got != tt.want {
			t.Errorf("homeSize(%g, %d, %g) = %d, want %d", tt.share, tt.n, tt.spread, got, tt.want)
		}
	}
}

func TestSharesFollowTheMix(t *testing.T) {
	s := newShares()
	var hot, cold float64
	for i := range 5000 {
		switch {
		case i%4 == 0:
			hot = s.note(xxhash.Sum64String("hot")) // a quarter of the requests
		case i%100 == 1:
			cold = s.note(xxhash.Sum64String("cold")) // one in a hundred
		default:
			s.note(xxhash.Sum64String(fmt.Sprint("one-shot ", i)))
		}
		// A replica that has just started underestimates for its first few
		// hundred requests, not for a whole window: behind eight replicas a
		// window of one is eight of the pool's.
		if i == 400 && (hot < 0.2 || hot > 0.25) {
			t.Errorf("after 400 requests, a quarter share estimated %.3f (want 0.2 to 0.25)", hot)
		}
	}
	if math.Abs(hot-0.25) > 0.02 || math.Abs(cold-0.01) > 0.005 {
		t.Errorf("shares: hot %.3f (want 0.25), cold %.3f (want 0.01)", hot, cold)
	}
	// The mix changes: the hot key stops, and within some thousands of
	// requests its share is forgotten.
	for i := range 3000 {
		s.note(xxhash.Sum64String(fmt.Sprint("later ", i)))
	}
	if got := s.note(xxhash.Sum64String("hot")); got > 0.02 {
		t.Errorf("a key gone for 3000 requests still has a share of %.3f", got)
	}
	// Memory stays bounded however many distinct keys come.
	for i := range 2 * sharesMax {
		s.note(xxhash.Sum64String(fmt.Sprint("many ", i)))
	}
	if len(s.counts) > sharesMax {
		t.Errorf("%d keys kept, more than %d", len(s.counts), sharesMax)
	}
}

// One-shot questions under a system prompt shorter than the key (an agent,
// a RAG template) go to one endpoint on every replica, whatever the
// question; the system prompts spread over the endpoints. A prefix with a
// large share of the traffic gets a home set of several endpoints, and each
// conversation under it keeps one of them.
func TestRequestsSharingASystemPromptMeet(t *testing.T) {
	_, pick := replicasInTurn(t)
	system := func(i int) string {
		return fmt.Sprintf("You are agent %d. ", i) + strings.Repeat("Follow the house rules. ", 40)
	}
	where := map[string]map[string]int{} // system prompt → endpoint → requests
	// 11 of them: a number prime to the replicas', so that each replica
	// sees every system prompt, as behind a round robin.
	for q := range 20 {
		for s := range 11 {
			question := fmt.Sprintf("Question %d for agent %d: what changed since yesterday?", q, s)
			sent(where, fmt.Sprint("agent ", s), pick(conversation(system(s), question)))
		}
	}
	if homes := homesOf(t, where); len(homes) < 2 {
		t.Errorf("11 system prompts all went to %v", homes)
	}

	// A hot system prompt, now the most of the traffic: its new
	// conversations spread, and a later turn follows its first on whichever
	// replica it reaches.
	hot := map[string]int{}
	for c := range 300 {
		q := fmt.Sprintf("Conversation %d starts here.", c)
		first := pick(conversation(system(99), q))
		hot[first]++
		if got := pick(conversation(system(99), q, "An answer.", "And a follow-up?")); got != first {
			t.Errorf("conversation %d: turn 2 went to %s, turn 1 to %s", c, got, first)
		}
	}
	if len(hot) < 2 {
		t.Errorf("300 conversations of the hot system prompt all went to %v", hot)
	}
}

// replicasInTurn are three replicas of a prefix-affinity pool of four
// endpoints, and pick, which sends each request to the next of them, as
// Envoy's round robin hands them the streams, and returns where it went.
func replicasInTurn(t *testing.T) (replicas []*Pool, pick func(*Request) string) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity}
	replicas = make([]*Pool, 3)
	for i := range replicas {
		replicas[i], _ = testPool(t, sched, addrs...)
	}
	picked := 0
	return replicas, func(req *Request) string {
		t.Helper()
		e, err := replicas[picked%len(replicas)].Select(req)
		picked++
		if err != nil {
			t.Fatal(err)
		}
		return e.Addr
	}
}

// sent counts a request of group that went to endpoint in where (group →
// endpoint → requests).
func sent(where map[string]map[string]int, group, endpoint string) {
	if where[group] == nil {
		where[group] = map[string]int{}
	}
	where[group][endpoint]++
}

// homesOf says each group's questions in where should have gone to one
// endpoint, and returns those endpoints.
func homesOf(t *testing.T, where map[string]map[string]int) map[string]bool {
	t.Helper()
	homes := map[string]bool{}
	for g, eps := range where {
		if len(eps) != 1 {
			t.Errorf("%s's questions went to %v, want one endpoint", g, eps)
		}
		for e := range eps {
			homes[e] = true
		}
	}
	return homes
}

// TestNamespacesRankApart: requests alike in text but for another LoRA
// adapter or under another cache_salt share no cache on the engine, so
// they rank as different prompts: one system prompt's questions for 12
// tenants (salts) meet per tenant, on every replica, and spread over the
// pool; and a replica's memory of where one tenant's prompt went says
// nothing of another's.
func TestNamespacesRankApart(t *testing.T) {
	replicas, pick := replicasInTurn(t)
	system := strings.Repeat("Follow the house rules. ", 40)
	request := func(model, salt, question string) *Request {
		t.Helper()
		b, _ := json.Marshal(map[string]any{"model": model, "cache_salt": salt,
			"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": question}}})
		obj, err := body.Parse(b)
		if err != nil {
			t.Fatal(err)
		}
		return NewRequest(api.Chat.PromptOf(obj, api.VLLM))
	}
	where := map[string]map[string]int{} // tenant → endpoint → requests
	for tenant := range 12 {
		salt := fmt.Sprintf("tenant-%d", tenant)
		for q := range 3 {
			sent(where, salt, pick(request("base", salt, fmt.Sprintf("Question %d?", q))))
		}
	}
	if homes := homesOf(t, where); len(homes) < 3 {
		t.Errorf("12 tenants' prompts went to %v, want them spread over at least 3 endpoints", homes)
	}
	adapters := map[string]bool{}
	for _, model := range []string{"base", "sql-lora", "chat-lora", "code-lora", "math-lora", "law-lora"} {
		adapters[pick(request(model, "", "Which adapter am I?"))] = true
	}
	if len(adapters) < 2 {
		t.Errorf("six adapters' prompts all went to %v", adapters)
	}

	first := func(r *Request) uint64 {
		return replicas[0].state.Load().picker.(*prefixAffinity).index.hashes(r.namespace(), r.Prompt())[0]
	}
	if first(request("base", "tenant-0", "?")) != first(request("base", "tenant-0", "!")) ||
		first(request("base", "tenant-0", "?")) == first(request("base", "tenant-1", "?")) {
		t.Error("the memory's first block of a tenant's prompt should be its own, alike for its requests")
	}
}

// TestEventsPlaceRequestsOnHolders: with the engines' KV events, a request
// that starts a conversation goes to the engine holding its system prompt
// only while that engine is no busier than the mean; else it is placed as
// without events. A later turn follows the engine holding its history, busy
// or not, within the usual bounds. Neither goes by the view of an engine
// whose requests failed since it last served one (down, perhaps, its view
// still showing what it held).
func TestEventsPlaceRequestsOnHolders(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity}
	system := strings.Repeat("Answer in French, and cite the page you read it on. ", 40)
	first := []simMessage{{"system", system}, {"user", "Who wrote Candide?"}}
	later := append(slices.Clip(first), simMessage{"assistant", "Voltaire."}, simMessage{"user", "When?"})
	tokens := make([]int64, 1_024)
	for i := range tokens {
		tokens[i] = int64(i*7919) % 150_000
	}
	request := func(msgs []simMessage) *Request {
		req := chatRequest(msgs)
		req.SetTokens(tokens)
		return req
	}
	pick := func(p *Pool, req *Request, busy string, inflight int) string {
		t.Helper()
		for _, e := range p.Endpoints() {
			if e.Addr == busy {
				for range inflight {
					defer acquire(e)()
				}
			}
		}
		e, err := p.Select(req)
		if err != nil {
			t.Fatal(err)
		}
		return e.Addr
	}
	// The holder is an endpoint the ranking does not pick, so that going
	// there is the events' doing.
	withoutEvents, _ := testPool(t, sched, addrs...)
	ranked := pick(withoutEvents, request(first), "", 0)
	holder := addrs[(slices.Index(addrs, ranked)+1)%len(addrs)]
	// Two that hold the same start (a system prompt, a history evicted past
	// it): the later turn's first in the ranking, and another.
	fresh, _ := testPool(t, sched, addrs...)
	rankedLater := pick(fresh, request(later), "", 0)
	other := addrs[(slices.Index(addrs, rankedLater)+1)%len(addrs)]

	type health int // the holder's record
	const (
		serving   health = iota
		failed           // a request failed, none served since
		recovered        // a request failed, then one was served
	)
	tests := []struct {
		name     string
		msgs     []simMessage
		inflight int // the holder's requests in flight; the others have none
		health   health
		want     string
		// tied: rankedLater and other hold the prompt's start alike (no
		// holder), and inflight is rankedLater's.
		tied bool
		// rewrite: the seconds in which the holder's engine writes its
		// cache over, by its scrapes; 0: not scraped.
		rewrite float64
		pool    string // decode, or prefill (a P/D prefill pool)
	}{
		{"a first request, the holder idle", first, 0, serving, holder, false, 0, "decode"},
		{"a first request, the holder busier than the mean", first, 3, serving, ranked, false, 0, "decode"},
		{"a first request, the holder busier than the mean, its cache written over in 10 s", first, 3, serving, ranked, false, 10, "decode"},
		{"a first request, the holder busier than the mean, its cache written over in 10 min", first, 3, serving, holder, false, 600, "decode"},
		{"a first request on a P/D prefill pool, the holder busier than the mean, its cache written over in 10 min", first, 3, serving, ranked, false, 600, "prefill"},
		{"a later turn, its history's holder idle", later, 0, serving, holder, false, 0, "decode"},
		{"a later turn, its history's holder busier than the mean", later, 3, serving, holder, false, 0, "decode"},
		{"a first request, the holder failing", first, 0, failed, ranked, false, 0, "decode"},
		{"a later turn, its history's holder failing", later, 0, failed, ranked, false, 0, "decode"},
		{"a later turn, its history's holder serving again", later, 0, recovered, holder, false, 0, "decode"},
		{"a later turn two hold alike, the ranking's idle", later, 0, serving, rankedLater, true, 0, "decode"},
		{"a later turn two hold alike, the ranking's busier", later, 1, serving, other, true, 0, "decode"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sched := sched
			if tt.rewrite > 0 {
				sched.Metrics = config.EngineMetrics{Interval: config.Duration(time.Second), StaleAfter: config.Duration(3 * time.Second)}
			}
			p, clock := testPoolNamed(t, tt.pool, sched, addrs...)
			if tt.rewrite > 0 {
				e := byAddr(p, holder)
				e.observe(Load{CacheTokens: 9000, At: clock.Now()})
				clock.Advance(15 * time.Second)
				e.observe(Load{CacheTokens: 9000, Written: 9000 / tt.rewrite * 15, At: clock.Now()})
			}
			index := kvevents.NewIndex(kvevents.Bounds{}, time.Minute, nil)
			hashes := make([]uint64, 512/16)
			for j := range hashes {
				hashes[j] = uint64(j + 1)
			}
			holders, busy := []string{holder}, holder
			if tt.tied {
				holders, busy = []string{rankedLater, other}, rankedLater
			}
			for _, a := range addrs {
				if slices.Contains(holders, a) {
					index.Apply(kvevents.Publisher{Endpoint: a}, []kvevents.Event{{Kind: kvevents.Stored, Hashes: hashes, Tokens: tokens[:512], BlockSize: 16}})
				} else {
					index.Reset(kvevents.Publisher{Endpoint: a}, true)
				}
			}
			p.events.Store(&poolEvents{index: index})
			if tt.health != serving {
				byAddr(p, holder).ReportFailure()
			}
			if tt.health == recovered {
				byAddr(p, holder).ReportSuccess()
			}
			if got := pick(p, request(tt.msgs), busy, tt.inflight); got != tt.want {
				t.Errorf("picked %s, want %s (holders %v, ranking's %s)", got, tt.want, holders, ranked)
			}
		})
	}
}

// TestDecodeQueueBoundWithoutATrustedView: a P/D decode pool left at the
// default queue_slack passes over an engine queued 2 above the mean when it
// follows KV events it trusts (1), and keeps it when it places the request
// by its estimates (4): following no events, or events its engines never
// published (started without them) or stopped publishing.
func TestDecodeQueueBoundWithoutATrustedView(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000"}
	msgs := []simMessage{{"system", strings.Repeat("Answer in French. ", 40)}, {"user", "Who wrote Candide?"}}
	request := func() *Request {
		req := chatRequest(msgs)
		req.SetTokens(simTokens(req.Prompt()))
		return req
	}
	tests := []struct {
		name   string
		events bool
		silent bool // every engine silent past stale_after since it was sent work
		spills bool
	}{
		{"no KV events", false, false, false},
		{"KV events, trusted", true, false, true},
		{"KV events, every engine silent", true, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}
			if tt.events {
				sched.KVEvents.ConnectPort = 5557
			}
			sched.SetDecodeDefaults(config.PDAuto)
			p, clock := testPool(t, sched, addrs...)
			if tt.events {
				index := kvevents.NewIndex(kvevents.Bounds{}, time.Minute, clock.Now)
				for _, a := range addrs {
					index.Reset(kvevents.Publisher{Endpoint: a}, true)
					if tt.silent {
						index.Expect(a, 0, 256)
					}
				}
				p.events.Store(&poolEvents{index: index})
				clock.Advance(61 * time.Second)
			}
			first, err := p.Select(request())
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range p.Endpoints() {
				waiting := 0.0
				if e == first {
					waiting = 3 // the mean is 1.5
				}
				e.observe(Load{Waiting: waiting, At: clock.Now()})
			}
			got, err := p.Select(request())
			if err != nil {
				t.Fatal(err)
			}
			if spilled := got != first; spilled != tt.spills {
				t.Errorf("picked %s (first %s): spilled %v, want %v", got.Addr, first.Addr, spilled, tt.spills)
			}
		})
	}
}

// TestClientCoveragesAreBounded: the counts per client address keep at most
// maxClients addresses, forgetting the least recently seen, which then
// starts again untrusted; the others keep their counts.
func TestClientCoveragesAreBounded(t *testing.T) {
	var c clientCoverages
	for range 10 { // whole: every later turn's previous request was routed here
		c.of("kept").note(true, true)
		c.of("forgotten").note(true, true)
	}
	c.of("kept") // seen more recently than "forgotten"
	for i := range maxClients - 1 {
		c.of(fmt.Sprint("client-", i))
	}
	tests := []struct {
		client string
		whole  bool
	}{
		{"kept", true},
		{"forgotten", false},
	}
	for _, tt := range tests {
		if whole := c.of(tt.client).note(false, false); whole != tt.whole {
			t.Errorf("%s: whole %v, want %v", tt.client, whole, tt.whole)
		}
	}
	if n := c.lru.Len(); n != maxClients {
		t.Errorf("%d addresses counted, want at most %d", n, maxClients)
	}
}

// TestACompletionsPromptGoesToTheHolderThatServesItSoonest: of the engines
// whose KV events show them holding a completions prompt's start alike, the
// one whose busyness, the request counted, over its engine's prefill pace
// (by its scrapes, against the candidates' mean) is least.
func TestACompletionsPromptGoesToTheHolderThatServesItSoonest(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	first, second := addrs[1], addrs[2] // the holders, in the pool's order
	tokens := make([]int64, 1_024)
	for i := range tokens {
		tokens[i] = int64(i*7919) % 150_000
	}
	tests := []struct {
		name string
		// paces: the prompt tokens a second each engine computed while it
		// prefilled, by two scrapes 15 s apart; nil: not scraped, and an
		// engine left out finished no prefill between them.
		paces    map[string]float64
		inflight map[string]int
		want     string
	}{
		{"not scraped, both idle: the first", nil, nil, first},
		{"not scraped, the first busier", nil, map[string]int{first: 1}, second},
		{"equal paces, both idle: the first", map[string]float64{addrs[0]: 1000, first: 1000, second: 1000, addrs[3]: 1000}, nil, first},
		{"both idle, the second twice as fast", map[string]float64{addrs[0]: 1000, first: 1000, second: 2000, addrs[3]: 1000}, nil, second},
		{"the second twice as fast, busier by 2", map[string]float64{addrs[0]: 1000, first: 1000, second: 2000, addrs[3]: 1000}, map[string]int{second: 2}, first},
		{"the second three times as fast, busier by 1", map[string]float64{addrs[0]: 1000, first: 1000, second: 3000, addrs[3]: 1000}, map[string]int{second: 1}, second},
		{"only the second's pace known: no faster than the mean", map[string]float64{second: 2000}, nil, first},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity,
				Metrics: config.EngineMetrics{Interval: config.Duration(time.Second), StaleAfter: config.Duration(3 * time.Second)}}
			p, clock := testPool(t, sched, addrs...)
			if tt.paces != nil {
				for _, e := range p.Endpoints() {
					e.observe(Load{At: clock.Now()})
				}
				clock.Advance(15 * time.Second)
				for _, e := range p.Endpoints() {
					l := Load{At: clock.Now()}
					if pace, ok := tt.paces[e.Addr]; ok {
						l.Computed, l.Prefilling = pace, 1
					}
					e.observe(l)
				}
			}
			index := kvevents.NewIndex(kvevents.Bounds{}, time.Minute, nil)
			hashes := make([]uint64, 512/16)
			for j := range hashes {
				hashes[j] = uint64(j + 1)
			}
			for _, a := range addrs {
				if a == first || a == second {
					index.Apply(kvevents.Publisher{Endpoint: a}, []kvevents.Event{{Kind: kvevents.Stored, Hashes: hashes, Tokens: tokens[:512], BlockSize: 16}})
				} else {
					index.Reset(kvevents.Publisher{Endpoint: a}, true)
				}
			}
			p.events.Store(&poolEvents{index: index})
			for a, n := range tt.inflight {
				for range n {
					defer acquire(byAddr(p, a))()
				}
			}
			req := promptRequest(strings.Repeat("The minutes of the board's meeting, page by page. ", 60) + "What was decided?")
			req.SetTokens(tokens)
			e, err := p.Select(req)
			if err != nil {
				t.Fatal(err)
			}
			if e.Addr != tt.want {
				t.Errorf("picked %s, want %s", e.Addr, tt.want)
			}
		})
	}
}

// TestACompletionsPromptGoesToTheHomeMemberThatServesItSoonest: without
// KV events, a completions prompt whose start this replica remembers
// sending to several members of its prefix's home set goes to the one that
// would serve it soonest: its busyness, the request counted, over its
// engine's prefill pace; of equals, the ranking's first.
func TestACompletionsPromptGoesToTheHomeMemberThatServesItSoonest(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	document := strings.Repeat("The minutes of the board's meeting, page by page. ", 400) // past the 16 KiB key
	question := func(i int) *Request {
		return promptRequest(document + fmt.Sprintf("Question %d: what was decided?", i))
	}
	// picks sends twelve questions once the document's share of the traffic
	// has grown its home set to the whole pool and every engine holds it,
	// fast prefilling three times as fast as the others ("": none scraped)
	// with inflight requests in flight.
	picks := func(t *testing.T, fast string, inflight int) map[string]int {
		sched := config.PoolScheduling{Policy: config.PolicyPrefixAffinity,
			Metrics: config.EngineMetrics{Interval: config.Duration(time.Second), StaleAfter: config.Duration(3 * time.Second)}}
		p, clock := testPool(t, sched, addrs...)
		for i := range 40 {
			if _, err := p.Select(question(i)); err != nil {
				t.Fatal(err)
			}
		}
		aff, warm := p.state.Load().picker.(*prefixAffinity), question(0)
		for _, e := range p.Endpoints() {
			aff.record(warm.Prompt(), aff.index.hashes(warm.namespace(), warm.Prompt()), e)
		}
		if fast != "" {
			for _, e := range p.Endpoints() {
				e.observe(Load{At: clock.Now()})
			}
			clock.Advance(15 * time.Second)
			for _, e := range p.Endpoints() {
				e.observe(Load{Computed: cmp.Or(map[string]float64{fast: 3000}[e.Addr], 1000), Prefilling: 1, At: clock.Now()})
			}
			for range inflight {
				defer acquire(byAddr(p, fast))()
			}
		}
		got := map[string]int{}
		for i := range 12 {
			e, err := p.Select(question(100 + i))
			if err != nil {
				t.Fatal(err)
			}
			got[e.Addr]++
		}
		return got
	}
	var first string // the ranking's
	for a := range picks(t, "", 0) {
		first = a
	}
	fast := addrs[(slices.Index(addrs, first)+1)%len(addrs)]
	tests := []struct {
		name     string
		fast     string
		inflight int
		want     map[string]int
	}{
		{"not scraped: the ranking's first", "", 0, map[string]int{first: 12}},
		{"another engine three times as fast: all to it", fast, 0, map[string]int{fast: 12}},
		{"that engine three requests busy: the ranking's first", fast, 3, map[string]int{first: 12}},
		{"the ranking's first three times as fast", first, 0, map[string]int{first: 12}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := picks(t, tt.fast, tt.inflight); !maps.Equal(got, tt.want) {
				t.Errorf("picked %v, want %v", got, tt.want)
			}
		})
	}
}

// TestPrefillTurnsRankOverThePoolWhileItsEnginesKeep: a P/D prefill pool
// ranks later turns over the whole pool only while its engines keep what
// they write for 30 s or more, by their scrapes: every engine whose scrapes
// tell (one that just joined does not), and one at least. Where one writes
// its cache over sooner, histories are not kept, and a later turn is ranked
// in its prefix's home set, which holds the system prompt.
func TestPrefillTurnsRankOverThePoolWhileItsEnginesKeep(t *testing.T) {
	tests := []struct {
		name    string
		rewrite []float64 // seconds each engine takes to write its cache over; 0: its scrapes do not tell
		want    bool
	}{
		{"every engine in 40 s", []float64{40, 40, 40, 40}, true},
		{"one in 10 s", []float64{40, 600, 10, 40}, false},
		{"one that does not tell yet", []float64{40, 40, 40, 0}, true},
		{"none tells", []float64{0, 0, 0, 0}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var addrs []string
			for i := range tt.rewrite {
				addrs = append(addrs, fmt.Sprintf("10.0.1.%d:8000", i+1))
			}
			pool, clock := testPool(t, config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}, addrs...)
			eps := pool.Endpoints()
			for i, e := range eps {
				if tt.rewrite[i] > 0 {
					e.observe(Load{CacheTokens: 9000, At: clock.Now()})
				}
			}
			clock.Advance(15 * time.Second)
			for i, e := range eps {
				if tt.rewrite[i] > 0 {
					e.observe(Load{CacheTokens: 9000, Written: 9000 / tt.rewrite[i] * 15, At: clock.Now()})
				}
			}
			if got := keepTurns(eps); got != tt.want {
				t.Errorf("keepTurns = %v, want %v", got, tt.want)
			}
		})
	}
}
