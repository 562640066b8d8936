package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// kvChat is a chat request under a system prompt of some 60 tokens to the
// simulators (a token a word: four of their 16-token blocks), named by
// tenant so that each tenant's prompt is its own; extra fields, in pairs of
// name and value, go with it.
func kvChat(t *testing.T, tenant, question string, extra ...any) string {
	t.Helper()
	system := strings.Repeat("You answer for "+tenant+" as its careful assistant would. ", 8)
	fields := map[string]any{"model": "pdsim", "max_tokens": 2,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": question}}}
	for i := 0; i+1 < len(extra); i += 2 {
		fields[extra[i].(string)] = extra[i+1]
	}
	b, err := json.Marshal(fields)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// askedTokens says whether path is one the router asks an engine for a
// request's tokens on: /tokenize, or the render endpoints.
func askedTokens(path string) bool { return path == "/tokenize" || strings.HasSuffix(path, "/render") }

// warm sends body to sim directly, as a client that bypasses the router.
func warm(t *testing.T, sim *pdsim.Server, body string) {
	t.Helper()
	resp, err := http.Post("http://"+sim.Addr()+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("warming %s: status %d", sim.Addr(), resp.StatusCode)
	}
}

// subscribed waits until every simulator has n subscribers to its events: a
// subscriber misses what was published before it joined.
func subscribed(t *testing.T, sims []*pdsim.Server, n int) {
	t.Helper()
	waitFor(t, 20*time.Second, "every replica to subscribe to every engine", func() bool {
		for _, s := range sims {
			if s.KVEventsStats().Subscribers < n {
				return false
			}
		}
		return true
	})
}

// everyReplica waits until series on every replica satisfies ok.
func everyReplica(t *testing.T, r *rig, series string, ok func(float64) bool) {
	t.Helper()
	waitFor(t, 20*time.Second, series, func() bool {
		for _, x := range r.replicas {
			v, err := x.Metric(t.Context(), series)
			if err != nil || !ok(v) {
				return false
			}
		}
		return true
	})
}

// routed sends body through the router and returns the decode endpoint
// index that served it (not the one asked for its tokens).
func routed(t *testing.T, r *rig, body, marker string) int {
	t.Helper()
	resp, got := r.must(t, "/v1/chat/completions", body, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	for i, s := range r.decode {
		for _, rec := range s.Requests() {
			if rec.Path == "/v1/chat/completions" && strings.Contains(string(rec.Body), marker) {
				return i
			}
		}
	}
	t.Fatalf("no decode engine got %q", marker)
	return -1
}

// TestWarmedEnginesAreFoundByTheirEvents: a system prompt that a client sent
// straight to one engine, bypassing the router, is found there by every
// replica, from the engines' KV events: each of three tenants' questions
// goes to the engine its prompt was warmed on. Without events the ranking
// would have to guess all three (one chance in 27). Requests whose template
// also renders fields /tokenize has none of (reasoning_effort, documents)
// are found too: their ids come from the engine's render endpoint, which
// renders them as the chat endpoint does, or, from an engine without one,
// from /tokenize given them as chat_template_kwargs. So are prompts under a
// cache_salt, or for a LoRA adapter, whose blocks the engine keys with the
// salt or the adapter's name, as the events say and the lookups key them.
func TestWarmedEnginesAreFoundByTheirEvents(t *testing.T) {
	rendered := []any{"reasoning_effort", "high", "documents", []map[string]string{{"title": "handbook", "text": "the handbook"}}}
	for _, tt := range []struct {
		name     string
		extra    []any
		noRender bool
	}{
		{"messages", nil, false},
		{"rendered with reasoning_effort and documents", rendered, false},
		{"the same by /tokenize, without render endpoints", rendered, true},
		{"under a cache_salt", []any{"cache_salt", "tenant-7"}, false},
		{"for a LoRA adapter, under a cache_salt", []any{"model", "sql-lora", "cache_salt", "tenant-7"}, false},
	} {
		for _, replicas := range []int{1, 3} {
			t.Run(fmt.Sprint(tt.name, ", ", replicas, " replicas"), func(t *testing.T) {
				r := startRig(t, rigOptions{prefills: -1, decodes: 3, replicas: replicas, noRender: tt.noRender, lora: []string{"sql-lora"},
					decodePool: "policy: prefix-affinity", kvEvents: []string{}})
				subscribed(t, r.decode, replicas)
				tenants := []string{"Acme", "Globex", "Initech"}
				for i, tenant := range tenants {
					warm(t, r.decode[i], kvChat(t, tenant, "warming up", tt.extra...))
				}
				everyReplica(t, r, `pd_extproc_kv_events_batches_total{pool="decode"}`, func(v float64) bool { return v >= 3 })
				for i, tenant := range tenants {
					for q := range replicas {
						marker := fmt.Sprintf("[%s question %d]", tenant, q)
						if got := routed(t, r, kvChat(t, tenant, marker, tt.extra...), marker); got != i {
							t.Errorf("%s's question %d went to decode %d; its prompt is cached on decode %d", tenant, q, got, i)
						}
					}
				}
			})
		}
	}
}

// TestKVEventGapsAreReplayed: batches an engine's subscribers lost are asked
// of its replay socket when the next one shows the gap, so what they said is
// in the view: a prompt whose events were all lost is still found.
func TestKVEventGapsAreReplayed(t *testing.T) {
	r := startRig(t, rigOptions{prefills: -1, decodes: 3, decodePool: "policy: prefix-affinity", kvEvents: []string{}})
	subscribed(t, r.decode, 1)
	tenants := []string{"Umbrella", "Hooli", "Vandelay"}
	for i := range tenants {
		warm(t, r.decode[i], kvChat(t, "nobody", "a first batch"))
	}
	everyReplica(t, r, `pd_extproc_kv_events_batches_total{pool="decode"}`, func(v float64) bool { return v >= 3 })
	for i, tenant := range tenants {
		r.decode[i].SetFaults(pdsim.Faults{DropKVEventsEvery: 1}) // every batch lost, kept for replay
		warm(t, r.decode[i], kvChat(t, tenant, "warming up"))
		r.decode[i].SetFaults(pdsim.Faults{})
		warm(t, r.decode[i], kvChat(t, "nobody", "a batch that shows the gap"))
	}
	everyReplica(t, r, `pd_extproc_kv_events_gaps_total{pool="decode"}`, func(v float64) bool { return v >= 3 })
	everyReplica(t, r, `pd_extproc_kv_events_replays_total{outcome="replayed",pool="decode"}`, func(v float64) bool { return v >= 3 })
	for i, tenant := range tenants {
		marker := "[" + tenant + " after the gap]"
		if got := routed(t, r, kvChat(t, tenant, marker), marker); got != i {
			t.Errorf("%s's question went to decode %d; its prompt, whose events were replayed, is cached on decode %d", tenant, got, i)
		}
	}
	if n := r.extproc.MustMetric(t, `pd_extproc_kv_events_replays_total{outcome="failed",pool="decode"}`); n != 0 {
		t.Errorf("%v replays failed", n)
	}
}

// TestSilentEnginesFallBackToEstimates: an engine that stops publishing
// while it is sent work it must store is not trusted once stale_after has
// passed (pd_extproc_kv_events_stale_publishers), and requests still route;
// when it publishes again, the batches it numbered meanwhile are replayed
// and its view is trusted again.
func TestSilentEnginesFallBackToEstimates(t *testing.T) {
	r := startRig(t, rigOptions{prefills: -1, decodes: 2, decodePool: "policy: prefix-affinity", kvEvents: []string{"stale_after: 1s"}})
	subscribed(t, r.decode, 1)
	warm(t, r.decode[0], kvChat(t, "Soylent", "warming up"))
	everyReplica(t, r, `pd_extproc_kv_events_batches_total{pool="decode"}`, func(v float64) bool { return v >= 1 })
	r.decode[0].StopKVEvents()
	// A question of more than a block: the engine will store it, and does
	// not publish.
	if got := routed(t, r, kvChat(t, "Soylent", "[new work] "+strings.Repeat("and then what? ", 8)), "[new work]"); got != 0 {
		t.Fatalf("went to decode %d, not to the engine holding the prompt", got)
	}
	everyReplica(t, r, `pd_extproc_kv_events_stale_publishers{pool="decode"}`, func(v float64) bool { return v == 1 })
	routed(t, r, kvChat(t, "Soylent", "[while it is silent]"), "[while it is silent]")

	if err := r.decode[0].StartKVEvents(); err != nil {
		t.Fatal(err)
	}
	subscribed(t, r.decode[:1], 1)
	warm(t, r.decode[0], kvChat(t, "Soylent", "a batch that shows the gap"))
	everyReplica(t, r, `pd_extproc_kv_events_stale_publishers{pool="decode"}`, func(v float64) bool { return v == 0 })
	everyReplica(t, r, `pd_extproc_kv_events_replays_total{outcome="replayed",pool="decode"}`, func(v float64) bool { return v >= 1 })
}

// TestEnginesThatNeverPublishCostNoTokenize: pools that follow KV events an
// engine never publishes (started without --kv-events-config): once it was
// sent a prompt long enough to leave it a block to store, whatever its block
// size, and stale_after has passed, every replica counts it stale and asks
// no /tokenize for the requests after, which still route.
func TestEnginesThatNeverPublishCostNoTokenize(t *testing.T) {
	r := startRig(t, rigOptions{prefills: -1, decodes: 1, replicas: 2, decodePool: "policy: prefix-affinity", kvEvents: []string{"stale_after: 1s"}})
	subscribed(t, r.decode, 2)
	sim := r.decode[0]
	sim.StopKVEvents()
	long := strings.Repeat("and then what happened next? ", 60) // 300 tokens to compute, a token a word
	waitFor(t, 20*time.Second, "every replica to count the silent engine stale", func() bool {
		if resp, got := r.must(t, "/v1/chat/completions", kvChat(t, "Initrode", long), nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
		for _, x := range r.replicas {
			if v, err := x.Metric(t.Context(), `pd_extproc_kv_events_stale_publishers{pool="decode"}`); err != nil || v != 1 {
				return false
			}
		}
		return true
	})
	render := "/v1/chat/completions/render"
	if asked(sim, render) == 0 {
		t.Fatal("no tokens asked while the engine's view was trusted: the test shows nothing")
	}
	before := asked(sim, render) + asked(sim, "/tokenize")
	for i := range 4 {
		marker := fmt.Sprintf("[after %d]", i)
		routed(t, r, kvChat(t, "Initrode", marker), marker)
	}
	if n := asked(sim, render) + asked(sim, "/tokenize") - before; n != 0 {
		t.Errorf("tokens asked for %d requests after every view went stale, want none", n)
	}
}

// TestFailingTokenizeIsPaused: an engine without the render endpoints
// (older vLLM) whose tokenizer answers without ids (here the path is its
// /detokenize) is asked for three requests in a row, then no more for
// stale_after; every request still routes, by the estimates.
func TestFailingTokenizeIsPaused(t *testing.T) {
	r := startRig(t, rigOptions{prefills: -1, decodes: 1, decodePool: "policy: prefix-affinity", noRender: true,
		kvEvents: []string{"stale_after: 1m", "tokenize: {path: /detokenize}"}})
	subscribed(t, r.decode, 1)
	for i := range 6 {
		marker := fmt.Sprintf("[question %d]", i)
		routed(t, r, kvChat(t, "Vehement", marker), marker)
	}
	if n := asked(r.decode[0], "/detokenize"); n != 3 {
		t.Errorf("the failing tokenizer was asked for %d of 6 requests, want 3", n)
	}
}

// TestRefusedRequestsDoNotPauseTokenize: requests the engine's render
// endpoint refuses (400; 404 for a model it does not serve, an OpenAI error
// and not a path it lacks), as their own endpoint refuses them, are the
// client's doing, not the tokenizer's: they do not pause the round trips,
// nor turn the render endpoint off, and the next request is still looked
// up by it.
func TestRefusedRequestsDoNotPauseTokenize(t *testing.T) {
	r := startRig(t, rigOptions{prefills: -1, decodes: 1, decodePool: "policy: prefix-affinity", kvEvents: []string{"stale_after: 1m"}})
	subscribed(t, r.decode, 1)
	render := "/v1/chat/completions/render"
	for i := range 3 {
		// vLLM refuses stream_options without stream.
		body := kvChat(t, "Hooli", fmt.Sprintf("[refused %d]", i), "stream_options", map[string]bool{"include_usage": true})
		if resp, got := r.must(t, "/v1/chat/completions", body, nil); resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("status %d, want the engine's 400: %s", resp.StatusCode, got)
		}
	}
	unserved := strings.Replace(kvChat(t, "Hooli", "[unserved]"), `"model":"pdsim"`, `"model":"other"`, 1)
	if resp, got := r.must(t, "/v1/chat/completions", unserved, nil); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("status %d, want the engine's 404: %s", resp.StatusCode, got)
	}
	if n := asked(r.decode[0], render); n != 4 {
		t.Fatalf("the render endpoint was asked for %d of the 4 refused requests: the test shows nothing", n)
	}
	routed(t, r, kvChat(t, "Hooli", "[valid]"), "[valid]")
	if n := asked(r.decode[0], render); n != 5 {
		t.Errorf("the render endpoint was asked for %d of 5 requests, want 5: the refusals paused it", n)
	}
	if n := asked(r.decode[0], "/tokenize"); n != 0 {
		t.Errorf("/tokenize asked %d times: a refusal was taken for a missing render endpoint", n)
	}
}

// TestUnservedModelsDoNotPauseTokenize: on engines without render
// endpoints, /tokenize answers a model (a LoRA adapter) the engine does not
// serve with vLLM's 404, as the request's own endpoint will. Three such
// requests in a row, a client's typo or an adapter loaded on some engines
// only, do not pause the round trips for every other client.
func TestUnservedModelsDoNotPauseTokenize(t *testing.T) {
	r := startRig(t, rigOptions{prefills: -1, decodes: 1, noRender: true, decodePool: "policy: prefix-affinity", kvEvents: []string{"stale_after: 1m"}})
	subscribed(t, r.decode, 1)
	for i := range 3 {
		unserved := strings.Replace(kvChat(t, "Hooli", fmt.Sprintf("[unserved %d]", i)), `"model":"pdsim"`, `"model":"other"`, 1)
		if resp, got := r.must(t, "/v1/chat/completions", unserved, nil); resp.StatusCode != http.StatusNotFound {
			t.Fatalf("status %d, want the engine's 404: %s", resp.StatusCode, got)
		}
	}
	if n := asked(r.decode[0], "/tokenize"); n != 3 {
		t.Fatalf("/tokenize was asked for %d of the 3 unserved requests: the test shows nothing", n)
	}
	routed(t, r, kvChat(t, "Hooli", "[valid]"), "[valid]")
	if n := asked(r.decode[0], "/tokenize"); n != 4 {
		t.Errorf("/tokenize was asked for %d of 4 requests, want 4: the unserved model paused it", n)
	}
}

// TestAFailingRenderFallsBackToTokenize: a render endpoint that fails (500:
// a template the engine could not apply, a model it cannot render for; 501
// with vLLM's error: a request it cannot render, as gpt-oss's Responses with
// a tool_choice other than auto) is no reason to go without ids: the request
// is asked of /tokenize, found where its prompt is cached, and the round
// trips are not paused, nor the render endpoint taken for missing.
func TestAFailingRenderFallsBackToTokenize(t *testing.T) {
	for _, status := range []int{http.StatusInternalServerError, http.StatusNotImplemented} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			r := startRig(t, rigOptions{prefills: -1, decodes: 2, decodePool: "policy: prefix-affinity", kvEvents: []string{"stale_after: 1m"}})
			subscribed(t, r.decode, 1)
			for i, tenant := range []string{"Stark", "Wayne"} {
				warm(t, r.decode[i], kvChat(t, tenant, "warming up"))
			}
			everyReplica(t, r, `pd_extproc_kv_events_batches_total{pool="decode"}`, func(v float64) bool { return v >= 2 })
			for _, d := range r.decode {
				d.SetFaults(pdsim.Faults{RenderStatus: status})
			}
			for q := range 4 {
				for i, tenant := range []string{"Stark", "Wayne"} {
					marker := fmt.Sprintf("[%s question %d]", tenant, q)
					if got := routed(t, r, kvChat(t, tenant, marker), marker); got != i {
						t.Errorf("%s's question %d went to decode %d; its prompt is cached on decode %d", tenant, q, got, i)
					}
				}
			}
			render := "/v1/chat/completions/render"
			if n, m := asked(r.decode[0], "/tokenize")+asked(r.decode[1], "/tokenize"), asked(r.decode[0], render)+asked(r.decode[1], render); n != 8 || m != 8 {
				t.Errorf("/tokenize asked for %d and the render endpoint for %d of 8 requests whose render failed, want 8 and 8", n, m)
			}
		})
	}
}

