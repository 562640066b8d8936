package envoyemu

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestResources is the circuit-breaker model of §12 step by step: what starts,
// what waits, what overflows and which counter says so.
func TestResources(t *testing.T) {
	type step struct {
		op   string // "acquire" (must not wait), "wait" (must be left pending), "release" (the oldest held)
		want error  // acquire: nil or errOverflow
	}
	tests := []struct {
		name    string
		t       Thresholds
		perConn int
		steps   []step
		want    ClusterStats // after the steps
	}{
		{
			name: "max_requests below what the connections carry: overflow at once",
			t:    Thresholds{MaxConnections: 10, MaxPendingRequests: 10, MaxRequests: 2},
			steps: []step{{"acquire", nil}, {"acquire", nil}, {"acquire", errOverflow},
				{"release", nil}, {"acquire", nil}},
			want: ClusterStats{RqTotal: 3, RqActive: 2, RqActiveOverflow: 1},
		},
		{
			name: "HTTP/1 connections full: pending, then the pending queue overflows",
			t:    Thresholds{MaxConnections: 2, MaxPendingRequests: 1, MaxRequests: 10},
			steps: []step{{"acquire", nil}, {"acquire", nil}, {"wait", nil}, {"acquire", errOverflow},
				{"release", nil}}, // the pending request starts in the freed slot
			want: ClusterStats{RqTotal: 3, RqActive: 2, RqPendingTotal: 1, RqPendingOverflow: 1},
		},
		{
			name:    "HTTP/2 carries max_concurrent_streams per connection",
			t:       Thresholds{MaxConnections: 1, MaxPendingRequests: 1, MaxRequests: 10},
			perConn: 3,
			steps:   []step{{"acquire", nil}, {"acquire", nil}, {"acquire", nil}, {"wait", nil}, {"acquire", errOverflow}},
			want:    ClusterStats{RqTotal: 3, RqActive: 3, RqPendingTotal: 1, RqPendingActive: 1, RqPendingOverflow: 1},
		},
		{
			name: "Envoy's defaults: 1,024 requests",
			t:    DefaultThresholds,
			steps: append(repeatStep(step{"acquire", nil}, 1024),
				step{"wait", nil}), // connections are full too: the 1,025th waits
			want: ClusterStats{RqTotal: 1024, RqActive: 1024, RqPendingTotal: 1, RqPendingActive: 1},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := newResources(tc.t, tc.perConn)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var held []func()
			var pending []chan func()
			for i, s := range tc.steps {
				switch s.op {
				case "acquire":
					rel, err := r.acquire(ctx)
					if !errors.Is(err, s.want) || (s.want == nil) != (rel != nil) {
						t.Fatalf("step %d: acquire = %v, want %v", i, err, s.want)
					}
					if rel != nil {
						held = append(held, rel)
					}
				case "wait":
					before := r.snapshot().RqPendingActive
					got := make(chan func(), 1)
					go func() {
						rel, _ := r.acquire(ctx)
						got <- rel
					}()
					waitUntil(t, "the request is pending", func() bool { return r.snapshot().RqPendingActive == before+1 })
					pending = append(pending, got)
				case "release":
					held[0]()
					held[0]() // twice: a release is idempotent
					held = held[1:]
					if len(pending) > 0 {
						if rel := <-pending[0]; rel == nil {
							t.Fatalf("step %d: the pending request was refused after a release", i)
						} else {
							held = append(held, rel)
						}
						pending = pending[1:]
					}
				}
			}
			if got := r.snapshot(); got != tc.want {
				t.Errorf("stats = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func repeatStep[T any](s T, n int) []T {
	out := make([]T, n)
	for i := range out {
		out[i] = s
	}
	return out
}

// TestResourcesAbandonedWhilePending: a request given up while it waits (the
// client left) gives its place back and takes no slot later.
func TestResourcesAbandonedWhilePending(t *testing.T) {
	r := newResources(Thresholds{MaxConnections: 1, MaxPendingRequests: 1, MaxRequests: 1}, 1)
	rel, err := r.acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := r.acquire(ctx)
		errc <- err
	}()
	waitUntil(t, "the request is pending", func() bool { return r.snapshot().RqPendingActive == 1 })
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned acquire = %v, want context.Canceled", err)
	}
	rel()
	if st := r.snapshot(); st.RqActive != 0 || st.RqPendingActive != 0 {
		t.Fatalf("after the release: %+v, want nothing active or pending", st)
	}
}

// waitUntil polls cond: the model's state changes on other goroutines, and
// the test waits for that state, not for time.
func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// holdingRouter routes like fullDuplexRouter to addr, but first reports each
// stream on arrived and holds it until release is closed.
func holdingRouter(addr string, arrived chan<- struct{}, release <-chan struct{}) func(*procStream) error {
	route := fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", addr)), nil, nil)
	return func(s *procStream) error {
		arrived <- struct{}{}
		select {
		case <-release:
		case <-s.Context().Done():
			return nil
		}
		return route(s)
	}
}

// TestExtProcClusterOverflow: past the ext_proc cluster's max_requests the
// filter's stream fails with UNAVAILABLE and, failing closed, it answers 500
// before the processor sees the request (§12).
func TestExtProcClusterOverflow(t *testing.T) {
	up := startUpstream(t)
	arrived, release := make(chan struct{}, 8), make(chan struct{})
	cfg := loadShipped(t, "envoy.yaml")
	cfg.Clusters[cfg.ExtProcCluster].Breakers = Thresholds{MaxConnections: 1024, MaxPendingRequests: 1024, MaxRequests: 2}
	p := startProxy(t, cfg, holdingRouter(up.addr, arrived, release))

	held := make(chan result, 2)
	for range 2 {
		go func() {
			req, _ := http.NewRequest(http.MethodPost, p.URL()+"/v1/completions", strings.NewReader(`{"model":"m"}`))
			held <- send(req)
		}()
		<-arrived
	}
	res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
	const details = "ext_proc_error_gRPC_error_14{upstream_connect_error_or_disconnect/reset_before_headers._reset_reason:_overflow}"
	if res.status != http.StatusInternalServerError || res.header.Get(DetailsHeader) != details {
		t.Errorf("third request = %d (%s), want 500 (%s)", res.status, res.header.Get(DetailsHeader), details)
	}
	if len(arrived) != 0 {
		t.Error("the processor saw the overflowing request")
	}
	close(release)
	for range 2 {
		if r := <-held; r.err != nil || r.status != http.StatusOK {
			t.Errorf("held request = %d %v, want 200", r.status, r.err)
		}
	}
	if st := p.ClusterStats()[cfg.ExtProcCluster]; st.RqActiveOverflow != 1 || st.RqTotal != 2 {
		t.Errorf("ext_proc cluster stats = %+v, want 2 requests and 1 active overflow", st)
	}
}

// TestDecodeClusterOverflow: the route cluster's breakers queue what its
// connections cannot carry and refuse what the queue cannot hold, with
// Envoy's 503 overflow reply, which the processor never sees (§12).
func TestDecodeClusterOverflow(t *testing.T) {
	tests := []struct {
		name       string
		suppress   bool
		overloaded string // the x-envoy-overloaded header the client gets
	}{
		{"Envoy's headers", false, "true"},
		{"suppress_envoy_headers", true, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			arrived, release := make(chan struct{}, 8), make(chan struct{})
			up := startUpstreamWith(t, func(w http.ResponseWriter, _ *http.Request) {
				arrived <- struct{}{}
				<-release
				_, _ = w.Write([]byte("done"))
			})
			cfg := loadShipped(t, "envoy.yaml")
			cfg.SuppressEnvoyHeaders = tc.suppress
			cfg.Clusters["pd_original_dst"].Breakers = Thresholds{MaxConnections: 1, MaxPendingRequests: 1, MaxRequests: 1024}
			p := startProxy(t, cfg, fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil, nil))
			results := make(chan result, 2)
			post := func() {
				req, _ := http.NewRequest(http.MethodPost, p.URL()+"/v1/completions", strings.NewReader(`{"model":"m"}`))
				results <- send(req)
			}
			go post()
			<-arrived // the first request holds the one connection
			go post()
			waitUntil(t, "the second request is pending", func() bool { return p.ClusterStats()["pd_original_dst"].RqPendingActive == 1 })

			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
			if res.status != http.StatusServiceUnavailable || res.header.Get("X-Envoy-Overloaded") != tc.overloaded ||
				res.body != envoyError(503, errOverflow.Error(), "upstream_error") || res.header.Get(DetailsHeader) != "upstream_reset_before_response_started{overflow}" {
				t.Errorf("third request = %d %q overloaded=%q (%s), want 503 overflow, overloaded=%q",
					res.status, res.body, res.header.Get("X-Envoy-Overloaded"), res.header.Get(DetailsHeader), tc.overloaded)
			}
			close(release)
			for range 2 {
				if r := <-results; r.err != nil || r.status != http.StatusOK || r.body != "done" {
					t.Errorf("queued request = %d %q %v, want 200 done", r.status, r.body, r.err)
				}
			}
			// A request leaves the cluster after its client has the answer.
			waitUntil(t, "the queued requests to leave the cluster", func() bool { return p.ClusterStats()["pd_original_dst"].RqActive == 0 })
			st := p.ClusterStats()["pd_original_dst"]
			if st.RqTotal != 2 || st.RqPendingTotal != 1 || st.RqPendingOverflow != 1 || st.RqActive != 0 {
				t.Errorf("decode cluster stats = %+v, want 2 requests, 1 pending, 1 pending overflow, none active", st)
			}
		})
	}
}

// TestExtProcEndpointsInTurn: the endpoints of an ext_proc cluster without
// a hash policy take the streams in turn, as Envoy's ROUND_ROBIN load
// balancer gives them.
func TestExtProcEndpointsInTurn(t *testing.T) {
	up := startUpstream(t)
	const endpoints, perEndpoint = 3, 4
	counts := make([]chan struct{}, endpoints)
	for i := range counts {
		counts[i] = make(chan struct{}, endpoints*perEndpoint)
	}
	cfg := loadShipped(t, "envoy.yaml")
	cfg.Clusters[cfg.ExtProcCluster].HashHeaders = nil
	p := startProxyOn(t, cfg, startReplicas(t, endpoints, up.addr, func(i int, _ *procStream) { counts[i] <- struct{}{} })...)
	for range endpoints * perEndpoint {
		if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil); res.status != http.StatusOK {
			t.Fatalf("status %d %q", res.status, res.body)
		}
	}
	for i, c := range counts {
		if len(c) != perEndpoint {
			t.Errorf("endpoint %d got %d streams, want %d", i, len(c), perEndpoint)
		}
	}
}
