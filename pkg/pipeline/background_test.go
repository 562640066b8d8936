package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// gate is a prefill engine that holds every leg until it is let through,
// and says on which connection each arrived.
type gate struct {
	*httptest.Server
	pass    chan struct{} // one token lets one leg through; closed, all of them
	arrived chan string   // the client address of each leg, as it arrives
	once    sync.Once
}

func newGate(t *testing.T) *gate {
	g := &gate{pass: make(chan struct{}), arrived: make(chan string, 100)}
	g.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.arrived <- r.RemoteAddr
		<-g.pass
		w.Write([]byte(`{"choices":[]}`))
	}))
	t.Cleanup(func() {
		g.release()
		g.Close()
	})
	return g
}

func (g *gate) addr() string { return strings.TrimPrefix(g.URL, "http://") }

// await returns the connection of the next leg to arrive.
func (g *gate) await(t *testing.T) string {
	t.Helper()
	return enginetest.Receive(t, g.arrived, "a prefill leg never reached the engine")
}

// release lets every leg through, now and later.
func (g *gate) release() { g.once.Do(func() { close(g.pass) }) }

// kv-sglang legs run on after their streams: prefill.max_background of them
// at most, past which a request gets 503 with Retry-After, holding no
// decode slot; each holds its client's body until it ends.
func TestBackgroundLegsAreCapped(t *testing.T) {
	engine := newGate(t)
	p, m, _ := newPipeline(t, fmt.Sprintf(`connector: kv-sglang
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {max_background: 2}
limits: {retry_after: 4s}`, engine.addr()))
	t.Cleanup(p.Wait)
	var holds keeper
	route := func() error {
		r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
			Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`), Keep: &holds}
		d, err := p.Route(context.Background(), r)
		d.Release() // the stream ends at once, as Envoy closes it
		return err
	}
	for i := range 2 {
		if err := route(); err != nil {
			t.Fatalf("leg %d: %v", i, err)
		}
	}
	engine.await(t)
	engine.await(t)
	err := route()
	if e := pipeline.AsError(err, "r"); err == nil || e.Status != 503 || e.RetryAfter != 4*time.Second || !strings.Contains(e.Message, "prefill.max_background") {
		t.Fatalf("the third request: %v, want 503 with Retry-After 4s naming prefill.max_background", err)
	}
	if got := counter(t, m, "pd_extproc_limit_refusals_total", "limit", metrics.LimitBackground); got != 1 {
		t.Errorf("limit_refusals_total{limit=max_background} = %v, want 1", got)
	}
	if got := counter(t, m, "pd_extproc_prefill_background_legs", "", ""); got != 2 {
		t.Errorf("prefill_background_legs = %v, want 2", got)
	}
	if n := holds.n.Load(); n != 2 {
		t.Errorf("%d bodies held, want the two running legs'", n)
	}
	_, decode := p.Pools()
	if n := decode.Endpoints()[0].InFlight(); n != 0 {
		t.Errorf("decode endpoint in flight %d after the streams ended, want 0", n)
	}

	engine.release()
	p.Wait()
	if n := holds.n.Load(); n != 0 {
		t.Errorf("%d bodies still held after the legs ended", n)
	}
	if got := counter(t, m, "pd_extproc_prefill_background_legs", "", ""); got != 0 {
		t.Errorf("prefill_background_legs = %v after the legs ended, want 0", got)
	}
	if err := route(); err != nil {
		t.Errorf("once the legs ended: %v, want the request routed", err)
	}
}

// keeper counts the bodies held by background legs.
type keeper struct{ n atomic.Int32 }

func (k *keeper) Hold() func() {
	k.n.Add(1)
	return func() { k.n.Add(-1) }
}

// Each prefill engine gets at most prefill.max_conns_per_endpoint
// connections: with one, a second leg waits for the first's connection
// instead of opening its own, and its request is routed (its decode leg
// sent) once the leg is written.
func TestConnectionsPerPrefillEngineAreCapped(t *testing.T) {
	engine := newGate(t)
	p, _, _ := newPipeline(t, fmt.Sprintf(`connector: kv-sglang
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {max_conns_per_endpoint: 1}`, engine.addr()))
	t.Cleanup(p.Wait)
	route := func() error {
		d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
			Body: []byte(`{"model":"m","messages":[]}`)})
		d.Release()
		return err
	}
	if err := route(); err != nil {
		t.Fatal(err)
	}
	routed := make(chan error, 1)
	go func() { routed <- route() }()
	first := engine.await(t)
	select {
	case err := <-routed:
		t.Fatalf("the second request was routed (%v) while its leg had no connection to be written on", err)
	default:
	}
	engine.pass <- struct{}{} // the first leg ends; its connection is free
	if second := engine.await(t); second != first {
		t.Errorf("the second leg came on its own connection (%s, the first on %s)", second, first)
	}
	if err := enginetest.Receive(t, routed, "the second request was never routed"); err != nil {
		t.Error(err)
	}
	engine.release()
}

// A prefill answer longer than the 8 MiB read (prompt logprobs ahead of
// kv_transfer_params, as vLLM orders it) fails the attempt, counted, instead
// of handing the decode engine a body without the params. It says nothing of
// the engine's health, and another engine would answer as long.
func TestPrefillAnswerOverTheReadCapFailsTheAttempt(t *testing.T) {
	answer := func(n int) string {
		head, tail := `{"prompt_logprobs":"`, `","kv_transfer_params":{"remote_host":"10.0.0.9","remote_port":5600}}`
		return head + strings.Repeat("x", n-len(head)-len(tail)) + tail
	}
	tests := []struct {
		name      string
		size      int
		onFailure string
		wantErr   int // the client's status; 0 when routed
		wantKV    bool
	}{
		{"exactly 8 MiB: read whole", pipeline.MaxPrefillResponseBytes, config.OnFailureDecodeOnly, 0, true},
		{"one byte over, decode-only: recomputed", pipeline.MaxPrefillResponseBytes + 1, config.OnFailureDecodeOnly, 0, false},
		{"one byte over, fail: 502", pipeline.MaxPrefillResponseBytes + 1, config.OnFailureFail, 502, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			engines := []*enginetest.Engine{enginetest.Start(t, enginetest.JSON(200, answer(tt.size))), enginetest.Start(t, enginetest.JSON(200, answer(tt.size)))}
			p, m, _ := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q, %q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {on_failure: %s, attempts: 2}`, engines[0].Addr(), engines[1].Addr(), tt.onFailure))
			for range 3 {
				r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: "r", Body: []byte(`{"model":"m","prompt":"hi"}`)}
				d, err := p.Route(context.Background(), r)
				if tt.wantErr != 0 {
					if e := pipeline.AsError(err, "r"); err == nil || e.Status != tt.wantErr {
						t.Fatalf("Route: %v, want %d", err, tt.wantErr)
					}
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				if got := strings.Contains(string(d.Body.Bytes()), `"remote_port":5600`); got != tt.wantKV {
					t.Errorf("decode body carries the prefill's params: %v, want %v", got, tt.wantKV)
				}
				d.Release()
			}
			want := map[bool]float64{true: 0, false: 3}[tt.wantKV]
			if got := counter(t, m, "pd_extproc_prefill_failures_total", "reason", metrics.FailureTooLarge.String()); got != want {
				t.Errorf("prefill_failures_total{reason=answer_too_large} = %v, want %v", got, want)
			}
			if legs := len(engines[0].Requests()) + len(engines[1].Requests()); legs != 3 {
				t.Errorf("%d prefill legs for 3 requests: a too-long answer is not worth another engine", legs)
			}
			prefill, _ := p.Pools()
			for _, e := range prefill.Endpoints() {
				if !e.Healthy() {
					t.Errorf("%s was ejected for its answer's length", e.Addr)
				}
			}
		})
	}
}

