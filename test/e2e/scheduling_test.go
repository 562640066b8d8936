package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// legsOn counts, per simulator, the requests whose body contains marker.
func legsOn(sims []*pdsim.Server, marker string) []int {
	counts := make([]int, len(sims))
	for i, s := range sims {
		for _, r := range s.Requests() {
			if !askedTokens(r.Path) && strings.Contains(string(r.Body), marker) {
				counts[i]++
			}
		}
	}
	return counts
}

func TestFailingPrefillEndpointIsEjected(t *testing.T) {
	r := startRig(t, rigOptions{
		prefillPool: "policy: round-robin, health: {consecutive_failures: 2, base_ejection: 1m}",
		extra:       "prefill: {on_failure: fail}",
	})
	r.prefill[0].SetFaults(pdsim.Faults{FailStatus: http.StatusInternalServerError})
	const requests = 20
	for i := range requests {
		path, body := request("chat", false, fmt.Sprintf("ejection %d", i))
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: status %d: %s", i, resp.StatusCode, got)
		}
	}
	failing, healthy := len(r.prefill[0].Requests()), legsOn(r.prefill[1:], "ejection")[0]
	// Each failure is retried on the healthy endpoint, so no request fails; after
	// consecutive_failures the failing endpoint gets no more legs.
	if failing > 2 || healthy != requests {
		t.Errorf("prefill legs: failing endpoint %d, healthy endpoint %d; want at most 2 and %d", failing, healthy, requests)
	}
}

// One-shot requests that share a prefix longer than the key (4 blocks of 64
// bytes here) go to one prefill endpoint; unrelated prompts spread.
func TestSharedPrefixesStickToOnePrefillEndpoint(t *testing.T) {
	r := startRig(t, rigOptions{prefillPool: "policy: prefix-affinity, prefix: {block_chars: 64, key_blocks: 4}"})
	system := strings.Repeat("You are a careful assistant who answers in French. ", 8)
	const turns = 20
	for i := range turns {
		path, body := request("chat", false, fmt.Sprintf("%s shared turn %d", system, i))
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
	}
	counts := legsOn(r.prefill, "shared turn")
	if top := max(counts[0], counts[1]); top*10 < turns*9 {
		t.Errorf("shared-prefix prefill legs per endpoint %v: want >= 90%% on one", counts)
	}

	for i := range turns {
		path, body := request("chat", false, fmt.Sprintf("distinct prompt %d: %s", i, strings.Repeat(fmt.Sprint(i), 300)))
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
	}
	if spread := legsOn(r.prefill, "distinct prompt"); spread[0] == 0 || spread[1] == 0 {
		t.Errorf("distinct prompts per prefill endpoint %v: want both used", spread)
	}
}

func TestShortPromptSkipsThePrefillLeg(t *testing.T) {
	tests := []struct {
		name, prompt string
		wantPrefill  int
	}{
		{"short prompt goes decode-only", "short one", 0},
		{"long prompt is disaggregated", "long one " + strings.Repeat("word ", 200), 1},
	}
	// In BUFFERED a decode-only body needs no change, so extproc does not send it
	// back and Envoy forwards its own copy: the engine must still get it whole.
	for _, mode := range []string{"full_duplex", "buffered"} {
		r := startRig(t, rigOptions{mode: mode, extra: "pd: {min_prompt_tokens: 100}"})
		for _, tt := range tests {
			t.Run(mode+"/"+tt.name, func(t *testing.T) {
				path, body := request("chat", false, mode+tt.prompt)
				if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d: %s", resp.StatusCode, got)
				}
				marker := mode + tt.prompt[:8]
				if got := legsOn(r.prefill, marker); got[0]+got[1] != tt.wantPrefill {
					t.Errorf("prefill legs %v, want %d in all", got, tt.wantPrefill)
				}
				if got := legsOn(r.decode, marker); got[0]+got[1] != 1 {
					t.Errorf("decode legs %v, want 1", got)
				}
				_, rec := served(t, r.decode, func(rec pdsim.Record) bool { return strings.Contains(string(rec.Body), marker) })
				if tt.wantPrefill == 0 && string(rec.Body) != body {
					t.Errorf("decode-only leg body\n%s\nwant the client's\n%s", rec.Body, body)
				}
			})
		}
	}
}

