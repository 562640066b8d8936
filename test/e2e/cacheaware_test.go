package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// TestLaterTurnsSkipThePrefillLeg: a conversation's first turn is P/D; its
// later turns, whose new part is below pd.min_uncached_tokens, go
// decode-only to the decode endpoint that holds the history (cached_prefix),
// which reports the hit. So on one replica and with the turns spread over
// three, with Envoy's response path and without. kv-sglang's decode engines
// cannot prefill, and a bound below the new part keeps P/D.
func TestLaterTurnsSkipThePrefillLeg(t *testing.T) {
	const turns = 3
	tests := []struct {
		name, mode, connector string
		replicas              int
		pd                    string // extproc's pd keys
		decodeOnly            bool   // turns 2 and 3
		kvEvents              bool   // the pools follow the engines' KV events: the decision reads the decode engine's exact hit
		session               string // the header that names the client's session, which Envoy hashes to keep its turns on one replica
		oneClient             bool   // every turn from one client address, which Envoy hashes without a session header
	}{
		{name: "one replica", mode: "full_duplex", replicas: 1, pd: "{min_uncached_tokens: 100}", decodeOnly: true},
		{name: "three replicas", mode: "full_duplex", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true},
		{name: "without the response path", mode: "no_response", replicas: 1, pd: "{min_uncached_tokens: 100}", decodeOnly: true},
		{name: "three replicas without the response path", mode: "no_response", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true},
		{name: "three replicas, one session", mode: "full_duplex", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true, session: "X-Session-Id"},
		{name: "three replicas, Claude Code's session", mode: "full_duplex", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true, session: "X-Claude-Code-Session-Id"},
		{name: "three replicas, Codex's session", mode: "no_response", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true, session: "Session-Id"},
		{name: "three replicas, Open WebUI's chat", mode: "full_duplex", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true, session: "X-Openwebui-Chat-Id"},
		{name: "three replicas, one client", mode: "full_duplex", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true, oneClient: true},
		{name: "a bound below the new part", mode: "full_duplex", replicas: 1, pd: "{min_uncached_tokens: 10}"},
		{name: "kv-sglang", mode: "full_duplex", connector: "kv-sglang", replicas: 1, pd: "{}"},
		{name: "kv-mooncake", mode: "full_duplex", connector: "kv-mooncake", replicas: 1, pd: "{min_uncached_tokens: 100}", decodeOnly: true},
		{name: "the engines' KV events", mode: "full_duplex", replicas: 1, pd: "{min_uncached_tokens: 100}", decodeOnly: true, kvEvents: true},
		{name: "three replicas with the engines' KV events", mode: "no_response", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true, kvEvents: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := rigOptions{mode: tt.mode, connector: tt.connector, replicas: tt.replicas, decodes: 3, oneClient: tt.oneClient,
				promptTokensDetails: true, decodePool: "policy: prefix-affinity", prefillPool: "policy: prefix-affinity",
				extra: "pd: " + tt.pd}
			if tt.kvEvents {
				o.kvEvents = []string{}
			}
			r := startRig(t, o)
			if tt.kvEvents {
				subscribed(t, slices.Concat(r.prefill, r.decode), tt.replicas)
			}
			c := conversation{marker: "[conversation " + tt.name + "]"}
			if tt.session != "" {
				c.header = http.Header{tt.session: {"session " + tt.name}}
			}
			home := -1
			for turn := 1; turn <= turns; turn++ {
				resp := c.next(t, r)
				decode := legsOn(r.decode, c.marker)
				if turn == 1 {
					for i, n := range decode {
						if n == 1 {
							home = i
						}
					}
				}
				if home < 0 || decode[home] != turn {
					t.Fatalf("turn %d: decode legs per endpoint %v; want all %d on one", turn, decode, turn)
				}
				wantPrefill := turn
				if tt.decodeOnly {
					wantPrefill = 1
				}
				if n := sum(legsOn(r.prefill, c.marker)); n != wantPrefill {
					t.Errorf("turn %d: %d prefill legs in all, want %d", turn, n, wantPrefill)
				}
				cached, _ := strconv.Atoi(resp.Header.Get("x-pdsim-cached-tokens"))
				if turn > 1 && tt.decodeOnly && cached < 256 { // turn 1's full blocks
					t.Errorf("turn %d: the decode engine reports %d cached tokens (x-pdsim-cached-tokens %q), want the history's",
						turn, cached, resp.Header.Get("x-pdsim-cached-tokens"))
				}
			}
			wantCached := 0.0
			if tt.decodeOnly {
				wantCached = turns - 1
			}
			var decided float64
			for _, x := range r.replicas {
				n, err := x.Metric(t.Context(), `pd_extproc_pd_decisions_total{reason="cached_prefix"}`)
				if err != nil {
					t.Fatal(err)
				}
				pinned := tt.session != "" || tt.oneClient
				if tt.replicas > 1 && !pinned && n > 1 {
					t.Errorf("one replica decided %v of the later turns: they are not spread over the replicas", n)
				}
				if pinned && n > 0 && n != wantCached {
					t.Errorf("one replica decided %v of the %v later turns of one session: want them all on one", n, wantCached)
				}
				decided += max(n, 0)
			}
			if decided != wantCached {
				t.Errorf("pd_decisions_total{reason=cached_prefix} summed over the replicas = %v, want %v", decided, wantCached)
			}
		})
	}
}