// A kv-sglang leg's outcome reaches the exchange through LegFailed: the
// client's error when the leg fails (its decode request waits for KV that
// will not come), nothing when it serves; closed either way, once it ends.
func TestALegsFailureIsHandedToTheExchange(t *testing.T) {
	for _, tt := range []struct {
		name   string
		answer http.HandlerFunc
		status int // of the error handed over; 0 for none
	}{
		{"served", enginetest.JSON(200, `{"choices":[]}`), 0},
		{"a 5xx", enginetest.JSON(503, `{"error":{"message":"busy"}}`), http.StatusBadGateway},
		{"a 4xx, passed on", enginetest.JSON(400, `{"error":{"message":"too long"}}`), http.StatusBadRequest},
	} {
		t.Run(tt.name, func(t *testing.T) {
			engine := enginetest.Start(t, tt.answer)
			p, _, _ := newPipeline(t, fmt.Sprintf(`connector: kv-sglang
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, engine.Addr()))
			t.Cleanup(p.Wait)
			d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
				Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Release()
			if d.LegFailed == nil {
				t.Fatal("a kv-sglang decision has no LegFailed")
			}
			var got []int
			for e := range d.LegFailed {
				got = append(got, e.Status)
			}
			var want []int
			if tt.status != 0 {
				want = []int{tt.status}
			}
			if !slices.Equal(got, want) {
				t.Errorf("handed over %v, want %v", got, want)
			}
		})
	}
}

// A concurrent leg whose engine refuses the connection was never sent, and
// no decode engine waits for it yet: it is tried on another prefill
// endpoint (prefill.attempts), and the request is routed to pair with the
// engine that took it. When none can, a kv-sglang request gets the leg's
// error at once, before any decode leg goes, and a kv-mooncake one goes
// decode-only (prefill.on_failure).
func TestALegThatCannotBeSentIsTriedElsewhere(t *testing.T) {
	refusing := func() string {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		l.Close()
		return l.Addr().String()
	}
	live := enginetest.Start(t, enginetest.JSON(200, `{"choices":[]}`))
	tests := []struct {
		name        string
		prefill     []string
		wantPrefill string // the endpoint the routed leg went to
		wantStatus  int    // of the error, 0 for none
	}{
		{"the first refuses, the second takes it", []string{refusing(), live.Addr()}, live.Addr(), 0},
		{"every one refuses", []string{refusing(), refusing()}, "", http.StatusServiceUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, m, _ := newPipeline(t, fmt.Sprintf(`connector: kv-sglang
pools: {prefill: {endpoints: [%q, %q], policy: round-robin}, decode: {endpoints: ["10.1.1.1:8000"]}}`, tt.prefill[0], tt.prefill[1]))
			t.Cleanup(p.Wait)
			r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
				Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
			d, err := p.Route(context.Background(), r)
			if tt.wantStatus != 0 {
				if e := (*pipeline.Error)(nil); !errors.As(err, &e) || e.Status != tt.wantStatus {
					t.Fatalf("Route = %v, want a %d", err, tt.wantStatus)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer d.Release()
			if r.Report.Prefill != tt.wantPrefill || !strings.Contains(string(d.Body.Bytes()), `"bootstrap_host"`) {
				t.Errorf("routed with the leg on %q (decode body %s), want it on %s", r.Report.Prefill, d.Body.Bytes(), tt.wantPrefill)
			}
			for e := range d.LegFailed {
				t.Errorf("the leg that was sent failed: %v", e)
			}
			if got, _ := m.Sample("pd_extproc_prefill_failures_total", map[string]string{"reason": "connect"}); got != 1 {
				t.Errorf("%v refused connections counted, want 1", got)
			}
		})
	}
}

// Until a kv-sglang leg is written, no decode engine waits for it: a client
// that has left, or leaves while its leg waits for a connection
// (prefill.max_conns_per_endpoint), takes its leg along. Before, the leg was
// sent anyway and held a slot of prefill.max_background, with SGLang's
// prefill waiting for a decode that never came, for up to prefill.timeout.
func TestAConcurrentLegLeavesWithItsClient(t *testing.T) {
	for _, waiting := range []bool{false, true} {
		t.Run(fmt.Sprintf("leaves while waiting for a connection %v", waiting), func(t *testing.T) {
			engine := newGate(t)
			p, _, _ := newPipeline(t, fmt.Sprintf(`connector: kv-sglang
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {max_background: 2, max_conns_per_endpoint: 1}`, engine.addr()))
			t.Cleanup(p.Wait)
			route := func(ctx context.Context) error {
				d, err := p.Route(ctx, &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
					Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)})
				d.Release()
				return err
			}
			if waiting { // a leg of a client still there holds the one connection
				if err := route(context.Background()); err != nil {
					t.Fatal(err)
				}
				engine.await(t)
			}
			ctx, leave := context.WithCancel(context.Background())
			if !waiting {
				leave() // gone before its request is routed: else its leg may be written first
			}
			done := make(chan error, 1)
			go func() { done <- route(ctx) }()
			leave() // while its leg waits for the one connection
			if err := enginetest.Receive(t, done, "Route still waits on the leg of a client that left"); err == nil {
				t.Error("the request of a client that left was routed")
			}
			engine.release()
			p.Wait()
			if n := len(engine.arrived); n != 0 { // past the one awaited
				t.Errorf("the gone client's leg reached the engine (%d more legs)", n)
			}
		})
	}
}

// connectionless is a transport to engines none of whose legs can be
// written (each waits for a connection, prefill.max_conns_per_endpoint, or
// for a dial that never ends) until its time is up; it records where each
// leg was to go.
type connectionless struct {
	mu    sync.Mutex
	tried []string
}

func (c *connectionless) RoundTrip(r *http.Request) (*http.Response, error) {
	c.mu.Lock()
	c.tried = append(c.tried, r.URL.Host)
	c.mu.Unlock()
	<-r.Context().Done()
	return nil, r.Context().Err()
}

// prefill.timeout bounds the whole prefill phase, retries included, under
// every connector: a concurrent leg that could not be written in its
// prefill.attempt_timeout leaves the next one what remains of the phase,
// as a sequential attempt does. Before, each concurrent leg tried had
// prefill.timeout of its own, so three attempts of 4 s answered at 12 s a
// request whose prefill.timeout was 10 s.
func TestPrefillTimeoutBoundsEveryLegTried(t *testing.T) {
	const timeout = 10 * time.Second
	for _, connector := range []string{"kv-nixl", "kv-sglang"} {
		t.Run(connector, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p, _, _ := newPipeline(t, fmt.Sprintf(`connector: %s
pools: {prefill: {endpoints: ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {timeout: %s, attempt_timeout: 4s, attempts: 3, on_failure: fail}`, connector, timeout))
				t.Cleanup(p.Wait)
				engines := &connectionless{}
				pipeline.WrapTransport(p, func(http.RoundTripper) http.RoundTripper { return engines })
				start := time.Now()
				d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
					Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)})
				took := time.Since(start)
				d.Release()
				if e := (*pipeline.Error)(nil); !errors.As(err, &e) || e.Status != http.StatusServiceUnavailable {
					t.Errorf("Route = %v, want a 503", err)
				}
				if took > timeout {
					t.Errorf("the client was answered after %s, past prefill.timeout %s", took, timeout)
				}
				if slices.Sort(engines.tried); len(slices.Compact(engines.tried)) != 3 {
					t.Errorf("legs went to %v, want each of the 3 endpoints once", engines.tried)
				}
			})
		})
	}
}