// TestDeniedRequestsDoNotPauseTokenize: a client whose credentials the
// engine refuses (401: vLLM's --api-key) says nothing of its tokenizer:
// three in a row do not pause the round trips for the next client.
func TestDeniedRequestsDoNotPauseTokenize(t *testing.T) {
	r := startRig(t, rigOptions{prefills: -1, decodes: 1, decodePool: "policy: prefix-affinity", kvEvents: []string{"stale_after: 1m"}})
	subscribed(t, r.decode, 1)
	render := "/v1/chat/completions/render"
	r.decode[0].SetFaults(pdsim.Faults{RenderStatus: http.StatusUnauthorized})
	for i := range 4 {
		marker := fmt.Sprintf("[denied %d]", i)
		routed(t, r, kvChat(t, "Hooli", marker), marker)
	}
	if n := asked(r.decode[0], render); n != 4 {
		t.Fatalf("the render endpoint was asked for %d of the 4 denied requests, want 4: the denials paused it", n)
	}
	r.decode[0].SetFaults(pdsim.Faults{})
	routed(t, r, kvChat(t, "Hooli", "[valid]"), "[valid]")
	if n := asked(r.decode[0], render); n != 5 {
		t.Errorf("the render endpoint was asked for %d of 5 requests, want 5: the denials paused it", n)
	}
}

