package server

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc/health"

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
