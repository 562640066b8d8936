package server

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/pd-extproc/pd-extproc/pkg/discovery"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// The decode pool's check passes while the pool has an endpoint to route to:
// a healthy one, or one that only failed requests keep out (the pool routes
// among those); only endpoints the active checks find down, or none at all,
// fail it.
func TestReadinessNamesTheDecodePoolState(t *testing.T) {
	ep := func(healthy, checkedDown bool) metrics.EndpointState {
		return metrics.EndpointState{Pool: "decode", Endpoint: "10.0.0.2:8000", Healthy: healthy, CheckedDown: checkedDown}
	}
	tests := []struct {
		name      string
		endpoints []metrics.EndpointState
		wantCode  int
		wantLine  string
	}{
		{"healthy", []metrics.EndpointState{ep(true, false)}, http.StatusOK, "[+]decode pool: 1 of 1 endpoints healthy"},
		{"ejected by failed requests", []metrics.EndpointState{ep(false, false)}, http.StatusOK,
			"[+]decode pool: every endpoint failed requests; routing among the 1 no active check finds down (0 of 1 endpoints healthy)"},
		{"checked down", []metrics.EndpointState{ep(false, true)}, http.StatusServiceUnavailable,
			"[-]decode pool: no healthy decode endpoint (0 of 1 endpoints healthy)"},
		{"none", nil, http.StatusServiceUnavailable, "[-]decode pool: no healthy decode endpoint (0 of 0 endpoints healthy)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := newReadiness(health.NewServer(), []string{"decode"}, func() []metrics.EndpointState { return tc.endpoints }, logr.Discard())
			r.update()
			rec := httptest.NewRecorder()
			r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz?verbose", nil))
			if rec.Code != tc.wantCode || !strings.Contains(rec.Body.String(), tc.wantLine) {
				t.Errorf("/readyz?verbose = %d\n%s\nwant %d with %q", rec.Code, rec.Body, tc.wantCode, tc.wantLine)
			}
		})
	}
}

func TestReadinessFollowsDiscovery(t *testing.T) {
	healthy := func() []metrics.EndpointState {
		return []metrics.EndpointState{{Pool: "decode", Endpoint: "10.0.0.2:8000", Healthy: true}}
	}
	synced := discovery.PoolStatus{Pool: "prefill", Namespace: "llm", Synced: true, Reachable: true, Endpoints: 3, PoolFound: true}
	tests := []struct {
		name      string
		status    func(*discovery.PoolStatus)
		wantCode  int
		wantLines []string // in /readyz?verbose
	}{
		{"synced", func(*discovery.PoolStatus) {}, http.StatusOK,
			[]string{"[+]decode pool: 1 of 1 endpoints healthy", `[+]kubernetes prefill: pods in namespace "llm": synced, 3 endpoints; API server reachable`, "ready"}},
		{"not synced yet", func(s *discovery.PoolStatus) { s.Synced, s.Reachable = false, false }, http.StatusServiceUnavailable,
			[]string{`[-]kubernetes prefill: pods in namespace "llm": not synced yet`, "not ready: kubernetes prefill"}},
		{"refused", func(s *discovery.PoolStatus) { s.Refused = errors.New("may not watch pods") }, http.StatusServiceUnavailable,
			[]string{"[-]kubernetes prefill", "refused: may not watch pods"}},
		{"API server lost after the sync: still ready", func(s *discovery.PoolStatus) {
			s.Reachable, s.LastError, s.LastErrorAt = false, errors.New("connection refused"), time.Now()
		}, http.StatusOK, []string{"[+]kubernetes prefill", "API server unreachable, serving the last endpoints known", "connection refused"}},
		{"InferencePool missing", func(s *discovery.PoolStatus) { s.InferencePool, s.PoolFound, s.Endpoints = "vllm", false, 0 }, http.StatusOK,
			[]string{"[+]kubernetes prefill: InferencePool llm/vllm: synced; the InferencePool does not exist"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st := synced
			tc.status(&st)
			r := newReadiness(health.NewServer(), []string{"decode"}, healthy, logr.Discard())
			r.discovery = func() []discovery.PoolStatus { return []discovery.PoolStatus{st} }
			r.update()
			rec := httptest.NewRecorder()
			r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz?verbose", nil))
			if rec.Code != tc.wantCode {
				t.Errorf("/readyz = %d, want %d:\n%s", rec.Code, tc.wantCode, rec.Body)
			}
			for _, line := range tc.wantLines {
				if !strings.Contains(rec.Body.String(), line) {
					t.Errorf("/readyz?verbose lacks %q:\n%s", line, rec.Body)
				}
			}
			plain := httptest.NewRecorder()
			r.ServeHTTP(plain, httptest.NewRequest(http.MethodGet, "/readyz", nil))
			if strings.Contains(plain.Body.String(), "[+]") {
				t.Errorf("plain /readyz lists the checks: %s", plain.Body)
			}
		})
	}
}

