package scheduling

import (
	"maps"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/config"
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
	ab, abc, xbc := x.hashes(blocks("ab")), x.hashes(blocks("abc")), x.hashes(blocks("xbc"))
	if len(ab) != 2 || len(abc) != 3 || len(x.hashes(blocks("ab")+"partial")) != 2 || x.hashes("short") != nil {
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
		{name: "a chain's head outlives its tail", capacity: 3,
			served: []struct{ prompt, addr string }{{blocks("xyz"), "e2"}, {blocks("a"), "e1"}},
			prompt: blocks("xyz"), want: map[string]int{"e2": 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := newPrefixIndex(16, tt.capacity)
			for _, s := range tt.served {
				x.record(x.hashes(s.prompt), s.addr)
			}
			if got := x.matched(x.hashes(tt.prompt)); !maps.Equal(got, tt.want) {
				t.Fatalf("matched() = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestPrefixAffinityPick(t *testing.T) {
	// Endpoints a, b, c, d; bound = 1.5 × mean busyness + 2. Least load is
	// two-choices over the endpoints within the bound, and testPool's draws
	// make the pair the first two of them.
	tests := []struct {
		name     string
		served   []struct{ prompt, addr string }
		inflight []int
		prompt   string
		want     string
	}{
		{name: "no full block: least load", inflight: []int{3, 1, 2, 2}, prompt: "short", want: "b"},
		{name: "least load stays within the bound", inflight: []int{9, 1, 0, 0}, prompt: blocks("abc"), want: "c"}, // bound 5.75; pair b, c
		{name: "no match: least load", inflight: []int{3, 1, 2, 2}, prompt: blocks("abc"), want: "b"},
		{name: "the endpoint that served the prefix, though busier",
			served: []struct{ prompt, addr string }{{blocks("abc"), "c"}}, inflight: []int{3, 1, 4, 2}, prompt: blocks("abcd"), want: "c"},
		{name: "the longest match wins",
			served:   []struct{ prompt, addr string }{{blocks("ab"), "a"}, {blocks("abc"), "d"}},
			inflight: []int{0, 0, 0, 1}, prompt: blocks("abcd"), want: "d"},
		{name: "equal matches: the less busy",
			served:   []struct{ prompt, addr string }{{blocks("ab"), "a"}, {blocks("ab"), "c"}},
			inflight: []int{3, 0, 2, 0}, prompt: blocks("abx"), want: "c"},
		{name: "over the bound: the next best match",
			served:   []struct{ prompt, addr string }{{blocks("ab"), "a"}, {blocks("abc"), "d"}},
			inflight: []int{2, 0, 0, 8}, prompt: blocks("abcd"), want: "a"}, // mean 2.5, bound 5.75
		{name: "every match over the bound: least load",
			served:   []struct{ prompt, addr string }{{blocks("abc"), "d"}},
			inflight: []int{1, 2, 0, 9}, prompt: blocks("abcd"), want: "a"}, // mean 3, bound 6.5; pair a, b
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, _ := testPool(t, config.PoolScheduling{Policy: config.PolicyPrefixAffinity,
				Prefix: config.PrefixAffinity{BlockChars: 16, LoadFactor: 1.5, LoadSlack: 2}}, "a", "b", "c", "d")
			aff := p.state.Load().picker.(*prefixAffinity)
			for _, s := range tt.served {
				aff.index.record(aff.index.hashes(s.prompt), s.addr)
			}
			eps := p.Endpoints()
			for i, n := range tt.inflight {
				for range n {
					eps[i].Acquire()
				}
			}
			got, err := p.Select(promptRequest(tt.prompt))
			if err != nil {
				t.Fatal(err)
			}
			if got.Addr != tt.want {
				t.Fatalf("Select() = %s, want %s", got.Addr, tt.want)
			}
			if m := aff.index.matched(aff.index.hashes(tt.prompt)); m[got.Addr] != len(tt.prompt)/16 {
				t.Errorf("the pick was not remembered: matched = %v", m)
			}
		})
	}
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
		e.Acquire() // none finish: load only grows
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
