package pipeline_test

import (
	"context"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/server/assemble"
)

// deadlines is a transport that notes each request's path and deadline.
type deadlines struct {
	next http.RoundTripper
	mu   sync.Mutex
	at   map[string]time.Time
}

func (d *deadlines) RoundTrip(r *http.Request) (*http.Response, error) {
	at, _ := r.Context().Deadline()
	d.mu.Lock()
	d.at[r.URL.Path] = at
	d.mu.Unlock()
	return d.next.RoundTrip(r)
}

// TestTokenIDsTakeOneTimeout: kv_events.tokenize.timeout bounds the whole
// wait for a request's token ids. A render that fails leaves /tokenize what
// remains of it, not a whole timeout of its own (a slow failing render held
// the request up to twice the timeout).
func TestTokenIDsTakeOneTimeout(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/v1/chat/completions/render":
			w.WriteHeader(http.StatusInternalServerError)
			fmt.Fprint(w, `{"error":{"message":"template failed","type":"InternalServerError","code":500}}`)
		case "/tokenize":
			fmt.Fprint(w, `{"count":3,"max_model_len":100,"tokens":[1,2,3]}`)
		}
	}))
	t.Cleanup(engine.Close)
	seen := &deadlines{at: map[string]time.Time{}}
	p := followingEvents(t, engine.URL, true, func(p *pipeline.Pipeline) {
		pipeline.WrapTransport(p, func(next http.RoundTripper) http.RoundTripper { seen.next = next; return seen })
	})
	// The pool follows its engine's events (an empty view) once Run has
	// started its subscriber; until then requests go without token ids.
	asked := func() bool {
		seen.mu.Lock()
		defer seen.mu.Unlock()
		_, ok := seen.at["/v1/chat/completions/render"]
		return ok
	}
	for deadline := time.Now().Add(5 * time.Second); !asked(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no request asked for its token ids")
		}
		d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
			Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)})
		if err != nil {
			t.Fatal(err)
		}
		d.Release()
	}
	render, tokenize := seen.at["/v1/chat/completions/render"], seen.at["/tokenize"]
	if render.IsZero() || tokenize.IsZero() {
		t.Fatalf("asked with deadlines %v; want the render endpoint, then /tokenize", seen.at)
	}
	if !tokenize.Equal(render) {
		t.Errorf("/tokenize was asked with a deadline %v after the render's: want the same one", tokenize.Sub(render))
	}
}

// TestAClientGoneIsNoTokenizerFailure: a client that leaves while its
// token ids are asked for is no failure of the tokenizer: it was counted
// in tokenize_seconds{outcome="failed"}, read as a tokenizer that does not
// answer.
func TestAClientGoneIsNoTokenizerFailure(t *testing.T) {
	arrived, release := make(chan struct{}, 10), make(chan struct{})
	engine := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		select {
		case arrived <- struct{}{}:
		default:
		}
		select { // answers nothing while the client waits
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer engine.Close()
	defer close(release)
	cfg, err := config.Parse(fmt.Appendf(nil, `connector: kv-nixl
pools: {decode: {endpoints: [%q], policy: prefix-affinity, kv_events: {connect_port: 1, tokenize: {timeout: 1m}}}}
`, strings.TrimPrefix(engine.URL, "http://")))
	if err != nil {
		t.Fatal(err)
	}
	m := metrics.New(cfg.Connector)
	p, err := assemble.Pipeline(cfg, logr.Discard(), pipeline.WithMetrics(m))
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { p.Run(runCtx) })
	defer func() { stop(); wg.Wait(); p.Wait(); pipeline.CloseIdle(p) }()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			if d, err := p.Route(ctx, &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
				Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}); err == nil {
				d.Release()
			}
		}()
		select {
		case <-arrived: // the client leaves while the engine tokenizes
			cancel()
			<-done
			if failed, _ := m.Sample("pd_extproc_tokenize_seconds", map[string]string{"outcome": "failed"}); failed != 0 {
				t.Errorf("tokenize_seconds{outcome=failed} = %v after a client left: the tokenizer did not fail", failed)
			}
			return
		case <-done: // the pool did not follow its events yet: no round trip
			cancel()
			if time.Now().After(deadline) {
				t.Fatal("the pool never asked for token ids")
			}
		}
	}
}

