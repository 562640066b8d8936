package scheduling

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// engine is a test engine serving /health and /metrics, counting the
// scrapes of the latter in scrapes.
func engine(t *testing.T, healthy *atomic.Bool, waiting string, scrapes *atomic.Int64) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		if !healthy.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		scrapes.Add(1)
		w.Write([]byte("vllm:num_requests_waiting " + waiting + "\n"))
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

func TestRunFollowsReloads(t *testing.T) {
	var up atomic.Bool
	up.Store(true)
	var scrapes atomic.Int64
	addr := engine(t, &up, "4", &scrapes)
	spec := Spec{
		Prefill: PoolSpec{Endpoints: []string{addr}},
		Decode:  PoolSpec{Endpoints: []string{addr}},
	}
	ps := NewPools(spec, Deps{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { ps.Run(ctx); close(done) }()

	// Nothing to wait for but time: a scrape would come at once, as the
	// first after a reload does below.
	time.Sleep(20 * time.Millisecond)
	if n := scrapes.Load(); n != 0 {
		t.Fatalf("%d scrapes with metrics.interval unset", n)
	}

	spec.Decode.Metrics.Interval = config.Duration(10 * time.Millisecond)
	spec.Decode.Health.CheckInterval = config.Duration(10 * time.Millisecond)
	ps.Update(spec)
	e := ps.Decode.Endpoints()[0]
	waitFor(t, "a scrape after the reload", func() bool { l, ok := e.Fresh(); return ok && l.Waiting == 4 })
	up.Store(false)
	waitFor(t, "a failed check", func() bool { return !e.Healthy() })
	if !ps.Prefill.Endpoints()[0].Healthy() {
		t.Error("the prefill pool, without checks, took the decode pool's verdict")
	}
	up.Store(true)
	waitFor(t, "a passed check", e.Healthy)

	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
}

func TestPoolsUpdateAppliesPDThresholds(t *testing.T) {
	ps := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"a"}}, Decode: PoolSpec{Endpoints: []string{"b"}}}, Deps{})
	req := promptRequest(strings.Repeat("x", 40)) // 10 tokens
	if d := ps.Decide(req, nil); !d.PD {
		t.Fatalf("Decide() = %+v with defaults, want P/D", d)
	}
	ps.Update(Spec{Prefill: PoolSpec{Endpoints: []string{"a"}}, Decode: PoolSpec{Endpoints: []string{"b"}}, PD: config.PD{MinPromptTokens: 11}})
	if d := ps.Decide(req, nil); d.PD || d.Reason != metrics.ReasonShortPrompt {
		t.Fatalf("Decide() = %+v after raising the threshold, want decode-only", d)
	}
}

// TestTokenizerAsksWhileAViewCanBeTrusted: a request's token ids are asked
// of an engine only while a pool's view of its engines' caches may be
// routed by: not for pools that follow no events, nor once every engine
// stayed silent past stale_after after it was sent work (an engine started
// without KV events), which would cost every request a round trip for
// nothing.
func TestTokenizerAsksWhileAViewCanBeTrusted(t *testing.T) {
	now := time.Date(2026, 12, 3, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	b, c := kvevents.Publisher{Endpoint: "b"}, kvevents.Publisher{Endpoint: "c"}
	tests := []struct {
		name   string
		events bool
		do     func(x *kvevents.Index)
		ok     bool
	}{
		{"no pool follows events", false, func(*kvevents.Index) {}, false},
		{"engines followed, none published yet", true, func(*kvevents.Index) {}, true},
		{"every engine silent past stale_after after work", true, func(x *kvevents.Index) {
			x.Expect("b", 0, 256)
			x.Expect("c", 0, 256)
			now = now.Add(61 * time.Second)
		}, false},
		{"one engine silent, the other publishing", true, func(x *kvevents.Index) {
			x.Expect("b", 0, 256)
			x.Expect("c", 0, 256)
			x.Apply(c, []kvevents.Event{{Kind: kvevents.Stored, Hashes: []uint64{1}, Tokens: make([]int64, 16), BlockSize: 16}})
			now = now.Add(61 * time.Second)
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ps := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"a"}}, Decode: PoolSpec{Endpoints: []string{"b", "c"}}}, Deps{Now: clock})
			x := kvevents.NewIndex(kvevents.Bounds{}, time.Minute, clock)
			x.Reset(b, true)
			x.Reset(c, true)
			if tt.events {
				ps.Decode.events.Store(&poolEvents{index: x, spec: config.KVEvents{ConnectPort: 5557, Tokenize: config.Tokenize{Path: "/tokenize"}}})
			}
			tt.do(x)
			e, tk, ok := ps.Tokenizer(nil)
			if ok != tt.ok {
				t.Fatalf("Tokenizer() ok = %v, want %v", ok, tt.ok)
			}
			if ok && (e.Addr != "a" || tk.Path != "/tokenize") {
				t.Errorf("Tokenizer() = %s %+v, want the prefill endpoint a and /tokenize", e.Addr, tk)
			}
		})
	}
}

// TestTokenizerPausesAfterFailures: three round trips for an API's token ids
// failed in a row pause them for that API for the pool's stale_after, and
// not for the others (SGLang's /tokenize takes no chat messages, and does
// take prompts); a success in between starts the count again. A render
// endpoint an engine lacks is not asked for stale_after; the others are.
func TestTokenizerPausesAfterFailures(t *testing.T) {
	const chat, completions = "/v1/chat/completions/render", "/v1/completions/render"
	tests := []struct {
		name          string
		results       []bool // the chat round trips' outcomes, in order
		unrendered    bool   // the engines lack chat's render endpoint
		after         time.Duration
		ask, render   bool // for chat
		otherAsk      bool // for completions
		otherRendered bool
	}{
		{"two failures", []bool{false, false}, false, 0, true, true, true, true},
		{"three failures in a row", []bool{false, false, false}, false, 0, false, true, true, true},
		{"three failures, stale_after later", []bool{false, false, false}, false, 30 * time.Second, true, true, true, true},
		{"a success between failures", []bool{false, false, true, false, false}, false, 0, true, true, true, true},
		{"no render endpoint", nil, true, 0, true, false, true, true},
		{"no render endpoint, stale_after later", nil, true, 30 * time.Second, true, true, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			ps := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"a"}}, Decode: PoolSpec{Endpoints: []string{"b"}}}, Deps{Now: clock.Now})
			x := kvevents.NewIndex(kvevents.Bounds{}, time.Minute, clock.Now)
			x.Reset(kvevents.Publisher{Endpoint: "b"}, true)
			ps.Decode.events.Store(&poolEvents{index: x, spec: config.KVEvents{ConnectPort: 5557, StaleAfter: config.Duration(30 * time.Second)}})
			for _, ok := range tt.results {
				ps.Tokenized(chat, ok)
			}
			if tt.unrendered {
				ps.Unrendered(chat)
			}
			clock.Advance(tt.after)
			if _, _, ok := ps.Tokenizer(nil); !ok {
				t.Error("Tokenizer() ok = false, want an endpoint to ask")
			}
			ask, render := ps.Asks(chat)
			otherAsk, otherRendered := ps.Asks(completions)
			if ask != tt.ask || render != tt.render || otherAsk != tt.otherAsk || otherRendered != tt.otherRendered {
				t.Errorf("Asks(chat) = %v, %v; Asks(completions) = %v, %v; want %v, %v and %v, %v",
					ask, render, otherAsk, otherRendered, tt.ask, tt.render, tt.otherAsk, tt.otherRendered)
			}
		})
	}
}