// /readyz and /readyz?verbose answer from one reading of the checks, made
// when asked, and gRPC health follows it: the plain answer was the state
// the last periodic update found (up to a second old) while ?verbose
// listed the checks as they were now, so the two could disagree, and a
// probe saw 200 with a failing check listed. kube-apiserver's /readyz
// runs its checks once per request for both (k8s.io/apiserver
// pkg/server/healthz/healthz.go, handleRootHealth).
func TestReadyzAndVerboseAgree(t *testing.T) {
	ep := func(healthy, checkedDown bool) []metrics.EndpointState {
		return []metrics.EndpointState{{Pool: "decode", Endpoint: "10.0.0.2:8000", Healthy: healthy, CheckedDown: checkedDown}}
	}
	down := "[-]decode pool: no healthy decode endpoint (0 of 1 endpoints healthy)\n"
	tests := []struct {
		name      string
		was, now  []metrics.EndpointState // at the last update; when asked
		draining  bool
		wantCode  int
		wantPlain string
		wantGRPC  healthpb.HealthCheckResponse_ServingStatus
	}{
		{"was ready, now down", ep(true, false), ep(false, true), false, http.StatusServiceUnavailable,
			"not ready: decode pool: no healthy decode endpoint (0 of 1 endpoints healthy)\n", healthpb.HealthCheckResponse_NOT_SERVING},
		{"was down, now ready", ep(false, true), ep(true, false), false, http.StatusOK, "ready\n", healthpb.HealthCheckResponse_SERVING},
		{"was empty, now down: today's reason", nil, ep(false, true), false, http.StatusServiceUnavailable,
			"not ready: decode pool: no healthy decode endpoint (0 of 1 endpoints healthy)\n", healthpb.HealthCheckResponse_NOT_SERVING},
		{"ready throughout", ep(true, false), ep(true, false), false, http.StatusOK, "ready\n", healthpb.HealthCheckResponse_SERVING},
		{"draining, the pool ready", ep(true, false), ep(true, false), true, http.StatusServiceUnavailable, "shutting down\n",
			healthpb.HealthCheckResponse_NOT_SERVING},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var states atomic.Pointer[[]metrics.EndpointState]
			states.Store(&tc.was)
			hs := health.NewServer()
			r := newReadiness(hs, []string{"decode"}, func() []metrics.EndpointState { return *states.Load() }, logr.Discard())
			r.update()
			states.Store(&tc.now) // no update: the poller has not run since
			if tc.draining {
				r.drain()
			}
			answer := func(target string) (int, string) {
				rec := httptest.NewRecorder()
				r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, target, nil))
				return rec.Code, rec.Body.String()
			}
			code, body := answer("/readyz")
			if code != tc.wantCode || body != tc.wantPlain {
				t.Errorf("/readyz = %d %q, want %d %q", code, body, tc.wantCode, tc.wantPlain)
			}
			code, body = answer("/readyz?verbose")
			wantList := "[+]decode pool: 1 of 1 endpoints healthy\n"
			if tc.now[0].CheckedDown {
				wantList = down
			}
			if code != tc.wantCode || body != wantList+tc.wantPlain {
				t.Errorf("/readyz?verbose = %d %q, want %d %q", code, body, tc.wantCode, wantList+tc.wantPlain)
			}
			for _, svc := range healthServices {
				if resp, err := hs.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc}); err != nil || resp.GetStatus() != tc.wantGRPC {
					t.Errorf("gRPC health of %q after /readyz = %v, %v; want %v", svc, resp.GetStatus(), err, tc.wantGRPC)
				}
			}
		})
	}
}
