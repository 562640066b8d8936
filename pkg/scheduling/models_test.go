package scheduling

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/go-logr/zapr"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// vllmModels is vLLM's GET /v1/models: a model under two served names and
// a LoRA adapter on it (show_available_models).
const vllmModels = `{"object":"list","data":[` +
	`{"id":"qwen","object":"model","created":1,"owned_by":"vllm","root":"/models/Qwen3-8B","parent":null,"max_model_len":32768,"permission":[{}]},` +
	`{"id":"Qwen/Qwen3-8B","object":"model","created":1,"owned_by":"vllm","root":"/models/Qwen3-8B","parent":null,"max_model_len":32768,"permission":[{}]},` +
	`{"id":"sql-lora","object":"model","created":1,"owned_by":"vllm","root":"/adapters/sql","parent":"qwen","max_model_len":null,"permission":[{}]}]}`

func TestFetchModels(t *testing.T) {
	tests := []struct {
		name, answer string
		want         []string
		err          string
	}{
		{"vLLM: served names and adapters", vllmModels, []string{"Qwen/Qwen3-8B", "qwen", "sql-lora"}, ""},
		{"SGLang", `{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model","created":1,"owned_by":"sglang","root":"meta-llama/Llama-3.1-8B-Instruct","max_model_len":131072}]}`,
			[]string{"meta-llama/Llama-3.1-8B-Instruct"}, ""},
		{"--api-key guards the list", "401", nil, "answered 401"},
		{"not JSON", "<html>", nil, "invalid character"},
		{"an empty list", `{"object":"list","data":[]}`, nil, "lists no model"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			engine := newSGLangEngine(t, api.ModelsPath, tc.answer)
			m := fetchModels(context.Background(), probe{client: probeClient(nil), scheme: "http"}, engine.addr, config.DefaultCheckTimeout)
			if got := slices.Sorted(maps.Keys(m.names)); !slices.Equal(got, tc.want) {
				t.Errorf("names %v, want %v", got, tc.want)
			}
			if !strings.Contains(m.err, tc.err) || (tc.err == "") != (m.err == "") {
				t.Errorf("err %q, want one with %q", m.err, tc.err)
			}
		})
	}
}

// modelRequest is a completions request naming model, read as the pipeline
// reads it.
func modelRequest(t testing.TB, model, prompt string) *Request {
	t.Helper()
	fields := map[string]string{"prompt": prompt}
	if model != "" {
		fields["model"] = model
	}
	b, _ := json.Marshal(fields)
	obj, err := body.Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	return NewRequest(api.Completions.PromptOf(obj, api.VLLM))
}

// serving gives each endpoint of p the models its engine would list; an
// address missing from lists was never read, and one listing nil never
// answered (its --api-key guards the list).
func serving(p *Pool, lists map[string][]string) {
	for _, e := range p.Endpoints() {
		if names, ok := lists[e.Addr]; ok && names == nil {
			e.models.Store(&servedModels{err: "answered 401"})
		} else if ok {
			m := servedModels{names: map[string]json.RawMessage{}}
			for _, n := range names {
				m.names[n] = json.RawMessage(`{"id":"` + n + `","object":"model","owned_by":"` + e.Addr + `"}`)
			}
			e.models.Store(&m)
		}
	}
	p.recountModels()
}