// TestAnEvictedDecodeEngineLosesTheCacheRule: a decode engine whose answers
// to cached_prefix requests keep reporting less than the router estimated it
// holds (here its prefix cache is reset before each of turns 3 to 5, as an
// eviction or a restart would leave it) is distrusted after three such
// answers, including the ones whose usage carries no details (nothing
// cached, as vLLM writes it): turn 6 goes P/D again although the engine
// holds turn 5, and pd_extproc_endpoint_cache_trusted says so. It needs
// Envoy's response path, which carries the answers.
func TestAnEvictedDecodeEngineLosesTheCacheRule(t *testing.T) {
	r := startRig(t, rigOptions{decodes: 1, promptTokensDetails: true,
		decodePool: "policy: prefix-affinity", prefillPool: "policy: prefix-affinity", extra: "pd: {min_uncached_tokens: 100}"})
	c := conversation{marker: "[an evicted engine]"}
	for turn, want := range []struct {
		evict    bool
		prefills int     // prefill legs so far
		cached   bool    // the decode engine reports cached tokens (on a P/D turn, the KV it pulled)
		trusted  float64 // after the turn
	}{
		1: {prefills: 1, cached: true, trusted: 1},
		2: {prefills: 1, cached: true, trusted: 1},
		3: {evict: true, prefills: 1, trusted: 1},
		4: {evict: true, prefills: 1, trusted: 1},
		5: {evict: true, prefills: 1, trusted: 0},
		6: {prefills: 2, cached: true, trusted: 0},
	} {
		if turn == 0 {
			continue
		}
		if want.evict {
			r.decode[0].ResetPrefixCache()
		}
		resp := c.next(t, r)
		if n := sum(legsOn(r.prefill, c.marker)); n != want.prefills {
			t.Errorf("turn %d: %d prefill legs so far, want %d", turn, n, want.prefills)
		}
		if cached := resp.Header.Get("x-pdsim-cached-tokens"); (cached != "0") != want.cached {
			t.Errorf("turn %d: the decode engine reports %s cached tokens; want some: %v", turn, cached, want.cached)
		}
		series := fmt.Sprintf(`pd_extproc_endpoint_cache_trusted{endpoint=%q,pool="decode"}`, r.decodeAddrs[0])
		if got := r.extproc.MustMetric(t, series); got != want.trusted {
			t.Errorf("turn %d: pd_extproc_endpoint_cache_trusted = %v, want %v", turn, got, want.trusted)
		}
	}
}

