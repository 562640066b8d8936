package pipeline_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

const (
	shedPrefill = "10.2.0.1:8000"
	shedDecode  = "10.2.0.2:8000"
)

// queues are the engines' waiting queues as their /metrics report them, by
// address, served without a network so that the pools' scrapes run on a
// synctest bubble's clock; a negative queue fails the scrape (500).
type queues struct {
	mu      sync.Mutex
	waiting map[string]float64
}

func (q *queues) set(addr string, waiting float64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.waiting[addr] = waiting
}

func (q *queues) RoundTrip(r *http.Request) (*http.Response, error) {
	q.mu.Lock()
	waiting := q.waiting[r.URL.Host]
	q.mu.Unlock()
	status, text := http.StatusNotFound, ""
	switch {
	case r.Method == http.MethodPost: // a prefill leg
		status, text = http.StatusOK, `{"id":"p","choices":[],"kv_transfer_params":`+prefillKV+`}`
	case r.URL.Path == "/metrics" && waiting < 0:
		status = http.StatusInternalServerError
	case r.URL.Path == "/metrics":
		status, text = http.StatusOK, fmt.Sprintf("vllm:num_requests_waiting %g\nvllm:num_requests_running 8\nvllm:kv_cache_usage_perc 0.1\n", waiting)
	}
	return &http.Response{StatusCode: status, Header: http.Header{}, Body: io.NopCloser(strings.NewReader(text)), Request: r}, nil
}

// runShed runs p's scrapes in the test's bubble until the test ends, and
// returns once the first are in.
func runShed(t *testing.T, p *pipeline.Pipeline) {
	ctx, cancel := context.WithCancel(t.Context())
	running := make(chan struct{})
	go func() { defer close(running); p.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-running })
	synctest.Wait()
}

// routeBatch routes a chat request of objective batch, which p may shed,
// and releases its decision: the request (its report says how long it was
// held) and Route's error.
func routeBatch(t *testing.T, p *pipeline.Pipeline) (*pipeline.Request, error) {
	r := &pipeline.Request{ContentType: "application/json", Method: http.MethodPost, Path: "/v1/chat/completions", RequestID: "req-1", Objective: "batch",
		Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
	d, err := p.Route(t.Context(), r)
	if d != nil {
		d.Release()
	}
	return r, err
}

// shedPipeline is a kv-nixl pipeline that sheds objective batch, holding it
// up to hold, whose pools scrape their engines through q: the decode pool
// decode's (shedDecode alone by default). Figures never go stale by age.
func shedPipeline(t *testing.T, q *queues, hold string, decode ...string) *pipeline.Pipeline {
	t.Helper()
	if decode == nil {
		decode = []string{shedDecode}
	}
	eps, _ := json.Marshal(decode)
	cfg, err := config.Parse(fmt.Appendf(nil, `connector: kv-nixl
pools:
  prefill: {endpoints: [%q], metrics: {interval: 100ms, stale_after: 1h}}
  decode: {endpoints: %s, metrics: {interval: 100ms, stale_after: 1h}}
admission: {objectives: {batch: -1}, hold: %s}
`, shedPrefill, eps, hold))
	if err != nil {
		t.Fatal(err)
	}
	c, err := kv.Build(cfg.Connector)
	if err != nil {
		t.Fatal(err)
	}
	spec := scheduling.Spec{
		Prefill: scheduling.PoolSpec{Endpoints: cfg.Pools.Prefill.Endpoints, PoolScheduling: cfg.Pools.Prefill.PoolScheduling},
		Decode:  scheduling.PoolSpec{Endpoints: cfg.Pools.Decode.Endpoints, PoolScheduling: cfg.Pools.Decode.PoolScheduling},
		PD:      cfg.PD,
	}
	a := cfg.Admission
	parts := pipeline.Parts{Connector: c, Table: api.NewTable(nil), Client: &http.Client{Transport: q}, Scheme: "http",
		Pools: scheduling.NewPools(spec, scheduling.Deps{Client: &http.Client{Transport: q}, Log: logr.Discard()})}
	return pipeline.New(parts, pipeline.Options{MaxBodyBytes: cfg.Limits.MaxBodyBytes, Connector: cfg.Connector,
		Shedding: pipeline.Shedding{Priorities: a.Objectives, Lines: scheduling.Lines{Queue: a.SaturatedQueue, KVCache: a.SaturatedKVCache},
			Hold: a.Held().D(), MaxHeld: a.MaxHeld, RetryAfter: a.RetryAfter.D()}}, logr.Discard())
}

// admission.hold bounds the whole time a request is held: a P/D request
// held for the decode pool, then for the prefill pool, gets its 429 once
// admission.hold is up, not after as much again in the second hold (nor
// past envoy.override_message_timeout, which counts one hold).
func TestAdmissionHoldBoundsBothPoolsTogether(t *testing.T) {
	tests := []struct {
		name             string
		decodeRoomAfter  time.Duration // the decode engine's queue empties; 0: never full
		prefillRoomAfter time.Duration // the prefill engine's queue empties; 0: never
		wantHeld         time.Duration // at most, in all
		wantErr          bool          // a 429
		wantHeldAtLeast  time.Duration
	}{
		{name: "decode held, then prefill for the rest of the hold", decodeRoomAfter: 6 * time.Second,
			wantHeldAtLeast: 10 * time.Second, wantHeld: 10*time.Second + 200*time.Millisecond, wantErr: true},
		{name: "prefill alone held", wantHeldAtLeast: 10 * time.Second, wantHeld: 10*time.Second + 200*time.Millisecond, wantErr: true},
		{name: "decode held, then prefill with room", decodeRoomAfter: 6 * time.Second, prefillRoomAfter: 7 * time.Second,
			wantHeldAtLeast: 6 * time.Second, wantHeld: 7*time.Second + 200*time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := &queues{waiting: map[string]float64{shedPrefill: 9, shedDecode: 0}}
				if tt.decodeRoomAfter > 0 {
					q.set(shedDecode, 9)
					time.AfterFunc(tt.decodeRoomAfter, func() { q.set(shedDecode, 0) })
				}
				if tt.prefillRoomAfter > 0 {
					time.AfterFunc(tt.prefillRoomAfter, func() { q.set(shedPrefill, 0) })
				}
				p := shedPipeline(t, q, "10s")
				runShed(t, p)
				r, err := routeBatch(t, p)
				var perr *pipeline.Error
				switch {
				case tt.wantErr && (!errors.As(err, &perr) || perr.Status != http.StatusTooManyRequests):
					t.Errorf("Route: %v, want a 429", err)
				case !tt.wantErr && err != nil:
					t.Errorf("Route: %v, want it routed", err)
				}
				if held := r.Report.HeldTime; held < tt.wantHeldAtLeast || held > tt.wantHeld {
					t.Errorf("held %v in all, want %v to %v (admission.hold 10s)", held, tt.wantHeldAtLeast, tt.wantHeld)
				}
			})
		})
	}
}