// A render round trip for a request's token ids is sent from the client's
// body. One that failed may still be written by net/http after Route
// returns (a transport closes a request's body after Do returns), so the
// body is held as a prefill leg's is: its pooled buffer must not be reused
// meanwhile. One answered 200 came after the engine read it whole.
func TestABodyARenderFailedOnIsHeld(t *testing.T) {
	for _, tt := range []struct {
		status int
		held   bool
	}{{http.StatusOK, false}, {http.StatusInternalServerError, true}} {
		t.Run(fmt.Sprint(tt.status), func(t *testing.T) {
			var rendered sync.WaitGroup
			rendered.Add(1)
			var once sync.Once
			engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				switch r.URL.Path {
				case "/v1/chat/completions/render":
					defer once.Do(rendered.Done)
					w.WriteHeader(tt.status)
					fmt.Fprint(w, `{"token_ids":[1,2,3]}`)
				case "/tokenize":
					fmt.Fprint(w, `{"count":3,"max_model_len":100,"tokens":[1,2,3]}`)
				}
			}))
			t.Cleanup(engine.Close)
			p := followingEvents(t, engine.URL, false, nil)
			// Requests go without token ids until Run has started the pool's
			// subscriber; the first whose render is asked is the one to judge.
			asked := make(chan struct{})
			go func() { rendered.Wait(); close(asked) }()
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(2 * time.Millisecond) {
				r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
					Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
				d, err := p.Route(context.Background(), r)
				if err != nil {
					t.Fatal(err)
				}
				d.Release()
				select {
				case <-asked:
					if got := r.BodyHeld(); got != tt.held {
						t.Errorf("BodyHeld() = %v after a render answered %d, want %v", got, tt.status, tt.held)
					}
					return
				default:
				}
				if time.Now().After(deadline) {
					t.Fatal("no request asked for its token ids")
				}
			}
		})
	}
}

// followingEvents is a pipeline whose decode pool, the engine at engineURL,
// follows its KV events (an empty view: no publisher answers) and asks it
// for token ids, running until the test ends; prepare, when set, sees it
// before it runs. With prefill, the engine is the prefill pool too, which
// token ids are asked of first, with the client that WrapTransport wraps.
func followingEvents(t *testing.T, engineURL string, prefill bool, prepare func(*pipeline.Pipeline)) *pipeline.Pipeline {
	t.Helper()
	prefillEndpoints := "[]"
	if prefill {
		prefillEndpoints = fmt.Sprintf("[%q]", strings.TrimPrefix(engineURL, "http://"))
	}
	p, _, _ := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools:
  prefill: {endpoints: %[1]s}
  decode: {endpoints: [%[2]q], policy: prefix-affinity, kv_events: {connect_port: 1, tokenize: {timeout: 5s}}}
`, prefillEndpoints, strings.TrimPrefix(engineURL, "http://")))
	if prepare != nil {
		prepare(p)
	}
	return running(t, p)
}

// running runs p's background work (checks, scrapes, subscribers) until the
// test ends.
func running(t *testing.T, p *pipeline.Pipeline) *pipeline.Pipeline {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { p.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait(); p.Wait() })
	return p
}

// TestADecodeEngineIsAskedAsItsPoolReachesIt: with no prefill endpoint to
// ask, a request's token ids are asked of a decode engine over its pool's
// TLS and with its pool's API key (pools.decode.tls, api_key_file), not the
// prefill legs': those reach other engines, and the ask failed (plain HTTP
// to a TLS engine) or was refused (the prefill key), the request then
// routed by estimates.
func TestADecodeEngineIsAskedAsItsPoolReachesIt(t *testing.T) {
	for _, tls := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", tls), func(t *testing.T) {
			asked := make(chan string, 1)
			handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/v1/chat/completions/render" {
					return // checks, scrapes
				}
				select {
				case asked <- r.Header.Get("Authorization"):
				default:
				}
				fmt.Fprint(w, `{"token_ids":[1,2,3]}`)
			})
			engine, decodeTLS := httptest.NewUnstartedServer(handler), "{}"
			if !tls {
				engine.Start()
			} else {
				engine.StartTLS()
				caFile := filepath.Join(t.TempDir(), "ca.crt")
				os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: engine.Certificate().Raw}), 0o600)
				decodeTLS = fmt.Sprintf("{enabled: true, ca_file: %q}", caFile)
			}
			t.Cleanup(engine.Close)
			dir := t.TempDir()
			os.WriteFile(filepath.Join(dir, "prefill"), []byte("prefill-key\n"), 0o600)
			os.WriteFile(filepath.Join(dir, "decode"), []byte("decode-key\n"), 0o600)
			p, _, _ := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
prefill: {api_key_file: %q}
pools: {decode: {endpoints: [%q], tls: %s, api_key_file: %q, policy: prefix-affinity, kv_events: {connect_port: 1, tokenize: {timeout: 5s}}}}
`, filepath.Join(dir, "prefill"), engine.Listener.Addr().String(), decodeTLS, filepath.Join(dir, "decode")))
			running(t, p)
			// Requests go without token ids until Run has started the pool's subscriber.
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(2 * time.Millisecond) {
				d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
					Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)})
				if err != nil {
					t.Fatal(err)
				}
				d.Release()
				select {
				case auth := <-asked:
					if auth != "Bearer decode-key" {
						t.Errorf("the decode engine was asked for token ids with Authorization %q, want the decode pool's key", auth)
					}
					return
				default:
				}
				if time.Now().After(deadline) {
					t.Fatal("the decode engine was never asked for token ids")
				}
			}
		})
	}
}