// TestAnEngineThatWroteItsCacheOverLosesTheEstimate: one-shot questions
// under one system prompt, on a decode engine whose cache holds 1,024 tokens.
// The first goes P/D and leaves the prompt in the decode engine's cache; the
// second finds it there by what the router remembers sending, and goes
// decode-only. Then the engine computes other clients' prompts, more than its
// cache holds, which evicts the system prompt; once the router has scraped
// its counters, the third question goes P/D, where decode-only would compute
// the system prompt again on the decode engine. Envoy's response path is off:
// no answer tells the router of the eviction.
func TestAnEngineThatWroteItsCacheOverLosesTheEstimate(t *testing.T) {
	r := startRig(t, rigOptions{mode: "no_response", decodes: 1, promptTokensDetails: true, prefixCacheBlocks: 64, kvBlocks: 64,
		decodePool: "policy: prefix-affinity, metrics: {interval: 50ms, stale_after: 1h}", prefillPool: "policy: prefix-affinity",
		extra: "pd: {min_uncached_tokens: 100}"})
	decode := r.decode[0]
	ask := func(n int, wantPrefills int) {
		t.Helper()
		c := conversation{marker: fmt.Sprintf("[question %d]", n)}
		c.next(t, r)
		if got := sum(legsOn(r.prefill, c.marker)); got != wantPrefills {
			t.Errorf("question %d: %d prefill legs, want %d", n, got, wantPrefills)
		}
	}
	// scraped waits for a scrape taken after the queue was set to waiting,
	// ten apart each time: a request in flight adds one to what the engine
	// reports, so a scrape taken while one was could show a next value one
	// apart, and the counters it read would lack that request's tokens.
	scraped := func(waiting int) {
		t.Helper()
		decode.SetQueues(pdsim.Queues{Waiting: waiting})
		waitFor(t, 20*time.Second, "a scrape of the decode engine", func() bool {
			return r.metric(t, fmt.Sprintf(`pd_extproc_endpoint_engine_waiting{endpoint=%q,pool="decode"}`, decode.Addr())) == float64(waiting)
		})
	}
	scraped(10)
	ask(1, 1)
	scraped(20)
	ask(2, 0)
	for i := range 3 { // 1,500 tokens of other prompts, straight to the engine
		body := fmt.Sprintf(`{"model":"pdsim","max_tokens":1,"prompt":"%d %s"}`, i, strings.Repeat("another client's prompt ", 125))
		resp, err := http.Post("http://"+decode.Addr()+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("prompt %d straight to the decode engine: status %d", i, resp.StatusCode)
		}
	}
	scraped(30)
	ask(3, 1)
}

// TestAnEngineThatNeverStatesItsCachedTokensKeepsTheCacheRule: a decode
// engine run without --enable-prompt-tokens-details answers every turn
// without the details, which says nothing of its cache: its later turns stay
// decode-only (one prefill leg in five turns) and it stays trusted. Read as
// "nothing cached", three such answers would end its trust and send the
// turns after them P/D.
func TestAnEngineThatNeverStatesItsCachedTokensKeepsTheCacheRule(t *testing.T) {
	r := startRig(t, rigOptions{decodes: 1,
		decodePool: "policy: prefix-affinity", prefillPool: "policy: prefix-affinity", extra: "pd: {min_uncached_tokens: 100}"})
	c := conversation{marker: "[an engine without the details]"}
	for turn := 1; turn <= 5; turn++ {
		c.next(t, r)
	}
	if n := sum(legsOn(r.prefill, c.marker)); n != 1 {
		t.Errorf("%d prefill legs in five turns, want 1 (turns 2 to 5 decode-only)", n)
	}
	series := fmt.Sprintf(`pd_extproc_endpoint_cache_trusted{endpoint=%q,pool="decode"}`, r.decodeAddrs[0])
	if got := r.extproc.MustMetric(t, series); got != 1 {
		t.Errorf("pd_extproc_endpoint_cache_trusted = %v, want 1", got)
	}
}

// conversation is a chat conversation sent a turn at a time: about 1,500
// characters of system prompt (375 tokens to the router, at 4 characters
// each; 262 to the simulator, a token a word), then a question with marker,
// and each later turn adding a reply and a question (some 18 tokens to the
// router).
type conversation struct {
	marker  string
	history []message
	header  http.Header // sent with every turn
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// next sends the conversation's next turn, and fails the test unless it is
// answered 200.
func (c *conversation) next(t *testing.T, r *rig) *http.Response {
	t.Helper()
	if c.history == nil {
		c.history = []message{{"system", strings.Repeat("You answer as a careful assistant would. ", 36)}, {"user", c.marker + " What is a prefix cache?"}}
	} else {
		c.history = append(c.history, message{"assistant", "It keeps the KV of prompts seen."},
			message{"user", fmt.Sprintf("Question %d: and then?", len(c.history)/2+1)})
	}
	b, err := json.Marshal(map[string]any{"model": "pdsim", "max_tokens": 4, "messages": c.history})
	if err != nil {
		t.Fatal(err)
	}
	resp, got := r.must(t, "/v1/chat/completions", string(b), c.header)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("turn %d: status %d: %s", len(c.history)/2, resp.StatusCode, got)
	}
	return resp
}

func sum(counts []int) int {
	n := 0
	for _, c := range counts {
		n += c
	}
	return n
}