func TestConfigReloadMovesTrafficWithoutRestart(t *testing.T) {
	r := startRig(t, rigOptions{})
	only := func(addr string) string {
		return fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}
`, r.prefill[0].Addr(), addr)
	}
	for i, tt := range []struct{ config, wantDecode string }{
		{only(r.decode[1].Addr()), r.decode[1].Addr()},
		{"connector: kv-nixl\npools: {decode: {endpoints: [\"not-an-ip:1\"]}}\n", r.decode[1].Addr()}, // rejected: the previous config stays
		{only(r.decode[0].Addr()), r.decode[0].Addr()},
	} {
		if err := os.WriteFile(r.extproc.ConfigPath, []byte(tt.config), 0o600); err != nil {
			t.Fatal(err)
		}
		if i == 1 {
			r.extproc.waitLog(t, "config change rejected")
		} else {
			r.extproc.waitLog(t, fmt.Sprintf(`"decode":["%s"]`, tt.wantDecode))
		}
		path, body := request("chat", false, fmt.Sprintf("reload %d", i))
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
		if up := r.proxy.Upstreams(); up[len(up)-1] != tt.wantDecode {
			t.Errorf("step %d: routed to %s, want %s", i, up[len(up)-1], tt.wantDecode)
		}
	}
}

// A reload that gives the decode pool a DNS name in place of its static
// endpoints keeps them serving until the name first resolves, as Envoy warms
// a changed cluster: the name here never does, and no resolver sends it (a
// label of 64 bytes, past DNS's 63). One that moves it to
// Kubernetes discovery, which starts only with the process, keeps them until
// the restart. In both the pool was empty from the reload on, and every
// request got 503.
func TestReloadToAnotherSourceKeepsServing(t *testing.T) {
	for _, tt := range []struct{ name, decode, log string }{
		{"to a DNS name", `{dns: "` + strings.Repeat("x", 64) + `.invalid:8000", dns_interval: 50ms}`, "DNS lookup failed; keeping the endpoints found before"},
		{"to Kubernetes discovery", `{kubernetes: {selector: role=decode, port: 8000}}`, `"pools.decode.endpoints","pools.decode.kubernetes"`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{})
			config := fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: %s}\n", r.prefill[0].Addr(), tt.decode)
			if err := os.WriteFile(r.extproc.ConfigPath, []byte(config), 0o600); err != nil {
				t.Fatal(err)
			}
			r.extproc.waitLog(t, tt.log)
			path, body := request("chat", false, "reloaded "+tt.name)
			if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d after the reload: %s", resp.StatusCode, got)
			}
			if up := r.proxy.Upstreams(); !slices.Contains([]string{r.decode[0].Addr(), r.decode[1].Addr()}, up[len(up)-1]) {
				t.Errorf("routed to %s, want one of the static decode endpoints", up[len(up)-1])
			}
		})
	}
}

// An SGLang decode engine whose P/D queues are full (as its /metrics, under
// SGLang's names, reports them) is passed over, though its waiting queue is
// empty like the other's.
func TestBusySGLangDecodeEndpointIsPassedOver(t *testing.T) {
	r := startRig(t, rigOptions{connector: "kv-sglang", decodePool: "metrics: {interval: 100ms, stale_after: 1h}"})
	r.decode[0].SetQueues(pdsim.Queues{DecodePrealloc: 20, DecodeTransfer: 10})
	n := 0
	onIdle := func() bool {
		n++
		path, body := request("chat", false, fmt.Sprintf("sglang queues %d", n))
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
		up := r.proxy.Upstreams()
		return up[len(up)-1] == r.decode[1].Addr()
	}
	// Until a scrape has seen the queues the two are even; after it, never. (Five requests in a
	// row on the idle one said nothing: before the first scrape, one run in 32 has them.)
	waitFor(t, 20*time.Second, "a scrape to see the busy decode engine's queues", func() bool {
		return r.metric(t, fmt.Sprintf(`pd_extproc_endpoint_engine_waiting{endpoint=%q,pool="decode"}`, r.decode[0].Addr())) >= 30
	})
	for i := range 20 {
		if !onIdle() {
			t.Fatalf("request %d after the scrape went to the busy decode endpoint %s", i, r.decode[0].Addr())
		}
	}
}

// SGLang prefill engines sharing a host each listen for their decodes'
// bootstrap on a port of their own; the pool's config names one port. Each
// engine's own is read from its server info, so every request's decode
// reaches the bootstrap server of the prefill engine that took its leg. With
// the pool's port for both, the second engine's decodes knocked on the first
// one's bootstrap server and failed at their handshake bound.
func TestSGLangPrefillsOnOneHostKeepTheirBootstrapPorts(t *testing.T) {
	var second *pdsim.Server
	r := startRig(t, rigOptions{connector: "kv-sglang", prefills: 1, handshake: 2 * time.Second, prefillPool: "policy: round-robin",
		prefillAddrs: func(sims []*pdsim.Server) []string {
			ip, _ := hostPort(t, sims[0].Addr())
			second = testbed.MustStartSim(t, testbed.SimConfig{Role: pdsim.RolePrefill, Protocol: pdsim.ProtocolSGLang, IP: ip,
				Timings: testbed.Timings{TTFT: time.Millisecond, TPOT: time.Millisecond, OutputTokens: 5, HandshakeTimeout: 2 * time.Second}})
			return []string{sims[0].Addr(), second.Addr()}
		}})
	prefills := []*pdsim.Server{r.prefill[0], second}
	for _, p := range prefills {
		_, port := hostPort(t, p.BootstrapAddr())
		series := fmt.Sprintf(`pd_extproc_endpoint_bootstrap_port{endpoint=%q,pool="prefill"}`, p.Addr())
		waitFor(t, 10*time.Second, series+" "+port, func() bool { return fmt.Sprint(r.metric(t, series)) == port })
	}
	for i := range 6 {
		marker := fmt.Sprintf("one host, two bootstrap ports %d", i)
		path, body := request("chat", false, marker)
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK || resp.Header.Get("x-pdsim-kv") != "hit" {
			t.Fatalf("request %d: status %d, KV %q: %.200s", i, resp.StatusCode, resp.Header.Get("x-pdsim-kv"), got)
		}
		legs := legsOn(prefills, marker)
		p := prefills[slices.Index(legs, 1)]
		if d := recordsWith(r.decode, marker); len(d) != 1 || d[0].KVSource != p.BootstrapAddr() {
			t.Errorf("request %d: prefill legs %v; decode records %+v, want one pulling from %s", i, legs, d, p.BootstrapAddr())
		}
	}
	if legs := [2]int{len(prefills[0].Requests()), len(prefills[1].Requests())}; legs[0] == 0 || legs[1] == 0 {
		t.Errorf("prefill legs per engine %v, want both engines used", legs)
	}
}

// TestReplicasAgreeOnPrefixAffinity: three extproc replicas behind one Envoy,
// which hands them the streams in turn, share nothing; yet each repeated
// prefix keeps its prefill legs on one endpoint, because every replica ranks
// the endpoints alike for it, with the default prefix.* settings. Two kinds
// of repeat: one-shot questions under a system prompt shorter than the key
// (they share the system prompt, the key), and the turns of a conversation
// (they share their head, the system and first user message). The system
// prompts spread over the endpoints. The simulators' ports are random, so
// the ranks are too: eight system prompts all ranked first on one of three
// endpoints happened once in 2,187 runs (it did, in CI); sixteen do once in
// 14 million.
func TestReplicasAgreeOnPrefixAffinity(t *testing.T) {
	const replicas, conversations, systems, repeats = 3, 8, 16, 12
	r := startRig(t, rigOptions{prefills: 3, replicas: replicas, prefillPool: "policy: prefix-affinity"})
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	chat := func(msgs ...message) string {
		b, err := json.Marshal(map[string]any{"model": "pdsim", "max_tokens": 4, "messages": msgs})
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	send := func(body string) {
		if resp, got := r.must(t, "/v1/chat/completions", body, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
	}
	histories := make([][]message, conversations)
	for turn := range repeats { // interleaved, so each replica sees every prefix
		for p := range histories {
			if turn == 0 {
				histories[p] = []message{{"system", "Be brief."}, {"user", fmt.Sprintf("[conversation %d] Hello.", p)}}
			} else {
				histories[p] = append(histories[p], message{"assistant", "Noted: the answer is long enough to cross a block."},
					message{"user", fmt.Sprintf("Question %d, with some more words.", turn)})
			}
			send(chat(histories[p]...))
		}
		for p := range systems {
			// About 1,000 characters: four blocks, well under the 64 of the key.
			system := strings.Repeat(fmt.Sprintf("Agent %d: answer as assistant number %d would. ", p, p), 20)
			send(chat(message{"system", system}, message{"user", fmt.Sprintf("[shared %d] question %d: what changed?", p, turn)}))
		}
	}
	var markers []string
	for p := range conversations {
		markers = append(markers, fmt.Sprintf("[conversation %d]", p))
	}
	for p := range systems {
		markers = append(markers, fmt.Sprintf("[shared %d] question", p))
	}
	homes := map[int]bool{}
	for _, marker := range markers {
		counts := legsOn(r.prefill, marker)
		top, total, home := 0, 0, 0
		for e, n := range counts {
			if n > top {
				top, home = n, e
			}
			total += n
		}
		t.Logf("%s: prefill legs per endpoint %v", marker, counts)
		if total != repeats || top*10 < total*9 {
			t.Errorf("%s: prefill legs per endpoint %v; want all %d and >= 90%% on one", marker, counts, repeats)
		}
		if strings.HasPrefix(marker, "[shared") {
			homes[home] = true
		}
	}
	if len(homes) < 2 {
		t.Errorf("the %d system prompts all went to prefill endpoint %v: they do not spread", systems, homes)
	}
	for i, x := range r.replicas {
		if n, err := x.Metric(t.Context(), `pd_extproc_requests_total{api="chat",connector="kv-nixl",mode="pd",outcome="routed"}`); err != nil || n == 0 {
			t.Errorf("replica %d routed %v requests (%v): the streams did not reach every replica", i, n, err)
		}
	}
}

// TestTenantsOfOneSystemPromptRankApart: one system prompt asked under
// sixteen tenants' namespaces, eight with a cache_salt of their own and
// eight for a LoRA adapter of their own, which the engines cache apart:
// every replica keeps each tenant's prefill legs on one endpoint, and the
// tenants spread over the endpoints, as sixteen different prompts would.
// Ranked by the prompt alone they would all share its one home; sixteen
// tenants all ranking one of three endpoints first (the ranks follow the
// simulators' random ports) would happen once in 14 million runs.
func TestTenantsOfOneSystemPromptRankApart(t *testing.T) {
	const replicas, tenants, questions = 3, 16, 6
	adapters := make([]string, tenants/2)
	for i := range adapters {
		adapters[i] = fmt.Sprintf("lora-%d", i)
	}
	r := startRig(t, rigOptions{prefills: 3, replicas: replicas, prefillPool: "policy: prefix-affinity", lora: adapters})
	system := strings.Repeat("Answer as the house's careful assistant would. ", 20)
	for q := range questions {
		for i := range tenants {
			fields := map[string]any{"model": "pdsim", "max_tokens": 4, "messages": []map[string]string{
				{"role": "system", "content": system}, {"role": "user", "content": fmt.Sprintf("[tenant %d] question %d: what changed?", i, q)}}}
			if i%2 == 0 {
				fields["cache_salt"] = fmt.Sprintf("tenant-%d", i)
			} else {
				fields["model"] = adapters[i/2]
			}
			b, err := json.Marshal(fields)
			if err != nil {
				t.Fatal(err)
			}
			if resp, got := r.must(t, "/v1/chat/completions", string(b), nil); resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
		}
	}
	homes := map[int]bool{}
	for i := range tenants {
		counts := legsOn(r.prefill, fmt.Sprintf("[tenant %d]", i))
		top, home := 0, 0
		for e, n := range counts {
			if n > top {
				top, home = n, e
			}
		}
		if top != questions {
			t.Errorf("tenant %d: prefill legs per endpoint %v; want all %d on one", i, counts, questions)
		}
		homes[home] = true
	}
	if len(homes) < 2 {
		t.Errorf("the %d tenants all went to prefill endpoint %v: ranked by the prompt alone", tenants, homes)
	}
}

// TestEachModelReachesItsEngines: one pd-extproc in front of two models,
// each pool holding engines of both (pdsim's own two prefill and two decode
// engines, and one of each serving "qwen"). Once the pools have read what
// each engine lists at GET /v1/models, every request goes P/D to engines of
// the model it names, on both legs: an engine of the other model would
// answer it 404. GET /v1/models through the gateway lists both models, each
// once; SGLang's GET /v1/models/{model} reaches an engine of that model.
func TestEachModelReachesItsEngines(t *testing.T) {
	const other, perModel = "qwen", 8
	for _, connector := range []string{"kv-nixl", "kv-sglang"} {
		t.Run(connector, func(t *testing.T) {
			var qwen []*pdsim.Server // its prefill engine, then its decode engine
			withQwen := func(role string) func(sims []*pdsim.Server) []string {
				return func(sims []*pdsim.Server) []string {
					s := testbed.MustStartSim(t, testbed.SimConfig{Role: role, Protocol: testbed.Protocols[connector], Model: other, IP: simIP(role, 9),
						Timings: testbed.Timings{TTFT: time.Millisecond, TPOT: time.Millisecond, KVTransfer: time.Millisecond, OutputTokens: 5,
							HandshakeTimeout: 10 * time.Second},
						Log: logTo(t)})
					qwen = append(qwen, s)
					return append(testbed.Addrs(sims), s.Addr())
				}
			}
			r := startRig(t, rigOptions{connector: connector, prefillAddrs: withQwen(pdsim.RolePrefill), decodeAddrs: withQwen(pdsim.RoleDecode)})
			pools := map[string][]*pdsim.Server{"prefill": append(slices.Clone(r.prefill), qwen[0]), "decode": append(slices.Clone(r.decode), qwen[1])}
			for pool, sims := range pools {
				for _, s := range sims {
					series := fmt.Sprintf(`pd_extproc_endpoint_models{endpoint=%q,pool=%q}`, s.Addr(), pool)
					waitFor(t, 10*time.Second, "the models of "+s.Addr(), func() bool { return r.extproc.MustMetric(t, series) == 1 })
				}
			}
			for _, model := range []string{"pdsim", other} {
				for i := range perModel {
					b, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 4,
						"messages": []map[string]string{{"role": "user", "content": fmt.Sprintf("[%s %d] which model am I talking to?", model, i)}}})
					if resp, got := r.must(t, "/v1/chat/completions", string(b), nil); resp.StatusCode != http.StatusOK {
						t.Fatalf("%s: status %d: %s", model, resp.StatusCode, got)
					}
				}
			}
			tests := []struct {
				model      string
				sims, rest []*pdsim.Server // its engines, the others
			}{
				{"pdsim", slices.Concat(r.prefill, r.decode), qwen},
				{other, qwen, slices.Concat(r.prefill, r.decode)},
			}
			for _, tc := range tests {
				legs := recordsWith(tc.sims, "["+tc.model+" ")
				if len(legs) != 2*perModel {
					t.Errorf("%s: its engines got %d legs, want %d", tc.model, len(legs), 2*perModel)
				}
				if stray := recordsWith(tc.rest, "["+tc.model+" "); len(stray) > 0 {
					t.Errorf("%s: %d legs reached engines of the other model: %+v", tc.model, len(stray), stray)
				}
			}
			checkModelList(t, r, "pdsim", other)
			for i := range map[bool]int{true: 6}[connector == "kv-sglang"] { // two decode engines of three would answer 404
				resp, got := r.get(t, "/v1/models/"+other)
				if resp.StatusCode != http.StatusOK || !strings.Contains(got, `"id":"`+other+`"`) {
					t.Errorf("GET /v1/models/%s (%d): %d %s, want its card from an engine serving it", other, i, resp.StatusCode, got)
				}
			}
		})
	}
}

// checkModelList asks the gateway for GET /v1/models: an answer of
// pd-extproc's own in OpenAI's shape, naming each of models once.
func checkModelList(t *testing.T, r *rig, models ...string) {
	t.Helper()
	resp, got := r.get(t, "/v1/models")
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(got), &list); err != nil || resp.StatusCode != http.StatusOK || list.Object != "list" ||
		resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("GET /v1/models: %d %s %s (%v), want 200 and a model list", resp.StatusCode, resp.Header.Get("Content-Type"), got, err)
	}
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if !slices.Equal(ids, models) {
		t.Errorf("GET /v1/models lists %v, want %v", ids, models)
	}
}
