package pipeline_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// holdingEngine is a prefill engine that keeps every leg until released,
// and says on cut when a leg's request ended before (the engine's abort:
// vLLM frees the prompt's blocks, SGLang drops it from its bootstrap
// queue). It serves its own bootstrap server's /query, one rank.
type holdingEngine struct {
	*httptest.Server
	arrived, cut chan struct{}
	release      chan struct{}
}

func newHoldingEngine(t *testing.T) *holdingEngine {
	e := &holdingEngine{arrived: make(chan struct{}, 10), cut: make(chan struct{}, 10), release: make(chan struct{})}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/query":
			w.Write([]byte(`{"0":{"engine_id":"e-0"}}`))
		case r.Method == http.MethodPost:
			io.Copy(io.Discard, r.Body) // net/http sees the client go only past the body
			e.arrived <- struct{}{}
			select {
			case <-e.release:
				w.Write([]byte(`{"choices":[]}`))
			case <-r.Context().Done():
				e.cut <- struct{}{}
			}
		}
	}))
	t.Cleanup(func() {
		close(e.release)
		e.Close()
	})
	return e
}

// A concurrent prefill leg (kv-mooncake, kv-sglang) whose decode request is
// over unserved has nothing to pair with: its HTTP request is cut, and the
// engine aborts it. A Mooncake prefill engine would otherwise compute the
// prompt and keep its blocks for a pull that never comes, up to
// VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480 s); either leg would hold a slot
// of prefill.max_background and a connection until prefill.timeout. A kv-sglang
// leg is cut only when its decode refused the request: after a decode 5xx
// its own outcome says whose failure it was (TestSGLangFailuresAreNotBlamedOnThePartner).
func TestALegWhoseDecodeEndedUnservedIsCut(t *testing.T) {
	failedEvent := []byte("data: {\"error\":{\"message\":\"KV transfer failed\",\"code\":500}}\n\n")
	for _, tt := range []struct {
		name, connector string
		decode          func(d *pipeline.Decision) // what Envoy reports of the decode leg
		cut             bool
	}{
		{"kv-mooncake, the decode engine fails (503)", "kv-mooncake", func(d *pipeline.Decision) { d.Observe(503, false) }, true},
		{"kv-mooncake, the decode engine refuses (400)", "kv-mooncake", func(d *pipeline.Decision) { d.Observe(400, false) }, true},
		{"kv-mooncake, the decode stream fails before its first token", "kv-mooncake", func(d *pipeline.Decision) {
			d.Observe(200, true)
			d.Watch(failedEvent)
		}, true},
		{"kv-mooncake, the decode engine answers", "kv-mooncake", func(d *pipeline.Decision) { d.Observe(200, false) }, false},
		{"kv-mooncake, the decode stream begins", "kv-mooncake", func(d *pipeline.Decision) { d.Observe(200, true) }, false},
		{"kv-sglang, the decode engine refuses (400)", "kv-sglang", func(d *pipeline.Decision) { d.Observe(400, false) }, true},
		{"kv-sglang, the decode engine fails (503)", "kv-sglang", func(d *pipeline.Decision) { d.Observe(503, false) }, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			engine := newHoldingEngine(t)
			addr := strings.TrimPrefix(engine.URL, "http://")
			port := addr[strings.LastIndex(addr, ":")+1:]
			p, m, _ := newPipeline(t, fmt.Sprintf(`connector: %s
pools: {prefill: {endpoints: [%q], bootstrap_port: %s}, decode: {endpoints: ["10.1.1.1:8000"]}}`, tt.connector, addr, port))
			ctx, stop := context.WithCancel(context.Background())
			ran := make(chan struct{})
			go func() { p.Run(ctx); close(ran) }()
			t.Cleanup(func() { stop(); <-ran; p.Wait() })
			d := routePD(t, p)
			enginetest.Receive(t, engine.arrived, "the prefill leg never reached its engine")
			tt.decode(d)
			if tt.cut {
				enginetest.Receive(t, engine.cut, "the leg of a decode request that ended unserved ran on")
			} else {
				engine.release <- struct{}{}
			}
			d.Release()
			p.Wait()
			want := 0.0
			if tt.cut {
				want = 1
			}
			if got, _ := m.Sample("pd_extproc_prefill_failures_total", map[string]string{"reason": "cancelled"}); got != want {
				t.Errorf("legs cut = %v, want %v", got, want)
			}
		})
	}
}

// routePD routes a chat request P/D, retrying for up to 5 s while a
// kv-mooncake pool reads its engine ids (requests go decode-only until then).
func routePD(t *testing.T, p *pipeline.Pipeline) *pipeline.Decision {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
			Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64}`)}
		d, err := p.Route(context.Background(), r)
		if err != nil {
			t.Fatal(err)
		}
		if r.Report.Mode == metrics.ModePD {
			return d
		}
		d.Release()
	}
	t.Fatal("no request went P/D")
	return nil
}