// TestSGLangChatDoesNotPauseCompletions: SGLang has no render endpoint, and
// its /tokenize takes prompts, not chat messages: three chat requests in a
// row pause the round trips for chat, and completions prompts are still
// asked for.
func TestSGLangChatDoesNotPauseCompletions(t *testing.T) {
	r := startRig(t, rigOptions{connector: "kv-sglang", prefills: 1, decodes: 1, prefillPool: "policy: prefix-affinity",
		decodePool: "policy: prefix-affinity", kvEvents: []string{"stale_after: 1m"}})
	subscribed(t, r.prefill, 1)
	tokenizer := r.prefill[0] // the least busy prefill engine is asked
	for i := range 4 {
		marker := fmt.Sprintf("[chat %d]", i)
		routed(t, r, kvChat(t, "Oscorp", marker), marker)
	}
	if n := asked(tokenizer, "/tokenize"); n != 3 {
		t.Fatalf("/tokenize asked for %d of 4 chat requests, want 3, then paused", n)
	}
	for i := range 3 {
		b, _ := json.Marshal(map[string]any{"model": "pdsim", "max_tokens": 2, "prompt": fmt.Sprintf("a question of its own, number %d", i)})
		if resp, got := r.must(t, "/v1/completions", string(b), nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
	}
	if n := asked(tokenizer, "/tokenize") - 3; n != 3 {
		t.Errorf("/tokenize asked for %d of 3 completions prompts while chat was paused, want 3", n)
	}
}

// asked is how many requests sim got on path.
func asked(sim *pdsim.Server, path string) int {
	n := 0
	for _, rec := range sim.Requests() {
		if rec.Path == path {
			n++
		}
	}
	return n
}

// TestTheViewEqualsTheEnginesCache: with one batch in a hundred lost on the
// way and a cache small enough to evict, every lost batch is replayed when
// the next shows the gap, and the router's view ends with as many blocks as
// the engine's prefix cache holds.
func TestTheViewEqualsTheEnginesCache(t *testing.T) {
	r := startRig(t, rigOptions{prefills: -1, decodes: 1, prefixCacheBlocks: 200, decodePool: "policy: prefix-affinity", kvEvents: []string{}})
	subscribed(t, r.decode, 1)
	sim := r.decode[0]
	warm(t, sim, kvChat(t, "nobody", "a first batch"))
	sim.SetFaults(pdsim.Faults{DropKVEventsEvery: 100})
	for i := range 300 { // some 7 blocks each: the cache turns over some ten times
		warm(t, sim, kvChat(t, fmt.Sprint("tenant ", i), "a question"))
	}
	sim.SetFaults(pdsim.Faults{})
	warm(t, sim, kvChat(t, "nobody", "a last batch, after the last lost one"))
	if st := sim.KVEventsStats(); st.Dropped < 2 {
		t.Fatalf("%d batches lost: the test loses too few", st.Dropped)
	}
	everyReplica(t, r, `pd_extproc_kv_events_replays_total{outcome="replayed",pool="decode"}`, func(v float64) bool {
		return v >= float64(sim.KVEventsStats().Dropped)
	})
	want := float64(sim.CachedBlocks())
	everyReplica(t, r, `pd_extproc_kv_events_index_blocks{pool="decode"}`, func(v float64) bool { return v == want })
	if n := r.extproc.MustMetric(t, `pd_extproc_kv_events_dropped_total{pool="decode",reason="orphan"}`); n != 0 {
		t.Errorf("%v blocks dropped as orphans", n)
	}
}
