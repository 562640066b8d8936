package pdsim

import (
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
)

type turn struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// words is n distinct words, the same for the same name.
func words(name string, n int) string {
	w := make([]string, n)
	for i := range w {
		w[i] = fmt.Sprintf("%s%d", name, i)
	}
	return strings.Join(w, " ")
}

func chatOf(extra string, msgs ...turn) string {
	b, _ := json.Marshal(msgs)
	return `{"model":"pdsim","messages":` + string(b) + extra + `}`
}

// A conversation as the simulator tokenizes it (a token per role and per
// word): turn 1 is 41 tokens, 2 full blocks; turn 2 adds the reply and a
// question, 48 tokens, exactly 3 full blocks; turn 3 is 56.
var (
	ask1           = turn{"user", words("w", 40)}
	assistantReply = turn{"assistant", "tok0 tok1 tok2"}
	turn1          = []turn{ask1}
	turn2          = []turn{ask1, assistantReply, {"user", "and then?"}}
	turn3          = append(turn2[:len(turn2):len(turn2)], assistantReply, turn{"user", "and after that?"})
	// unrelated is as long as turn 1 and shares no block with it.
	unrelated = []turn{{"user", words("x", 40)}}
	// forked is turn 2 with a word of turn 1's question changed in its second
	// block (token 21): its first block is turn 1's, its second not.
	forked = []turn{{"user", strings.Replace(ask1.Content, "w20 ", "changed ", 1)}, assistantReply, {"user", "and then?"}}
)

const prefillAsk = `,"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}`