// A pool whose engines serve different models sends each request only to
// the endpoints that list the model it names, under every policy; a model
// none lists, or no model at all, may go anywhere, as before the lists.
func TestRequestsGoWhereTheirModelIsServed(t *testing.T) {
	const a1, a2, b1, fresh, guarded = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000", "10.0.0.5:8000"
	lists := map[string][]string{a1: {"llama", "llama-sql"}, a2: {"llama"}, b1: {"qwen"}, guarded: nil} // fresh: not read yet
	tests := []struct {
		model string
		want  []string // the endpoints some request reaches
	}{
		{"llama", []string{a1, a2, guarded}},
		{"llama-sql", []string{a1, guarded}},
		{"qwen", []string{b1, guarded}},
		{"mistral", []string{a1, a2, b1, fresh, guarded}}, // listed nowhere: an adapter loaded since, or a typo the engine answers
		{"", []string{a1, a2, b1, fresh, guarded}},
	}
	for _, pol := range []string{config.PolicyLeastLoad, config.PolicyRoundRobin, config.PolicyPrefixAffinity} {
		for _, tc := range tests {
			t.Run(pol+"/"+tc.model, func(t *testing.T) {
				// Two-choices draws its pair in turn (testPool's always draws the first two).
				draws := 0
				intn := func(n int) int { draws++; return draws % n }
				p := poolOf(roleDecode, PoolSpec{Endpoints: []string{a1, a2, b1, fresh, guarded}, PoolScheduling: policy(pol)}, Deps{intn: intn})
				serving(p, lists)
				reached := map[string]bool{}
				for i := range 64 {
					// prefix-affinity places a prompt's requests together:
					// many prompts, so that every allowed endpoint is reached.
					e, err := p.Select(modelRequest(t, tc.model, strings.Repeat(string(rune('a'+i%26)), 8+i)))
					if err != nil {
						t.Fatal(err)
					}
					reached[e.Addr] = true
					// Load it, so that load-aware picks move on.
					acquire(e)
				}
				if got := slices.Sorted(maps.Keys(reached)); !slices.Equal(got, tc.want) {
					t.Errorf("reached %v, want %v", got, tc.want)
				}
			})
		}
	}
}

// SGLang reads a model named "base:adapter" as the base model under that
// adapter (OpenAIServingBase._parse_model_parameter, which splits at the
// first colon and trims each part): such a request goes to the base
// model's engines, as no engine lists the whole name; an engine of another
// model answers it 404. A name some engine lists whole goes by that name.
func TestAnAdapterNamedAfterItsBaseGoesToTheBasesEngines(t *testing.T) {
	const a1, a2, b1, c1 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"
	lists := map[string][]string{a1: {"llama"}, a2: {"llama"}, b1: {"qwen"}, c1: {"gpt-oss:20b"}}
	tests := []struct {
		model string
		want  []string
	}{
		{"llama:sql", []string{a1, a2}},
		{"qwen : sql", []string{b1}},
		{"gpt-oss:20b", []string{c1}},             // listed whole
		{"mistral:sql", []string{a1, a2, b1, c1}}, // its base listed nowhere either
		{"llama:", []string{a1, a2}},              // no adapter: the base
	}
	for _, tc := range tests {
		t.Run(tc.model, func(t *testing.T) {
			p, _ := testPool(t, policy(config.PolicyRoundRobin), a1, a2, b1, c1)
			serving(p, lists)
			reached := map[string]bool{}
			for range 8 {
				e, err := p.Select(modelRequest(t, tc.model, "hello"))
				if err != nil {
					t.Fatal(err)
				}
				reached[e.Addr] = true
			}
			if got := slices.Sorted(maps.Keys(reached)); !slices.Equal(got, tc.want) {
				t.Errorf("reached %v, want %v", got, tc.want)
			}
		})
	}
}

