package scheduling

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

func TestDecide(t *testing.T) {
	long := `{"model":"m","prompt":"` + strings.Repeat("x", 400) + `"}` // 100 tokens at 4 characters each
	tests := []struct {
		name        string
		pd          config.PD
		paired      bool // SGLang engines
		body        string
		alone       metrics.Reason // the API's reason to go decode-only
		prefillDown bool
		want        Split
	}{
		{name: "defaults: everything is P/D", body: `{"model":"m","prompt":"hi"}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "at the threshold", pd: config.PD{MinPromptTokens: 100}, body: long, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "below the threshold", pd: config.PD{MinPromptTokens: 101}, body: long, want: Split{Reason: metrics.ReasonShortPrompt}},
		{name: "another characters-per-token ratio", pd: config.PD{MinPromptTokens: 101, CharsPerToken: 2}, body: long, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "a ratio that is no whole number rounds up", pd: config.PD{MinPromptTokens: 668, CharsPerToken: 1.5},
			body: `{"model":"m","prompt":"` + strings.Repeat("字", 1001) + `"}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "token ids count exactly", pd: config.PD{MinPromptTokens: 3}, body: `{"model":"m","prompt":[1,2,3]}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "too few token ids", pd: config.PD{MinPromptTokens: 4}, body: `{"model":"m","prompt_token_ids":[1,2,3]}`, want: Split{Reason: metrics.ReasonShortPrompt}},
		{name: "always ignores the threshold", pd: config.PD{Mode: config.PDAlways, MinPromptTokens: 1000}, body: long, want: Split{PD: true, Reason: metrics.ReasonAlways}},
		{name: "never", pd: config.PD{Mode: config.PDNever}, body: long, want: Split{Reason: metrics.ReasonNever}},
		{name: "n > 1 is decode-only even when always", pd: config.PD{Mode: config.PDAlways}, body: `{"model":"m","n":2,"prompt":"hi"}`, want: Split{Reason: metrics.ReasonNGT1}},
		{name: "n = 1 is fine", body: `{"model":"m","n":1,"prompt":"hi"}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "a batch is decode-only", body: `{"model":"m","prompt":["a","b"]}`, want: Split{Reason: metrics.ReasonBatch}},
		{name: "no healthy prefill", body: long, prefillDown: true, want: Split{Reason: metrics.ReasonNoPrefill}},
		{name: "no healthy prefill when always", pd: config.PD{Mode: config.PDAlways}, body: long, prefillDown: true, want: Split{Reason: metrics.ReasonNoPrefill}},
		{name: "paired engines hand off n > 1 themselves", paired: true, body: `{"model":"m","n":2,"prompt":"hi"}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "paired engines hand off a batch", paired: true, body: `{"model":"m","prompt":["a","b"]}`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "paired engines without a prefill", paired: true, body: long, prefillDown: true, want: Split{Reason: metrics.ReasonNoPrefill}},
		{name: "the API's reason comes first", pd: config.PD{Mode: config.PDAlways}, alone: metrics.ReasonPassthrough, body: long, prefillDown: true, want: Split{Reason: metrics.ReasonPassthrough}},
		{name: "a short prompt says so even with prefill down", pd: config.PD{MinPromptTokens: 1000}, body: long, prefillDown: true, want: Split{Reason: metrics.ReasonShortPrompt}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			obj, err := body.Parse([]byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			prefill := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"10.0.0.1:8000"}}}, Deps{}).Prefill
			if tt.prefillDown {
				for range 3 {
					prefill.Endpoints()[0].ReportFailure()
				}
			}
			req := NewRequest(completions(obj))
			req.Alone = tt.alone
			if got := newDecider(Spec{PD: tt.pd, Paired: tt.paired}).Decide(req, prefill, nil, nil); got != tt.want {
				t.Fatalf("Decide() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestDecideWithoutPrefillPool(t *testing.T) {
	if got := newDecider(Spec{}).Decide(nil, nil, nil, nil); got.PD || got.Reason != metrics.ReasonNoPrefill {
		t.Fatalf("Decide(nil, nil, nil) = %+v, want decode-only for lack of prefill", got)
	}
	empty := NewPools(Spec{}, Deps{}).Prefill
	if got := newDecider(Spec{}).Decide(promptRequest("hi"), empty, nil, nil); got.Reason != metrics.ReasonNoPrefill {
		t.Fatalf("Decide() with an empty prefill pool = %+v", got)
	}
}

// TestDecideOnWhatTheDecodeEndpointHolds: a conversation's later turn whose
// decode endpoint holds its history goes decode-only, on the replica that
// routed the turn before and on one that never saw it; the load arm sends
// a request decode-only while prefill is busy, and a busy decode endpoint
// vetoes both.
func TestDecideOnWhatTheDecodeEndpointHolds(t *testing.T) {
	const system = 2000 // characters: 500 tokens
	ints := func(n int) *int { return &n }
	turn1 := []simMessage{{"system", strings.Repeat("s", system)}, {"user", strings.Repeat("a", 400)}}
	turn2 := func(user int) []simMessage {
		return append(slices.Clip(turn1), simMessage{"assistant", strings.Repeat("b", 400)}, simMessage{"user", strings.Repeat("c", user)})
	}
	tests := []struct {
		name     string
		pd       config.PD
		policy   string // the decode pool's; default prefix-affinity
		paired   bool
		seen     bool // this replica routed turn 1
		turn     []simMessage
		prefillQ float64 // every prefill engine's scraped queue
		decodeQ  float64 // the decode endpoint's
		belied   bool    // its answers belied the estimate three times
		want     Split
	}{
		{name: "a first turn holds nothing", turn: turn1, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "a later turn, on the replica that routed the turn before", seen: true, turn: turn2(200), want: Split{Reason: metrics.ReasonCachedPrefix}},
		{name: "a later turn, on a replica that never saw the conversation", turn: turn2(200), want: Split{Reason: metrics.ReasonCachedPrefix}},
		{name: "an endpoint whose answers belied the estimate", seen: true, turn: turn2(200), belied: true, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "a new part of min_uncached_tokens or more", seen: true, turn: turn2(4 * config.DefaultMinUncachedTokens), want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "min_uncached_tokens below the new part", pd: config.PD{MinUncachedTokens: ints(40)}, seen: true, turn: turn2(200), want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "min_uncached_tokens 0 turns the rule off", pd: config.PD{MinUncachedTokens: ints(0)}, seen: true, turn: turn2(200), want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "max_uncached_ratio bounds the uncached share", pd: config.PD{MaxUncachedRatio: 0.01}, seen: true, turn: turn2(200), want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "off by default under another decode policy", policy: config.PolicyLeastLoad, seen: true, turn: turn2(200), want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "always stays P/D", pd: config.PD{Mode: config.PDAlways}, seen: true, turn: turn2(200), want: Split{PD: true, Reason: metrics.ReasonAlways}},
		{name: "paired engines never go decode-only", paired: true, seen: true, turn: turn2(200), want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "prefill busy, decode idle", pd: config.PD{Load: config.PDLoad{PrefillQueue: 4}}, turn: turn1, prefillQ: 4, want: Split{Reason: metrics.ReasonPrefillBusy}},
		{name: "prefill below its busy line", pd: config.PD{Load: config.PDLoad{PrefillQueue: 4}}, turn: turn1, prefillQ: 3, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "prefill busy, decode busy too", pd: config.PD{Load: config.PDLoad{PrefillQueue: 4}}, turn: turn1, prefillQ: 4, decodeQ: 1, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "a busy decode endpoint vetoes the cache rule", pd: config.PD{Load: config.PDLoad{PrefillQueue: 4, DecodeQueue: 2}}, seen: true, turn: turn2(200), decodeQ: 2, want: Split{PD: true, Reason: metrics.ReasonDecodeBusy}},
		{name: "below decode_queue the cache rule stands", pd: config.PD{Load: config.PDLoad{PrefillQueue: 4, DecodeQueue: 2}}, seen: true, turn: turn2(200), decodeQ: 1, want: Split{Reason: metrics.ReasonCachedPrefix}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			policy := cmp.Or(tt.policy, config.PolicyPrefixAffinity)
			scrape := config.EngineMetrics{Interval: config.Duration(time.Second)}
			spec := Spec{
				Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000", "10.0.1.2:8000"}, PoolScheduling: config.PoolScheduling{Metrics: scrape}},
				Decode: PoolSpec{Endpoints: []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"},
					PoolScheduling: config.PoolScheduling{Policy: policy, Metrics: scrape}},
				PD: tt.pd, Paired: tt.paired,
			}
			ps := NewPools(spec, Deps{})
			for _, e := range ps.Prefill.Endpoints() {
				e.observe(Load{Waiting: tt.prefillQ, At: time.Now()})
			}
			if tt.seen {
				if _, err := ps.Decode.Select(chatRequest(turn1)); err != nil {
					t.Fatal(err)
				}
			}
			req := chatRequest(tt.turn)
			e, err := ps.Decode.Select(req)
			if err != nil {
				t.Fatal(err)
			}
			e.observe(Load{Waiting: tt.decodeQ, At: time.Now()})
			for range trustMisses {
				if tt.belied {
					e.ReportCached(500, 0, true)
				}
			}
			if got := ps.Decide(req, e); got.PD != tt.want.PD || got.Reason != tt.want.Reason {
				t.Fatalf("Decide() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// TestHeldIsOfTheEndpointPicked: the estimate is of the endpoint the policy
// picked, not of another the caller passes.
func TestHeldIsOfTheEndpointPicked(t *testing.T) {
	p, _ := testPool(t, policy(config.PolicyPrefixAffinity), "10.0.0.1:8000", "10.0.0.2:8000")
	turn1 := []simMessage{{"system", strings.Repeat("s", 2000)}, {"user", "hi"}}
	first, _ := p.Select(chatRequest(turn1))
	req := chatRequest(append(turn1, simMessage{"assistant", "hello"}, simMessage{"user", "and?"}))
	e, _ := p.Select(req)
	other := p.Endpoints()[0]
	if other == e {
		other = p.Endpoints()[1]
	}
	if e != first || req.Held(e) < len(req.Previous()) || req.Previous() == "" || req.Held(other) != 0 || req.Held(nil) != 0 {
		t.Fatalf("Held = %d on the endpoint picked (%v, first %v), %d on another; want at least %d, and 0",
			req.Held(e), e.Addr, first.Addr, req.Held(other), len(req.Previous()))
	}
}

// TestALaterTurnIsNotAssumedWhereItsRankingMoved: a later turn's endpoint
// is assumed to hold the previous request only while the ranking that sent
// it there stands. When the endpoint that held the conversation is ejected,
// taken down by its checks or removed, when one joins that now ranks first,
// or when the endpoint has failed requests since it served (it may have
// restarted), the endpoint the turn ranks first now never got its history:
// decode-only there would recompute it all on a decode engine. So the turn
// goes P/D, on the replica that routed the turn before and on another.
func TestALaterTurnIsNotAssumedWhereItsRankingMoved(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}
	spec := func(addrs []string) Spec {
		return Spec{Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000"}},
			Decode: PoolSpec{Endpoints: addrs, PoolScheduling: config.PoolScheduling{Policy: config.PolicyPrefixAffinity}}}
	}
	turn1 := []simMessage{{"system", strings.Repeat("s", 2000)}, {"user", strings.Repeat("a", 400)}}
	turn2 := append(slices.Clip(turn1), simMessage{"assistant", strings.Repeat("b", 400)}, simMessage{"user", strings.Repeat("c", 200)})
	// newcomer is an address that, joining the pool, ranks first for turn 2.
	newcomer := func(t *testing.T) string {
		for i := 5; i < 64; i++ {
			a := fmt.Sprintf("10.0.0.%d:8000", i)
			if e, _ := NewPools(spec(append(slices.Clone(addrs), a)), Deps{}).Decode.Select(chatRequest(turn2)); e.Addr == a {
				return a
			}
		}
		t.Fatal("no address takes turn 2 over")
		return ""
	}
	tests := []struct {
		name   string
		change func(t *testing.T, ps *Pools, holder *Endpoint)
		want   Split
	}{
		{"nothing changed", func(*testing.T, *Pools, *Endpoint) {}, Split{Reason: metrics.ReasonCachedPrefix}},
		{"its holder ejected", func(_ *testing.T, _ *Pools, holder *Endpoint) {
			for range 3 {
				holder.ReportFailure()
			}
		}, Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{"its holder down by its checks", func(_ *testing.T, _ *Pools, holder *Endpoint) { holder.setActive(refused) },
			Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{"its holder removed", func(_ *testing.T, ps *Pools, holder *Endpoint) {
			ps.Update(spec(slices.DeleteFunc(slices.Clone(addrs), func(a string) bool { return a == holder.Addr })))
		}, Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{"an endpoint joined that ranks first", func(t *testing.T, ps *Pools, _ *Endpoint) {
			ps.Update(spec(append(slices.Clone(addrs), newcomer(t))))
		}, Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{"its holder failed a request since", func(_ *testing.T, _ *Pools, holder *Endpoint) { holder.ReportFailure() },
			Split{PD: true, Reason: metrics.ReasonLongPrompt}},
	}
	for _, tt := range tests {
		for _, seen := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s, turn 1 routed here: %v", tt.name, seen), func(t *testing.T) {
				ps := NewPools(spec(addrs), Deps{})
				router := ps // the replica that routes turn 1
				if !seen {
					router = NewPools(spec(addrs), Deps{})
				}
				first, err := router.Decode.Select(chatRequest(turn1))
				if err != nil {
					t.Fatal(err)
				}
				holder := ps.Decode.Endpoints()[slices.IndexFunc(ps.Decode.Endpoints(), func(e *Endpoint) bool { return e.Addr == first.Addr })]
				tt.change(t, ps, holder)
				req := chatRequest(turn2)
				e, err := ps.Decode.Select(req)
				if err != nil {
					t.Fatal(err)
				}
				if got := ps.Decide(req, e); got.PD != tt.want.PD || got.Reason != tt.want.Reason {
					t.Fatalf("turn 1 on %s, turn 2 on %s: Decide() = %+v, want %+v", first.Addr, e.Addr, got, tt.want)
				}
			})
		}
	}
}

// TestTheUncachedShareIsOfCharacters: the held share of the prompt is
// counted in characters, as its tokens are: a history of three bytes a
// character (CJK) held, and a new turn of 6,000 ASCII characters (1,500
// tokens at 4 a token, above min_uncached_tokens) goes P/D. Counted in
// bytes, it seemed to lack half that, and went decode-only.
func TestTheUncachedShareIsOfCharacters(t *testing.T) {
	turn1 := []simMessage{{"system", strings.Repeat("系统提示", 1500)}, {"user", "你好"}}
	turn2 := append(slices.Clip(turn1), simMessage{"assistant", "好"}, simMessage{"user", strings.Repeat("x", 6000)})
	ps := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000"}},
		Decode: PoolSpec{Endpoints: []string{"10.0.0.1:8000", "10.0.0.2:8000"}, PoolScheduling: config.PoolScheduling{Policy: config.PolicyPrefixAffinity}}}, Deps{})
	if _, err := ps.Decode.Select(chatRequest(turn1)); err != nil {
		t.Fatal(err)
	}
	req := chatRequest(turn2)
	e, err := ps.Decode.Select(req)
	if err != nil {
		t.Fatal(err)
	}
	if uncached, _ := req.UncachedTokens(e, config.DefaultCharsPerToken); uncached < 1500 {
		t.Errorf("%d tokens uncached, want at least the new turn's 1,500", uncached)
	}
	if got := ps.Decide(req, e); !got.PD {
		t.Errorf("Decide() = %+v, want P/D", got)
	}
}

// TestRememberedPrefixesAgeWithWhatTheEngineWrites: a one-shot question whose
// system prompt this replica sent the decode endpoint before is estimated to
// find it there, and goes decode-only (cached_prefix), only while the engine
// has since written less into its cache than the cache holds, by its scraped
// counters: a cache smaller than the prompts it serves has evicted it, and
// decode-only would recompute the system prompt on the decode engine. An
// engine whose counters went back (a restart) holds nothing sent before; one
// that does not report its cache is estimated as before. A failed scrape's
// counters still count: they only grow, and without them the estimate would
// count every block remembered, and forget those sent meanwhile.
func TestRememberedPrefixesAgeWithWhatTheEngineWrites(t *testing.T) {
	system := simMessage{"system", strings.Repeat("s", 8000)} // some 2,000 tokens
	tests := []struct {
		name        string
		size        float64 // the engine's cache, tokens; 0: not reported
		before, now float64 // what it had written when the first question went, and now
		failed      string  // a scrape failed after the figures before (first) or now (last)
		want        Split
	}{
		{name: "a cache that does not say its size", before: 5000, now: 500_000, want: Split{Reason: metrics.ReasonCachedPrefix}},
		{name: "written less than the cache since", size: 10_000, before: 5000, now: 14_000, want: Split{Reason: metrics.ReasonCachedPrefix}},
		{name: "written more than the cache since", size: 10_000, before: 5000, now: 16_000, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "restarted since", size: 10_000, before: 5000, now: 3000, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "sent before the first scrape, written less than the cache", size: 10_000, now: 9000, want: Split{Reason: metrics.ReasonCachedPrefix}},
		{name: "sent before the first scrape, written more than the cache", size: 10_000, now: 11_000, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "written more than the cache, then a scrape failed", size: 10_000, before: 5000, now: 16_000, failed: "last", want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "restarted, then a scrape failed", size: 10_000, before: 5000, now: 3000, failed: "last", want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "written less than the cache, then a scrape failed", size: 10_000, before: 5000, now: 14_000, failed: "last", want: Split{Reason: metrics.ReasonCachedPrefix}},
		{name: "sent while a scrape failed, written less than the cache since", size: 10_000, before: 5000, now: 14_000, failed: "first", want: Split{Reason: metrics.ReasonCachedPrefix}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			scrape := config.EngineMetrics{Interval: config.Duration(time.Second)}
			ps := NewPools(Spec{
				Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000"}},
				Decode:  PoolSpec{Endpoints: []string{"10.0.0.1:8000"}, PoolScheduling: config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Metrics: scrape}},
			}, Deps{})
			e := ps.Decode.Endpoints()[0]
			if tt.before > 0 {
				e.observe(Load{CacheTokens: tt.size, Written: tt.before, At: time.Now()})
			}
			if tt.failed == "first" {
				e.scrapeFailed(scrapeTimeout)
			}
			if _, err := ps.Decode.Select(chatRequest([]simMessage{system, {"user", "What is a haiku?"}})); err != nil {
				t.Fatal(err)
			}
			e.observe(Load{CacheTokens: tt.size, Written: tt.now, At: time.Now()})
			if tt.failed == "last" {
				e.scrapeFailed(scrapeTimeout)
			}
			req := chatRequest([]simMessage{system, {"user", "Who wrote the Iliad?"}})
			if _, err := ps.Decode.Select(req); err != nil {
				t.Fatal(err)
			}
			if got := ps.Decide(req, e); got.PD != tt.want.PD || got.Reason != tt.want.Reason {
				t.Fatalf("Decide() = %+v (estimated held %d characters), want %+v", got, req.Held(e), tt.want)
			}
		})
	}
}

// TestTheLoadArmReadsFreshFigures: the load arm reads an engine's queue only
// from a scrape it answered. One whose scrapes fail (often because it is
// overloaded) or that has no figures yet counts neither as its last figures
// nor as an idle engine: it is left out of the prefill pool's mean, and a
// decode endpoint without figures counts its pool's mean of the fresh ones.
func TestTheLoadArmReadsFreshFigures(t *testing.T) {
	type engine struct {
		scrape  string // fresh, failed (after answering waiting), down (fresh, its checks failing), none
		waiting float64
	}
	fresh := func(w float64) engine { return engine{"fresh", w} }
	failed := func(w float64) engine { return engine{"failed", w} }
	down := func(w float64) engine { return engine{"down", w} }
	none := engine{scrape: "none"}
	tests := []struct {
		name    string
		prefill [2]engine
		decode  [3]engine // the first is the request's decode endpoint
		want    metrics.Reason
	}{
		{"all fresh: prefill busy", [2]engine{fresh(4), fresh(4)}, [3]engine{fresh(0), fresh(0), fresh(0)}, metrics.ReasonPrefillBusy},
		{"all fresh: prefill below its line", [2]engine{fresh(4), fresh(0)}, [3]engine{fresh(0), fresh(0), fresh(0)}, metrics.ReasonLongPrompt},
		{"a prefill engine's scrape failed: not its last queue 0", [2]engine{fresh(4), failed(0)}, [3]engine{fresh(0), fresh(0), fresh(0)}, metrics.ReasonPrefillBusy},
		{"a prefill engine down: not its queue 0", [2]engine{fresh(4), down(0)}, [3]engine{fresh(0), fresh(0), fresh(0)}, metrics.ReasonPrefillBusy},
		{"a prefill engine without figures: not a queue of 0", [2]engine{fresh(4), none}, [3]engine{fresh(0), fresh(0), fresh(0)}, metrics.ReasonPrefillBusy},
		{"no prefill engine with figures: not busy", [2]engine{failed(4), none}, [3]engine{fresh(0), fresh(0), fresh(0)}, metrics.ReasonLongPrompt},
		{"the decode engine's scrape failed, its last queue 0: its pool's mean, busy", [2]engine{fresh(4), fresh(4)}, [3]engine{failed(0), fresh(2), fresh(2)}, metrics.ReasonLongPrompt},
		{"the decode engine's scrape failed, its last queue 5: its pool's mean, idle", [2]engine{fresh(4), fresh(4)}, [3]engine{failed(5), fresh(0), fresh(0)}, metrics.ReasonPrefillBusy},
		{"the decode engine without figures: its pool's mean, busy", [2]engine{fresh(4), fresh(4)}, [3]engine{none, fresh(2), fresh(2)}, metrics.ReasonLongPrompt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			scrape := config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Second)}}
			ps := NewPools(Spec{
				Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000", "10.0.1.2:8000"}, PoolScheduling: scrape},
				Decode:  PoolSpec{Endpoints: []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}, PoolScheduling: scrape},
				PD:      config.PD{Load: config.PDLoad{PrefillQueue: 4, DecodeQueue: 2}},
			}, Deps{})
			see := func(e *Endpoint, g engine) {
				if g.scrape != "none" {
					e.observe(Load{Waiting: g.waiting, At: time.Now()})
				}
				if g.scrape == "failed" {
					e.scrapeFailed(scrapeTimeout)
				}
				if g.scrape == "down" {
					e.setActive(refused)
				}
			}
			for i, e := range ps.Prefill.Endpoints() {
				see(e, tt.prefill[i])
			}
			for i, e := range ps.Decode.Endpoints() {
				see(e, tt.decode[i])
			}
			decode := byAddr(ps.Decode, "10.0.0.1:8000")
			if got := ps.Decide(promptRequest("hello"), decode); got.Reason != tt.want {
				t.Errorf("Decide() = %+v, want reason %s", got, tt.want)
			}
		})
	}
}

// TestAnEngineWithoutFreshCountersIsNotAssumedToHoldItsPrompts: a one-shot
// question whose system prompt this replica sent the decode engine before
// goes decode-only (cached_prefix) only while the engine's counters tell
// that it has not written its cache over since. On a pool that scrapes its
// engines, one whose scrapes failed for longer than stale_after may have
// written its cache over, or restarted, since: it goes P/D, erring as the
// docs promise, not decode-only to recompute its system prompt there. So
// does one whose scrapes never answered (a wrong metrics.path, a 401)
// longer than stale_after after the first failed. A block sent meanwhile is
// remembered with the last counters the engine gave, so once it answers
// again it ages from there, and not as a block sent before it restarted. A
// pool not scraped, and an engine not answered yet within stale_after of
// its first failed scrape, go by memory alone. A restart
// (a counter that only grows went back) leaves nothing sent before it held,
// whatever the engine's counters read later: not a block sent before its
// first answer, nor one whose counters the restarted engine wrote past.
// vLLM's Written may go back for a while with no restart (it counts cache
// hits as it schedules a request, the prompt at its first token), which its
// prefill sums, counted as requests finish, tell apart.
func TestAnEngineWithoutFreshCountersIsNotAssumedToHoldItsPrompts(t *testing.T) {
	type step func(e *Endpoint, clock *fakeClock, ask func())
	const size = 10_000                              // the engine's cache, tokens
	vllm := func(written, prefilling float64) step { // a scrape that answered, with vLLM's prefill seconds
		return func(e *Endpoint, clock *fakeClock, _ func()) {
			e.observe(Load{CacheTokens: size, Written: written, Prefilling: prefilling, At: clock.Now()})
		}
	}
	answer := func(written float64) step { return vllm(written, 0) } // an engine without the prefill sums (SGLang)
	fail := func(seconds int) step {                                 // its scrapes fail, once a second
		return func(e *Endpoint, clock *fakeClock, _ func()) {
			for range seconds {
				clock.Advance(time.Second)
				e.scrapeFailed(scrapeTimeout)
			}
		}
	}
	system := simMessage{"system", strings.Repeat("s", 8000)}            // some 2,000 tokens
	var ask step = func(_ *Endpoint, _ *fakeClock, ask func()) { ask() } // the first question goes
	pd, cached := Split{PD: true, Reason: metrics.ReasonLongPrompt}, Split{Reason: metrics.ReasonCachedPrefix}
	tests := []struct {
		name      string
		unscraped bool // metrics off
		steps     []step
		want      Split
	}{
		{name: "fresh counters, written less than the cache since", steps: []step{answer(5000), ask, answer(14_000)}, want: cached},
		{name: "fresh counters, written more than the cache since", steps: []step{answer(5000), ask, answer(16_000)}, want: pd},
		{name: "failed, not stale: the last answer's counters", steps: []step{answer(5000), ask, fail(2)}, want: cached},
		{name: "stale: failing for longer than stale_after", steps: []step{answer(5000), ask, fail(4)}, want: pd},
		{name: "sent while stale", steps: []step{answer(5000), fail(4), ask}, want: pd},
		{name: "sent while stale, answering again, written less than the cache since its last answer", steps: []step{answer(5000), fail(4), ask, answer(14_000)}, want: cached},
		{name: "sent while stale, answering again, written more", steps: []step{answer(5000), fail(4), ask, answer(16_000)}, want: pd},
		{name: "not answered yet: memory alone", steps: []step{ask}, want: cached},
		{name: "never scraped: memory alone", unscraped: true, steps: []step{ask}, want: cached},
		{name: "never answered, failing for less than stale_after: memory alone", steps: []step{ask, fail(3)}, want: cached},
		{name: "never answered, failing for longer than stale_after", steps: []step{ask, fail(5)}, want: pd},
		{name: "never answered, sent after failing for longer than stale_after", steps: []step{fail(5), ask}, want: pd},
		{name: "never answered for longer than stale_after, then written less than the cache", steps: []step{ask, fail(5), answer(5000)}, want: cached},
		{name: "never answered for longer than stale_after, then written more than the cache", steps: []step{ask, fail(5), answer(11_000)}, want: pd},
		{name: "never scraped, failed scrapes noted: memory alone", unscraped: true, steps: []step{ask, fail(5)}, want: cached},
		{name: "restarted", steps: []step{answer(5000), ask, answer(3000)}, want: pd},
		{name: "restarted while stale", steps: []step{answer(5000), fail(4), ask, answer(3000)}, want: pd},
		{name: "sent before the first answer, restarted since", steps: []step{ask, answer(5000), answer(3000)}, want: pd},
		{name: "sent before the first answer, restarted while stale", steps: []step{ask, answer(5000), fail(4), answer(3000)}, want: pd},
		{name: "sent before the first answer, not restarted", steps: []step{ask, answer(5000), answer(9000)}, want: cached},
		{name: "restarted, then wrote past the block's counters", steps: []step{answer(5000), ask, answer(3000), answer(6000)}, want: pd},
		{name: "vLLM's Written back for a while, its prefill sum grown", steps: []step{vllm(5000, 10), ask, vllm(4000, 11)}, want: cached},
		{name: "vLLM restarted, its prefill sum back", steps: []step{vllm(5000, 10), ask, vllm(6000, 1)}, want: pd},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			var scrape config.EngineMetrics // stale_after defaults to 3 intervals
			if !tt.unscraped {
				scrape = config.EngineMetrics{Interval: config.Duration(time.Second)}
			}
			ps := NewPools(Spec{
				Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000"}},
				Decode:  PoolSpec{Endpoints: []string{"10.0.0.1:8000"}, PoolScheduling: config.PoolScheduling{Policy: config.PolicyPrefixAffinity, Metrics: scrape}},
			}, Deps{Now: clock.Now})
			e := ps.Decode.Endpoints()[0]
			first := func() {
				if _, err := ps.Decode.Select(chatRequest([]simMessage{system, {"user", "What is a haiku?"}})); err != nil {
					t.Fatal(err)
				}
			}
			for _, s := range tt.steps {
				s(e, clock, first)
			}
			req := chatRequest([]simMessage{system, {"user", "Who wrote the Iliad?"}})
			if _, err := ps.Decode.Select(req); err != nil {
				t.Fatal(err)
			}
			if got := ps.Decide(req, e); got.PD != tt.want.PD || got.Reason != tt.want.Reason {
				t.Fatalf("Decide() = %+v (estimated held %d characters), want %+v", got, req.Held(e), tt.want)
			}
		})
	}
}

// TestARequestRenderedOtherwiseIsNotAssumedHeld: a question under the
// system prompt and tools of one this replica just sent a decode endpoint
// goes there decode-only (cached_prefix), unless a field besides the
// messages has the engine render its prompt otherwise from the start (a
// chat template of its own, gpt-oss's reasoning effort in its system
// message): then nothing of it is held, and it goes P/D. The tools'
// whitespace and key order, which the engine parses away, change nothing,
// nor does tool_choice: vLLM renders every tool whatever it says.
func TestARequestRenderedOtherwiseIsNotAssumedHeld(t *testing.T) {
	system := strings.Repeat("You answer from the manual. ", 80)
	const tools = `[{"type":"function","function":{"name":"search","parameters":{"type":"object"}}}]`
	chat := func(question, fields string) *Request {
		t.Helper()
		raw := fmt.Sprintf(`{"model":"m",%s"messages":[{"role":"system","content":%q},{"role":"user","content":%q}]}`, fields, system, question)
		obj, err := body.Parse([]byte(raw))
		if err != nil {
			t.Fatal(err)
		}
		return NewRequest(api.Chat.PromptOf(obj, api.VLLM))
	}
	first := `"tools":` + tools + `,"chat_template_kwargs":{"reasoning_effort":"low"},`
	tests := []struct {
		name, fields string
		want         Split
	}{
		{"the same fields", first, Split{Reason: metrics.ReasonCachedPrefix}},
		{"the tools spaced out", `"tools": [ { "type": "function", "function": { "name": "search", "parameters": { "type": "object" } } } ], "chat_template_kwargs": { "reasoning_effort": "low" },`,
			Split{Reason: metrics.ReasonCachedPrefix}},
		{"the tools' keys in another order", `"tools":[{"function":{"parameters":{"type":"object"},"name":"search"},"type":"function"}],"chat_template_kwargs":{"reasoning_effort":"low"},`,
			Split{Reason: metrics.ReasonCachedPrefix}},
		{"another reasoning effort", `"tools":` + tools + `,"chat_template_kwargs":{"reasoning_effort":"high"},`, Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{"a chat template of its own", first + `"chat_template":"{{ messages }}",`, Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{"tool_choice none: vLLM renders the tools all the same", first + `"tool_choice":"none",`, Split{Reason: metrics.ReasonCachedPrefix}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ps := affinityPools()
			if _, err := ps.Decode.Select(chat("What does the red light mean?", first)); err != nil {
				t.Fatal(err)
			}
			req := chat("How do I reset it?", tt.fields)
			e, err := ps.Decode.Select(req)
			if err != nil {
				t.Fatal(err)
			}
			if got := ps.Decide(req, e); got.PD != tt.want.PD || got.Reason != tt.want.Reason {
				t.Fatalf("Decide() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// TestAReplysReasoningIsNotAssumedHeld: a later turn of an agent's tool loop
// repeats the model's reasoning, which the engine's template writes back
// (Qwen3's, after the last user message) and no engine holds as written: a
// long one is a long uncached part, which goes P/D.
func TestAReplysReasoningIsNotAssumedHeld(t *testing.T) {
	system := strings.Repeat("You answer from the manual. ", 80)
	first := fmt.Sprintf(`{"role":"system","content":%q},{"role":"user","content":"Why is the light red?"}`, system)
	chat := func(messages string) *Request {
		t.Helper()
		obj, err := body.Parse([]byte(`{"model":"m","messages":[` + messages + `]}`))
		if err != nil {
			t.Fatal(err)
		}
		return NewRequest(api.Chat.PromptOf(obj, api.VLLM))
	}
	for _, tt := range []struct {
		name      string
		reasoning int // characters
		want      Split
	}{
		{"a short reasoning", 400, Split{Reason: metrics.ReasonCachedPrefix}},
		{"a reasoning of min_uncached_tokens and more", 4 * 4 * config.DefaultMinUncachedTokens, Split{PD: true, Reason: metrics.ReasonLongPrompt}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ps := affinityPools()
			if _, err := ps.Decode.Select(chat(first)); err != nil {
				t.Fatal(err)
			}
			req := chat(first + fmt.Sprintf(`,{"role":"assistant","reasoning":%q,"tool_calls":[{"id":"1","type":"function","function":{"name":"manual","arguments":"{}"}}]},`,
				strings.Repeat("r", tt.reasoning)) + `{"role":"tool","tool_call_id":"1","content":"Overheated."}`)
			e, err := ps.Decode.Select(req)
			if err != nil {
				t.Fatal(err)
			}
			if got := ps.Decide(req, e); got.PD != tt.want.PD || got.Reason != tt.want.Reason {
				t.Fatalf("Decide() = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// affinityPools are one prefill endpoint and four decode endpoints under
// prefix-affinity, the pools' defaults otherwise.
func affinityPools() *Pools {
	return NewPools(Spec{
		Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000"}},
		Decode: PoolSpec{Endpoints: []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"},
			PoolScheduling: config.PoolScheduling{Policy: config.PolicyPrefixAffinity}},
	}, Deps{})
}