// cachedInUsage is the cached_tokens a client reads in the answer's usage,
// where the API reports it.
func cachedInUsage(t *testing.T, path string, r reply) (int, bool) {
	t.Helper()
	var a struct {
		Usage struct {
			Prompt *struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
			Input *struct {
				Cached int `json:"cached_tokens"`
			} `json:"input_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(r.body, &a); err != nil {
		t.Fatalf("%s answered %s: %v", path, r.body, err)
	}
	switch {
	case a.Usage.Prompt != nil:
		return a.Usage.Prompt.Cached, true
	case a.Usage.Input != nil:
		return a.Usage.Input.Cached, true
	}
	return 0, false
}

func TestPrefixCacheAsVLLMReportsIt(t *testing.T) {
	const chatPath = "/v1/chat/completions"
	type step struct {
		prefill bool   // sent to the prefill engine, else to the decode engine
		path    string // default chatPath
		body    string
		// pullKV adds the kv_transfer_params of the previous step's answer, as
		// a router passes the prefill leg's on to the decode leg.
		pullKV bool
		cached int // in the header, the usage and the record
	}
	// decode is the commonest step: a conversation sent to the decode engine alone.
	decode := func(conversation []turn, cached int) step {
		return step{body: chatOf("", conversation...), cached: cached}
	}
	tests := []struct {
		name     string
		capacity int // Config.PrefixCacheBlocks; 0: the default
		steps    []step
	}{
		{name: "the same prompt twice: its full blocks, never the last token", steps: []step{decode(turn1, 0), decode(turn1, 32)}},
		{name: "a later turn finds the blocks its earlier turns left", steps: []step{decode(turn1, 0), decode(turn2, 32), decode(turn3, 48)}},
		{name: "KV pulled from the prefill counts whole, and serves the next turn", steps: []step{
			{prefill: true, body: chatOf(prefillAsk, turn1...), cached: 0},
			{pullKV: true, body: chatOf("", turn1...), cached: 41},
			decode(turn2, 32),
		}},
		{name: "a turn pulled from the prefill after a decode-only one", steps: []step{
			decode(turn1, 0),
			{prefill: true, body: chatOf(prefillAsk, turn2...), cached: 0},
			{pullKV: true, body: chatOf("", turn2...), cached: 48},
			decode(turn3, 48),
		}},
		{name: "an unrelated prompt", steps: []step{decode(turn1, 0), decode(unrelated, 0)}},
		{name: "a conversation that parts in the second block", steps: []step{decode(turn1, 0), decode(forked, 16)}},
		{name: "completions: a prompt that extends another", steps: []step{
			{path: "/v1/completions", body: `{"prompt":"` + words("w", 40) + `"}`, cached: 0},
			{path: "/v1/completions", body: `{"prompt":"` + words("w", 40) + " " + words("y", 10) + `"}`, cached: 32},
			{path: "/v1/completions", body: `{"prompt":"` + words("y", 40) + `"}`, cached: 0},
		}},
		{name: "token ids: a prompt that extends another", steps: []step{
			{path: "/inference/v1/generate", body: `{"token_ids":` + ids(1, 40) + `}`, cached: 0},
			{path: "/inference/v1/generate", body: `{"token_ids":` + ids(1, 50) + `}`, cached: 32},
		}},
		{name: "the Responses API", steps: []step{
			{path: "/v1/responses", body: `{"input":"` + words("w", 40) + `","store":false}`, cached: 0},
			{path: "/v1/responses", body: `{"input":"` + words("w", 40) + `","store":false}`, cached: 32},
		}},
		{name: "a cache_salt keys the first block, so the rest cannot be reached", steps: []step{
			{body: chatOf(`,"cache_salt":"s1"`, turn1...), cached: 0},
			{body: chatOf(`,"cache_salt":"s1"`, turn2...), cached: 32},
			{body: chatOf(`,"cache_salt":"s2"`, turn2...), cached: 0},
			decode(turn2, 0),
			{body: chatOf(`,"cache_salt":null`, turn2...), cached: 32},
		}},
		{name: "a cache_salt of 128 characters keys the first block", steps: []step{
			{body: chatOf(`,"cache_salt":"`+strings.Repeat("é", 128)+`"`, turn1...), cached: 0},
			decode(turn1, 0),
		}},
		{name: "Anthropic's Messages: vLLM drops its cache_salt", steps: []step{
			{path: "/v1/messages", body: `{"model":"pdsim","max_tokens":5,"cache_salt":"s1","messages":[{"role":"user","content":"` + words("w", 40) + `"}]}`, cached: 0},
			{body: `{"model":"pdsim","messages":[{"role":"user","content":"` + words("w", 40) + `"}]}`, cached: 32}, // its answer tells
		}},
		{name: "an adapter's blocks are its own", steps: []step{
			decode(turn1, 0),
			{body: forAdapter(chatOf("", turn1...)), cached: 0},
			{body: forAdapter(chatOf("", turn2...)), cached: 32},
			decode(turn2, 32),
		}},
		{name: "a cache of 2 blocks forgets turn 1 for the unrelated prompt", capacity: 2, steps: []step{decode(turn1, 0), decode(unrelated, 0), decode(turn1, 0)}},
		{name: "a cache of 3 blocks forgets the tail of turn 1 first", capacity: 3, steps: []step{decode(turn1, 0), decode(unrelated, 0), decode(turn1, 16)}},
		{name: "a cache of 4 blocks holds both", capacity: 4, steps: []step{decode(turn1, 0), decode(unrelated, 0), decode(turn1, 32)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Config{Protocol: ProtocolNIXL, PromptTokensDetails: true, PrefixCacheBlocks: tt.capacity, LoRA: []string{"sql-lora"}}
			cfg.Role = RolePrefill
			p := start(t, cfg)
			cfg.Role = RoleDecode
			d := start(t, cfg)
			var last reply
			for i, st := range tt.steps {
				s, path, body := d, st.path, st.body
				if st.prefill {
					s = p
				}
				if path == "" {
					path = chatPath
				}
				if st.pullKV {
					body = strings.TrimSuffix(body, "}") + `,"kv_transfer_params":` + string(kvOf(t, last)) + `}`
				}
				last = post(t, s, path, body, "")
				if last.status != 200 {
					t.Fatalf("step %d: %d %s", i, last.status, last.body)
				}
				if got := last.header.Get("x-pdsim-cached-tokens"); got != strconv.Itoa(st.cached) {
					t.Errorf("step %d: x-pdsim-cached-tokens %q, want %d", i, got, st.cached)
				}
				// As most vLLM releases, no prompt_tokens_details when nothing
				// was cached; the Responses API always has its details.
				if got, ok := cachedInUsage(t, path, last); ok != (st.cached > 0 || path == "/v1/responses") || ok && got != st.cached {
					t.Errorf("step %d: usage cached_tokens %d (reported %v), want %d: %s", i, got, ok, st.cached, last.body)
				}
				recs := s.Requests()
				if rec := recs[len(recs)-1]; rec.CachedTokens != st.cached {
					t.Errorf("step %d: record %+v, want CachedTokens %d", i, rec, st.cached)
				}
				if st.pullKV && last.header.Get("x-pdsim-kv") != kvHit {
					t.Errorf("step %d: x-pdsim-kv %q, want a hit", i, last.header.Get("x-pdsim-kv"))
				}
			}
		})
	}
}

// forAdapter is body (for pdsim) for the LoRA adapter sql-lora.
func forAdapter(body string) string {
	return strings.Replace(body, `"model":"pdsim"`, `"model":"sql-lora"`, 1)
}

// ids is the token ids from..to as a JSON list.
func ids(from, to int) string {
	s := make([]string, 0, to-from+1)
	for i := from; i <= to; i++ {
		s = append(s, strconv.Itoa(i))
	}
	return "[" + strings.Join(s, ",") + "]"
}

// vLLM's /metrics counts the prompt tokens the engine looked up in its prefix
// cache and those it found (KV pulled from a prefill is no lookup), the prompt
// tokens of every request and the tokens generated, and says the size of its
// KV cache in the labels of cache_config_info; as each request finishes, its
// prefill histograms count the prompt tokens it computed and its prefill's
// seconds.
func TestPrefixCacheCounters(t *testing.T) {
	p, d := nixlPair(t)
	post(t, d, "/v1/chat/completions", chatOf("", turn1...), "")
	post(t, d, "/v1/chat/completions", chatOf("", turn2...), "")
	params := kvOf(t, post(t, p, "/v1/chat/completions", chatOf(prefillAsk, unrelated...), ""))
	if r := post(t, d, "/v1/chat/completions", chatOf(`,"kv_transfer_params":`+string(params), unrelated...), ""); r.header.Get("x-pdsim-kv") != kvHit {
		t.Fatalf("decode leg: %d %v %s", r.status, r.header, r.body)
	}
	m := string(get(t, d, "/metrics").body)
	for _, want := range []string{
		"# TYPE vllm:prefix_cache_queries_total counter\n",
		`vllm:prefix_cache_queries_total{engine="0",model_name="pdsim"} 89` + "\n", // 41 + 48
		"# TYPE vllm:prefix_cache_hits_total counter\n",
		`vllm:prefix_cache_hits_total{engine="0",model_name="pdsim"} 32` + "\n",
		"# TYPE vllm:prompt_tokens_total counter\n",
		`vllm:prompt_tokens_total{engine="0",model_name="pdsim"} 130` + "\n", // 89 and the pulled prompt's 41
		"# TYPE vllm:generation_tokens_total counter\n",
		`vllm:generation_tokens_total{engine="0",model_name="pdsim"} 48` + "\n", // 16 a request
		"# TYPE vllm:request_prefill_kv_computed_tokens histogram\n",
		`vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="pdsim"} 57` + "\n", // 41 and 48 less 32; the pulled prompt none
		`vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="pdsim"} 3` + "\n",
		"# TYPE vllm:request_prefill_time_seconds histogram\n",
		`vllm:request_prefill_time_seconds_count{engine="0",model_name="pdsim"} 3` + "\n",
		"# TYPE vllm:cache_config_info gauge\n",
		`vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="8192"} 1.0` + "\n",
	} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %q:\n%s", want, m)
		}
	}
}

// Concurrent requests share the cache; whichever computes first, the ones
// after them all find the prompt.
func TestPrefixCacheConcurrentRequests(t *testing.T) {
	d := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL, PromptTokensDetails: true, PrefixCacheBlocks: 8})
	var replies []<-chan reply
	for i := range 8 {
		msgs := turn1
		if i%2 == 1 {
			msgs = unrelated
		}
		replies = append(replies, goPost(d, "/v1/chat/completions", chatOf("", msgs...), ""))
	}
	for _, c := range replies {
		if r := <-c; r.status != 200 || r.header.Get("x-pdsim-cached-tokens") != "0" && r.header.Get("x-pdsim-cached-tokens") != "32" {
			t.Errorf("concurrent request: %d %v %s", r.status, r.header, r.body)
		}
	}
	for _, msgs := range [][]turn{turn1, unrelated} {
		if r := post(t, d, "/v1/chat/completions", chatOf("", msgs...), ""); r.header.Get("x-pdsim-cached-tokens") != "32" {
			t.Errorf("after the concurrent requests: x-pdsim-cached-tokens %q, want 32", r.header.Get("x-pdsim-cached-tokens"))
		}
	}
}

// SGLang reports cached_tokens in meta_info: the decode counts the KV it took
// from the prefill, the prefill its own prefix cache.
func TestSGLangCachedTokens(t *testing.T) {
	p := start(t, Config{Role: RolePrefill, Protocol: ProtocolSGLang})
	d := start(t, Config{Role: RoleDecode, Protocol: ProtocolSGLang})
	host, port, _ := net.SplitHostPort(p.BootstrapAddr())
	for i, wantPrefill := range []int{0, 32} {
		body := `{"text":"` + words("w", 40) + `","sampling_params":{"max_new_tokens":2},"bootstrap_host":"` + host +
			`","bootstrap_port":` + port + `,"bootstrap_room":` + strconv.Itoa(i) + `}`
		prefilled := goPost(p, "/generate", body, "")
		dr := post(t, d, "/generate", body, "")
		pr := <-prefilled
		for _, leg := range []struct {
			name string
			r    reply
			want int
		}{{"prefill", pr, wantPrefill}, {"decode", dr, 40}} {
			var a sglangAnswer
			if err := json.Unmarshal(leg.r.body, &a); err != nil || leg.r.status != 200 {
				t.Fatalf("request %d, %s: %d %s", i, leg.name, leg.r.status, leg.r.body)
			}
			if a.MetaInfo.CachedTokens != leg.want || leg.r.header.Get("x-pdsim-cached-tokens") != strconv.Itoa(leg.want) {
				t.Errorf("request %d, %s: meta_info %+v, header %q; want cached_tokens %d",
					i, leg.name, a.MetaInfo, leg.r.header.Get("x-pdsim-cached-tokens"), leg.want)
			}
		}
	}
}

// POST /reset_prefix_cache, as vLLM serves it in its dev mode, forgets every
// block: the prompt computed before it is not found after it.
func TestResetPrefixCache(t *testing.T) {
	d := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL, PromptTokensDetails: true, PrefixCacheBlocks: 64})
	post(t, d, "/v1/chat/completions", chatOf("", turn1...), "")
	for _, tt := range []struct {
		reset bool
		want  string
	}{{false, "32"}, {true, "0"}} {
		if tt.reset {
			if r := post(t, d, "/reset_prefix_cache", "", ""); r.status != 200 {
				t.Fatalf("POST /reset_prefix_cache: %d %s", r.status, r.body)
			}
		}
		if r := post(t, d, "/v1/chat/completions", chatOf("", turn1...), ""); r.header.Get("x-pdsim-cached-tokens") != tt.want {
			t.Errorf("after reset %v: x-pdsim-cached-tokens %q, want %s", tt.reset, r.header.Get("x-pdsim-cached-tokens"), tt.want)
		}
		post(t, d, "/v1/chat/completions", chatOf("", turn1...), "") // cached again
	}
}