// The pool's list is every model its engines list, each once, where they
// list different ones; else one engine's own list stands for the pool.
func TestModelListOfAPoolOfSeveralModels(t *testing.T) {
	const a, b, c = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
	tests := []struct {
		name  string
		lists map[string][]string
		want  string // the cards, or "" for none: one engine answers
	}{
		{"one model", map[string][]string{a: {"llama"}, b: {"llama"}, c: {"llama"}}, ""},
		{"one model, an engine not read", map[string][]string{a: {"llama"}, b: {"llama"}}, ""},
		{"none read", nil, ""},
		{"two models, an adapter on one engine", map[string][]string{a: {"llama", "llama-sql"}, b: {"llama"}, c: {"qwen"}},
			`{"id":"llama","object":"model","owned_by":"10.0.0.1:8000"},` +
				`{"id":"llama-sql","object":"model","owned_by":"10.0.0.1:8000"},` +
				`{"id":"qwen","object":"model","owned_by":"10.0.0.3:8000"}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := testPool(t, policy(config.PolicyLeastLoad), a, b, c)
			serving(p, tc.lists)
			cards, ok := p.ModelList()
			got := ""
			for i, card := range cards {
				if i > 0 {
					got += ","
				}
				got += string(card)
			}
			if ok != (tc.want != "") || got != tc.want {
				t.Errorf("ModelList() = %s, %v; want %s", got, ok, tc.want)
			}
		})
	}
}

// A pool of one model leaves no engine out for good: one whose list its
// --api-key guards takes its share, as do all where none is read; only an
// engine not read yet waits, for the read it gets as it joins.
func TestAPoolOfOneModelLeavesNoEngineOut(t *testing.T) {
	const a, b, c = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
	tests := []struct {
		name  string
		lists map[string][]string
		want  []string
	}{
		{"one engine's list guarded", map[string][]string{a: {"llama"}, b: {"llama"}, c: nil}, []string{a, b, c}},
		{"every list guarded", map[string][]string{a: nil, b: nil, c: nil}, []string{a, b, c}},
		{"none read yet", nil, []string{a, b, c}},
		{"one engine not read yet", map[string][]string{a: {"llama"}, b: {"llama"}}, []string{a, b}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := testPool(t, policy(config.PolicyRoundRobin), a, b, c)
			serving(p, tc.lists)
			reached := map[string]bool{}
			for range 6 {
				e, err := p.Select(modelRequest(t, "llama", "hello"))
				if err != nil {
					t.Fatal(err)
				}
				reached[e.Addr] = true
			}
			if got := slices.Sorted(maps.Keys(reached)); !slices.Equal(got, tc.want) {
				t.Errorf("reached %v, want %v", got, tc.want)
			}
		})
	}
}

// A prefix's home set is sized by its share of the traffic of the endpoints
// it is ranked over: in a pool of two models, one system prompt carrying all
// of a small model's requests (a tenth of the pool's) spreads over both of
// that model's engines, as it would in a pool of its own. Counted against
// the whole pool's traffic its share would keep it on one.
func TestAModelsPrefixIsSizedByItsOwnTraffic(t *testing.T) {
	llama := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000", "10.0.0.5:8000", "10.0.0.6:8000"}
	qwen := []string{"10.0.1.1:8000", "10.0.1.2:8000"}
	spec := policy(config.PolicyPrefixAffinity)
	spec.SetDefaults()
	p, _ := testPool(t, spec, append(slices.Clone(llama), qwen...)...)
	lists := map[string][]string{}
	for _, a := range llama {
		lists[a] = []string{"llama"}
	}
	for _, a := range qwen {
		lists[a] = []string{"qwen"}
	}
	serving(p, lists)
	system := strings.Repeat("You answer questions about the qwen tenant's billing. ", 40)
	reached := map[string]bool{}
	for i := range 600 {
		model, sys := "llama", fmt.Sprintf("llama tenant %d's assistant. ", i%20)+strings.Repeat("x", 3000)
		if i%10 == 0 {
			model, sys = "qwen", system
		}
		b, _ := json.Marshal(map[string]any{"model": model, "messages": []map[string]string{
			{"role": "system", "content": sys}, {"role": "user", "content": fmt.Sprintf("question %d: what is due?", i)}}})
		obj, err := body.Parse(b)
		if err != nil {
			t.Fatal(err)
		}
		e, err := p.Select(NewRequest(api.Chat.PromptOf(obj, api.VLLM)))
		if err != nil {
			t.Fatal(err)
		}
		if model == "qwen" && i >= 300 { // past the shares' warm-up
			reached[e.Addr] = true
		}
	}
	if got := slices.Sorted(maps.Keys(reached)); !slices.Equal(got, qwen) {
		t.Errorf("the qwen system prompt's requests reached %v, want both qwen engines %v", got, qwen)
	}
}

// When every endpoint serving the model is out, or outside the subset hint,
// the request gets the pool's error, not an engine of another model.
func TestNoEndpointOfTheModelIsAnError(t *testing.T) {
	const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
	tests := []struct {
		name   string
		prep   func(p *Pool, req *Request)
		wantIs error
	}{
		{"its engines checked down", func(p *Pool, _ *Request) { checkDown(p, a) }, ErrUnhealthy},
		{"outside the subset hint", func(_ *Pool, req *Request) { req.Subset = ParseSubset([]string{b}) }, ErrSubset},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := testPool(t, policy(config.PolicyLeastLoad), a, b)
			serving(p, map[string][]string{a: {"llama"}, b: {"qwen"}})
			req := modelRequest(t, "llama", "hello")
			tc.prep(p, req)
			e, err := p.Select(req)
			if !errors.Is(err, tc.wantIs) {
				t.Errorf("Select = %v, %v; want %v", e, err, tc.wantIs)
			}
		})
	}
}

// The list is read again after a minute, and at once after an ejection; a
// failed read after 5 s when the engine answered before (it restarts), else
// after 30 s (its --api-key guards the list); a failed read keeps the list
// read before, so that a restarting engine is not left out of its model's
// requests; an endpoint the checks find down is not asked.
func TestModelsAreReadAgain(t *testing.T) {
	engine := newSGLangEngine(t, api.ModelsPath, `{"data":[{"id":"llama"}]}`)
	guarded := newSGLangEngine(t, api.ModelsPath, "401")
	p, clock := testPool(t, policy(config.PolicyRoundRobin), engine.addr, guarded.addr)
	e := p.Endpoints()[0]
	read := func() {
		st := p.state.Load()
		p.readModels(context.Background(), st, st.endpoints)
	}
	steps := []struct {
		name                   string
		do                     func()
		wantAsked, wantGuarded int64
		wantLlama              bool
	}{
		{"joined", func() {}, 1, 1, true},
		{"within the minute", func() { clock.Advance(serverInfoRefresh - 1) }, 1, 2, true},
		{"a minute on, the engine fails", func() { clock.Advance(1); engine.set(api.ModelsPath, "500") }, 2, 2, true},
		{"within 5 s of the failure", func() { clock.Advance(serverInfoEvery - 1) }, 2, 2, true},
		{"ejected, the engine fails again at once", func() { eject(p, e.Addr) }, 3, 2, true},
		{"5 s on, it answers, restarted with another model", func() {
			clock.Advance(serverInfoEvery)
			engine.set(api.ModelsPath, `{"data":[{"id":"qwen"}]}`)
		}, 4, 2, false},
		{"checked down", func() { checkDown(p, e.Addr); clock.Advance(modelsRetry) }, 4, 3, false},
	}
	for _, s := range steps {
		s.do()
		read()
		if got, guards := engine.asked.Load(), guarded.asked.Load(); got != s.wantAsked || guards != s.wantGuarded || e.serves("llama") != s.wantLlama {
			t.Fatalf("%s: asked %d times (the guarded engine %d), serves llama %v; want %d (%d), %v",
				s.name, got, guards, e.serves("llama"), s.wantAsked, s.wantGuarded, s.wantLlama)
		}
	}
}

// An adapter loaded on one engine at run time (vLLM's
// /v1/load_lora_adapter) is listed nowhere until the lists are read again,
// and its requests meanwhile go to any engine, the others answering 404: a
// request naming a name no list holds has the lists read again at the
// pool's next round (5 s), not a minute after the last read. Unless one
// does, they are read on the minute as before.
func TestAnAdapterLoadedAtRunTimeIsTakenUpAtTheNextRound(t *testing.T) {
	const before = `{"data":[{"id":"llama"}]}`
	tests := []struct {
		name      string
		ask       string   // the model a request names after the load
		want      []string // the engines a request for sql reaches after the next round
		wantReads int64    // the reads of the engine that loaded it
	}{
		{"a request names the new adapter", "sql", []string{"loaded"}, 2},
		{"no request names a name unlisted", "llama", []string{"loaded", "other", "qwen"}, 1}, // sql still listed nowhere: any engine
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			loaded, other := newSGLangEngine(t, api.ModelsPath, before), newSGLangEngine(t, api.ModelsPath, before)
			qwen := newSGLangEngine(t, api.ModelsPath, `{"data":[{"id":"qwen"}]}`)
			names := map[string]string{loaded.addr: "loaded", other.addr: "other", qwen.addr: "qwen"}
			p, clock := testPool(t, policy(config.PolicyRoundRobin), loaded.addr, other.addr, qwen.addr)
			read := func() {
				st := p.state.Load()
				p.readModels(context.Background(), st, st.endpoints)
			}
			read()
			loaded.set(api.ModelsPath, `{"data":[{"id":"llama"},{"id":"sql","parent":"llama"}]}`)
			if _, err := p.Select(modelRequest(t, tc.ask, "hello")); err != nil {
				t.Fatal(err)
			}
			clock.Advance(serverInfoEvery)
			read()
			reached := map[string]bool{}
			for range 6 {
				e, err := p.Select(modelRequest(t, "sql", "hello"))
				if err != nil {
					t.Fatal(err)
				}
				reached[names[e.Addr]] = true
			}
			if got := slices.Sorted(maps.Keys(reached)); !slices.Equal(got, tc.want) || loaded.asked.Load() != tc.wantReads {
				t.Errorf("a request for sql reached %v, the engine read %d times; want %v, %d", got, loaded.asked.Load(), tc.want, tc.wantReads)
			}
		})
	}
}

// BenchmarkSelectByModel: one least-load pick in pools of 16 and 1,000
// endpoints, for a request naming no model, one all endpoints list, one half
// of them list (two models) and one none lists.
func BenchmarkSelectByModel(b *testing.B) {
	for _, n := range []int{16, 1000} {
		for _, lists := range []string{"no model", "one model", "two models", "model unlisted"} {
			b.Run(fmt.Sprintf("%d/%s", n, lists), func(b *testing.B) {
				addrs := make([]string, n)
				for i := range addrs {
					addrs[i] = fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250)
				}
				p := poolOf(roleDecode, PoolSpec{Endpoints: addrs, PoolScheduling: policy(config.PolicyLeastLoad)}, Deps{})
				if lists != "no model" {
					m := map[string][]string{}
					for i, a := range addrs {
						m[a] = []string{[]string{"llama", "qwen"}[i%2]}
						if lists == "one model" {
							m[a] = []string{"llama"}
						}
					}
					serving(p, m)
				}
				model := "llama"
				if lists == "no model" {
					model = ""
				}
				if lists == "model unlisted" {
					model = "mistral"
				}
				req := modelRequest(b, model, "hello there")
				b.ResetTimer()
				for b.Loop() {
					p.Select(req)
				}
			})
		}
	}
}

// The line that says what models an engine serves names its pool, as the
// production logger (zap, JSON) writes it: it named a function instead,
// which zap could not encode ("poolError").
func TestTheModelsLineNamesItsPool(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(vllmModels))
	}))
	defer engine.Close()
	var out bytes.Buffer
	log := zapr.NewLogger(zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(&out), zapcore.DebugLevel)))
	p := poolOf(roleDecode, PoolSpec{Endpoints: []string{strings.TrimPrefix(engine.URL, "http://")}}, Deps{Log: log, Client: engine.Client()})
	p.readModels(t.Context(), p.state.Load(), p.Endpoints())
	if !strings.Contains(out.String(), `"pool":"decode"`) || strings.Contains(out.String(), "poolError") {
		t.Errorf("the models line does not name its pool: %s", out.String())
	}
}

// An engine's context length is the max_model_len of the card it listed for
// the model; an adapter's card has none, and its base model's counts.
func TestMaxModelLen(t *testing.T) {
	var list struct{ Data []json.RawMessage }
	if err := json.Unmarshal([]byte(vllmModels), &list); err != nil {
		t.Fatal(err)
	}
	cards := map[string]modelCard{}
	for _, raw := range append(list.Data, json.RawMessage(`{"id":"no-length","parent":null}`)) {
		var c modelCard
		if err := json.Unmarshal(raw, &c); err != nil {
			t.Fatal(err)
		}
		cards[c.ID] = c
	}
	var e Endpoint
	if _, ok := e.MaxModelLen("qwen"); ok {
		t.Error("an engine not read yet has a context length")
	}
	e.models.Store(&servedModels{lengths: contextLengths(cards)})
	for model, want := range map[string]int64{"qwen": 32768, "Qwen/Qwen3-8B": 32768, "sql-lora": 32768, "no-length": 0, "other": 0} {
		if got, ok := e.MaxModelLen(model); got != want || ok != (want > 0) {
			t.Errorf("MaxModelLen(%q) = %d, %v; want %d", model, got, ok, want)
		}
	}
}
