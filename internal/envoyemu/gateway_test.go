package envoyemu

import (
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// TestGatewayFallbacks is Config.GatewayFallbacks (§8.2): the destination
// is a list; the first valid endpoint gets the request, a failure the
// route's retry policy retries goes down the list, and the response path's
// messages name the endpoint that answered. Plain Envoy retries the one
// host it has.
func TestGatewayFallbacks(t *testing.T) {
	ok := startUpstream(t)
	dead, dead2 := startUpstream(t), startUpstream(t)
	dead.Close()
	dead2.Close()
	answering := func(status int) *upstream {
		return startUpstreamWith(t, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(status) })
	}
	s503, s500 := answering(http.StatusServiceUnavailable), answering(http.StatusInternalServerError)
	var calls atomic.Int32
	flaky := startUpstreamWith(t, func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("second try"))
	})
	connect := &RetryPolicy{On: []string{"connect-failure"}, NumRetries: 3}
	on503 := &RetryPolicy{On: []string{"retriable-status-codes"}, NumRetries: 3, StatusCodes: []int{503}}
	tests := []struct {
		name     string
		plain    bool
		dest     string
		retry    *RetryPolicy
		status   int
		tried    []string // the emulator's attempts, in order
		served   string   // x-gateway-destination-endpoint-served on the response headers message
		gotBody  *upstream
		wantBody string
	}{
		{name: "the first endpoint serves", dest: ok.addr + "," + dead.addr, retry: connect, status: 200,
			tried: []string{ok.addr}, served: ok.addr, gotBody: ok},
		{name: "a refused connection goes down the list", dest: dead.addr + "," + ok.addr, retry: connect, status: 200,
			tried: []string{dead.addr, ok.addr}, served: ok.addr, gotBody: ok},
		{name: "a retriable 503 goes down the list", dest: s503.addr + ", " + ok.addr, retry: on503, status: 200,
			tried: []string{s503.addr, ok.addr}, served: ok.addr, gotBody: ok},
		{name: "a 500 the policy does not retry is the answer", dest: s500.addr + "," + ok.addr, retry: on503, status: 500,
			tried: []string{s500.addr}, served: s500.addr},
		{name: "without a retry policy the list is not tried", dest: dead.addr + "," + ok.addr, status: 503,
			tried: []string{dead.addr}},
		{name: "num_retries bounds the attempts", dest: strings.Join([]string{dead.addr, dead2.addr, ok.addr}, ","),
			retry: &RetryPolicy{On: []string{"reset"}, NumRetries: 1}, status: 503, tried: []string{dead.addr, dead2.addr}},
		{name: "the list ends the attempts", dest: dead.addr + "," + dead2.addr, retry: connect, status: 503,
			tried: []string{dead.addr, dead2.addr}},
		{name: "invalid entries are skipped", dest: "localhost:1," + ok.addr, retry: connect, status: 200,
			tried: []string{ok.addr}, served: ok.addr, gotBody: ok},
		{name: "plain Envoy retries its one host", plain: true, dest: flaky.addr, retry: on503, status: 200,
			tried: []string{flaky.addr, flaky.addr}, gotBody: flaky, wantBody: "second try"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := loadShipped(t, "envoy.yaml")
			cfg.GatewayFallbacks = !tc.plain
			cfg.Metadata.ForwardingNamespaces = []string{"envoy.lb"}
			for i := range cfg.Routes {
				cfg.Routes[i].Retry = tc.retry
			}
			served := make(chan string, 1)
			route := fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", tc.dest)), nil, nil)
			p := startProxy(t, cfg, func(s *procStream) error {
				return route(&procStream{t: s.t, ExternalProcessor_ProcessServer: servedSpy{s, served}})
			})
			var before int
			if tc.gotBody != nil {
				before = len(tc.gotBody.requests())
			}
			const body = `{"model":"m","prompt":"fallbacks"}`
			res := do(t, p, http.MethodPost, "/v1/completions", body, nil)
			if res.status != tc.status {
				t.Fatalf("status %d %q, want %d", res.status, res.body, tc.status)
			}
			if got := p.Upstreams(); !slices.Equal(got, tc.tried) {
				t.Errorf("attempts %v, want %v", got, tc.tried)
			}
			var got string
			select {
			case got = <-served:
			default:
			}
			if got != tc.served {
				t.Errorf("served %q on the response headers message, want %q", got, tc.served)
			}
			if tc.gotBody != nil {
				reqs, n := tc.gotBody.requests(), 0
				for _, a := range tc.tried {
					if a == tc.gotBody.addr {
						n++
					}
				}
				if len(reqs) != before+n || string(reqs[len(reqs)-1].Body) != body {
					t.Errorf("the endpoint that answered got %d requests, the last %q; want the body", len(reqs)-before, reqs[len(reqs)-1].Body)
				}
				want := tc.wantBody
				if want == "" {
					want = "upstream:" + body
				}
				if res.body != want {
					t.Errorf("answer %q, want %q", res.body, want)
				}
			}
		})
	}
}

// servedSpy passes the stream on, and sends the served endpoint that the
// response headers message carries (x-gateway-destination-endpoint-served).
type servedSpy struct {
	extprocv3.ExternalProcessor_ProcessServer
	served chan<- string
}

func (s servedSpy) Recv() (*extprocv3.ProcessingRequest, error) {
	m, err := s.ExternalProcessor_ProcessServer.Recv()
	if m.GetResponseHeaders() != nil {
		if v, ok := m.GetMetadataContext().GetFilterMetadata()["envoy.lb"].GetFields()[servedKey]; ok {
			s.served <- v.GetStringValue()
		}
	}
	return m, err
}