// A config reload reaches the requests already held, at once: new
// saturation lines judge them on the figures in hand (no scrape of the
// engines, whose queues stay as they were), and a shorter admission.hold
// cuts their time to their start + the new hold (a longer one does not
// lengthen it: Envoy's message timer and the clients' were set by the old).
// An objective no longer shed (its priority 0 or more, or gone) has its
// requests released at once, the pool still saturated: with no negative
// priority left admission.hold is 0, which would refuse them.
func TestAReloadReachesTheHeldRequests(t *testing.T) {
	const reloadAt = 2 * time.Second
	shed := map[string]int{"batch": -1}
	tests := []struct {
		name       string
		priorities map[string]int // the reloaded admission.objectives
		queue      float64        // the reloaded admission.saturated_queue
		hold       time.Duration  // the reloaded admission.hold (0 where nothing is shed)
		wantHeld   time.Duration  // when the request is answered
		want429    bool
	}{
		{"a higher queue line: released at the reload", shed, 10, 30 * time.Second, reloadAt, false},
		{"a shorter hold: refused at its start + the new hold", shed, 5, 5 * time.Second, 5 * time.Second, true},
		{"a hold already over: refused at the reload", shed, 5, time.Second, reloadAt, true},
		{"a longer hold: refused at the old one's end", shed, 5, time.Minute, 30 * time.Second, true},
		{"its objective no longer shed, another still: released at the reload",
			map[string]int{"batch": 0, "bulk": -1}, 5, 30 * time.Second, reloadAt, false},
		{"no objective shed any more: released at the reload", map[string]int{"batch": 1}, 5, 0, reloadAt, false},
		{"its objective gone: released at the reload", nil, 5, 0, reloadAt, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := &queues{waiting: map[string]float64{shedPrefill: 0, shedDecode: 9}}
				p := shedPipeline(t, q, "30s")
				runShed(t, p)
				time.AfterFunc(reloadAt, func() {
					p.SetShedding(pipeline.Shedding{Priorities: tt.priorities,
						Lines: scheduling.Lines{Queue: tt.queue, KVCache: config.DefaultSaturatedKVCache}, Hold: tt.hold, RetryAfter: time.Second})
				})
				r, err := routeBatch(t, p)
				var perr *pipeline.Error
				if got429 := errors.As(err, &perr) && perr.Status == http.StatusTooManyRequests; got429 != tt.want429 || err != nil && !got429 {
					t.Errorf("Route: %v, want a 429: %v", err, tt.want429)
				}
				// Within a tick of the hold (25ms), less than a scrape (100ms).
				if held := r.Report.HeldTime; held < tt.wantHeld || held >= tt.wantHeld+25*time.Millisecond {
					t.Errorf("answered after %v held, want %v", held, tt.wantHeld)
				}
			})
		})
	}
}

// At shutdown (Drain) a request held for room gets a 503 with Retry-After at
// once, as does one that would be held from then on; one that finds room is
// routed as ever.
func TestDrainAnswersTheRequestsHeldForRoom(t *testing.T) {
	const drainAt = 2 * time.Second
	tests := []struct {
		name       string
		arriveAt   time.Duration
		waiting    float64 // the decode engine's queue
		wantStatus int     // 0: routed
		wantHeld   time.Duration
	}{
		{"held when the drain begins", 0, 9, http.StatusServiceUnavailable, drainAt},
		{"would be held during the drain", drainAt + time.Second, 9, http.StatusServiceUnavailable, 0},
		{"finds room during the drain", drainAt + time.Second, 0, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := &queues{waiting: map[string]float64{shedPrefill: 0, shedDecode: tt.waiting}}
				p := shedPipeline(t, q, "30s")
				runShed(t, p)
				time.AfterFunc(drainAt, p.Drain)
				time.Sleep(tt.arriveAt) // the bubble's clock: no real time passes
				r, err := routeBatch(t, p)
				var perr *pipeline.Error
				status := 0
				if errors.As(err, &perr) {
					status = perr.Status
				} else if err != nil {
					t.Fatalf("Route: %v", err)
				}
				if status != tt.wantStatus || status != 0 && perr.RetryAfter <= 0 || r.Report.HeldTime != tt.wantHeld {
					t.Errorf("Route: %v after %v held; want status %d (0: routed) with Retry-After after %v", err, r.Report.HeldTime, tt.wantStatus, tt.wantHeld)
				}
			})
		})
	}
}

// The saturation of a pool is judged by the endpoints whose last scrape
// answered: one whose scrapes fail holds no release back (the others' new
// figures make a round), and its last figures do not read as room.
func TestAnEndpointWhoseScrapesFailIsNotJudgedByItsLastFigures(t *testing.T) {
	const failing = "10.2.0.3:8000" // its scrapes fail after the first
	const arrive = 500 * time.Millisecond
	tests := []struct {
		name         string
		queues       map[string]float64 // the decode engines' at the first scrape
		room         bool               // shedDecode's queue empties at 1 s
		wantHeld     time.Duration      // at least
		wantHeldLess time.Duration
		want429      bool
	}{
		{"the other endpoint has room: released at its next scrape",
			map[string]float64{shedDecode: 9, failing: 9}, true, 500 * time.Millisecond, 700 * time.Millisecond, false},
		{"its last figures showed room: held, then refused",
			map[string]float64{shedDecode: 9, failing: 0}, false, 10 * time.Second, 10100 * time.Millisecond, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := &queues{waiting: map[string]float64{shedPrefill: 0}}
				for addr, n := range tt.queues {
					q.set(addr, n)
				}
				p := shedPipeline(t, q, "10s", shedDecode, failing)
				runShed(t, p)
				q.set(failing, -1)
				if tt.room {
					time.AfterFunc(time.Second, func() { q.set(shedDecode, 0) })
				}
				time.Sleep(arrive) // the bubble's clock: failed scrapes are in
				r, err := routeBatch(t, p)
				var perr *pipeline.Error
				if got429 := errors.As(err, &perr) && perr.Status == http.StatusTooManyRequests; got429 != tt.want429 || err != nil && !got429 {
					t.Errorf("Route: %v, want a 429: %v", err, tt.want429)
				}
				if held := r.Report.HeldTime; held < tt.wantHeld || held >= tt.wantHeldLess {
					t.Errorf("answered after %v held, want %v to %v", held, tt.wantHeld, tt.wantHeldLess)
				}
			})
		})
	}
}
