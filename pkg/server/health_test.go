package server

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

const extProcService = "envoy.service.ext_proc.v3.ExternalProcessor"

// fakePools stands in for pkg/scheduling's endpoint state: one prefill and one
// decode endpoint whose health the test sets.
type fakePools struct{ decodeHealthy, decodeCheckedDown atomic.Bool }

func (f *fakePools) endpoints() []metrics.EndpointState {
	return []metrics.EndpointState{
		{Pool: "prefill", Endpoint: "10.0.0.1:8000", Healthy: true},
		{Pool: "decode", Endpoint: decodeEP, Healthy: f.decodeHealthy.Load(), CheckedDown: f.decodeCheckedDown.Load()},
	}
}

// awaitHealth follows the health Watch stream of service until it reports
// want: the server's own poller has to notice the change, with no sleeps.
func awaitHealth(t *testing.T, c healthpb.HealthClient, service string, want healthpb.HealthCheckResponse_ServingStatus) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, err := c.Watch(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		t.Fatal(err)
	}
	for {
		resp, err := w.Recv()
		if err != nil {
			t.Fatalf("health of %q never became %v: %v", service, want, err)
		}
		if resp.GetStatus() == want {
			return
		}
	}
}

func TestReadinessFollowsTheDecodePool(t *testing.T) {
	pools := &fakePools{}
	pools.decodeHealthy.Store(true)
	r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {decode: {endpoints: [%q]}}", decodeEP),
		Options{Endpoints: pools.endpoints, HealthInterval: time.Millisecond}, logr.Discard())

	// In turn: the first three each a change the poller must notice.
	tests := []struct {
		name                 string
		healthy, checkedDown bool
		wantGRPC             healthpb.HealthCheckResponse_ServingStatus
		wantReadyz           int
		wantGauge            float64
	}{
		{"healthy decode endpoint", true, false, healthpb.HealthCheckResponse_SERVING, http.StatusOK, 1},
		{"the decode endpoint checked down", false, true, healthpb.HealthCheckResponse_NOT_SERVING, http.StatusServiceUnavailable, 0},
		// Ejected by failed requests alone: the decode pool still routes to it.
		{"the decode endpoint ejected", false, false, healthpb.HealthCheckResponse_SERVING, http.StatusOK, 0},
		{"decode endpoint recovered", true, false, healthpb.HealthCheckResponse_SERVING, http.StatusOK, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pools.decodeHealthy.Store(tt.healthy)
			pools.decodeCheckedDown.Store(tt.checkedDown)
			for _, svc := range []string{"", extProcService, "readiness"} {
				awaitHealth(t, r.health, svc, tt.wantGRPC)
				resp, err := r.health.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
				if err != nil || resp.GetStatus() != tt.wantGRPC {
					t.Errorf("Check(%q) = %v, %v; want %v", svc, resp.GetStatus(), err, tt.wantGRPC)
				}
			}
			if code, body := r.get(t, "/readyz"); code != tt.wantReadyz {
				t.Errorf("/readyz = %d %q, want %d", code, body, tt.wantReadyz)
			}
			if code, _ := r.get(t, "/healthz"); code != http.StatusOK {
				t.Errorf("/healthz = %d: the process is alive whatever the pool", code)
			}
			if resp, err := r.health.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "liveness"}); err != nil ||
				resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
				t.Errorf(`Check("liveness") = %v, %v: the process is alive whatever the pool`, resp.GetStatus(), err)
			}
			key := series("pd_extproc_endpoint_healthy", "endpoint", decodeEP, "pool", "decode")
			if got := r.scrape(t)[key]; got != tt.wantGauge {
				t.Errorf("%s = %v, want %v", key, got, tt.wantGauge)
			}
		})
	}
}

func TestShutdownTurnsNotReadyThenDrains(t *testing.T) {
	tests := []struct {
		name         string
		grace        time.Duration
		finishInTime bool // the held request completes within the grace period
	}{
		{"in-flight stream finishes within the grace", time.Minute, true},
		{"grace over: the stream is cut", 20 * time.Millisecond, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			release := make(chan struct{})
			prefill := enginetest.Start(t, blocked(release, prefillOK))
			defer close(release)
			r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
				prefill.Addr(), decodeEP), Options{Grace: tt.grace}, logr.Discard())

			type result struct {
				dest string
				err  error
			}
			done := make(chan result, 1)
			go func() {
				replies, err := r.tryExchange(post(chatPath, `{"model":"m","prompt":"hi"}`)...)
				var dest string
				if len(replies) > 0 {
					dest = destination(replies[0])
				}
				done <- result{dest, err}
			}()
			prefill.Await(t) // the stream is in flight, held by the prefill leg

			r.stop() // SIGTERM
			<-r.draining
			if code, body := r.get(t, "/readyz"); code != http.StatusServiceUnavailable {
				t.Errorf("/readyz while draining = %d %q, want 503", code, body)
			}
			for _, svc := range []string{"", extProcService, "readiness", "liveness"} {
				resp, err := r.ready.health.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
				if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
					t.Errorf("health of %q while draining = %v, %v; want NOT_SERVING", svc, resp.GetStatus(), err)
				}
			}

			if tt.finishInTime {
				release <- struct{}{} // answer the held prefill leg
			}
			res := <-done
			if tt.finishInTime && (res.err != nil || res.dest != decodeEP) {
				t.Errorf("in-flight request = %q, %v; want it routed to %s during the drain", res.dest, res.err, decodeEP)
			}
			if !tt.finishInTime && res.err == nil {
				t.Errorf("in-flight request routed to %q after the grace period; want the stream cut", res.dest)
			}
			if err := r.wait(t); err != nil {
				t.Errorf("Serve = %v, want a clean shutdown", err)
			}
		})
	}
}

// A kv-sglang prefill leg outlives its stream (Envoy closes a stream once it
// is routed), so at shutdown it gets what is left of the grace and is then
// cut short: Serve waited for it past --shutdown-grace, up to
// prefill.timeout (an hour here).
func TestShutdownCutsBackgroundLegsAfterTheGrace(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	prefill := enginetest.Start(t, blocked(release, prefillOK))
	r := start(t, fmt.Sprintf("connector: kv-sglang\nprefill: {timeout: 1h}\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
		prefill.Addr(), decodeEP), Options{Grace: 20 * time.Millisecond}, logr.Discard())
	replies, err := r.tryExchange(post(chatPath, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)...)
	if err != nil || len(replies) == 0 || destination(replies[0]) != decodeEP {
		t.Fatalf("the request was not routed: %v %v", replies, err)
	}
	prefill.Await(t) // its leg runs on, held by the prefill engine
	r.stop()
	if err := r.wait(t); err != nil {
		t.Errorf("Serve = %v, want a clean shutdown", err)
	}
}

// A request held for room (admission.hold) is answered at shutdown at once,
// with a 503 in OpenAI's error JSON and Retry-After: no room will come, and
// the grace would otherwise run out while it waits, cutting its stream
// (Envoy then answers per its failure_mode_allow).
func TestShutdownAnswersTheHeldRequests(t *testing.T) {
	engine := enginetest.Start(t, func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "vllm:num_requests_waiting 9\nvllm:num_requests_running 8\n") // past the queue line
	})
	r := start(t, fmt.Sprintf(`connector: kv-nixl
pools: {decode: {endpoints: [%q], metrics: {interval: 1s}}}
admission: {objectives: {batch: -1}, hold: 1h, retry_after: 7s}`, engine.Addr()), Options{Grace: time.Hour}, logr.Discard())
	done := make(chan []*extprocv3.ProcessingResponse, 1)
	go func() {
		replies, _ := r.tryExchange(post(chatPath, `{"model":"m","prompt":"hi"}`, hdr{"x-gateway-inference-objective", "batch"})...)
		done <- replies
	}()
	for deadline := time.Now().Add(10 * time.Second); ; runtime.Gosched() {
		if _, held := r.pipeline.Held(); held == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the request was never held")
		}
	}
	r.stop() // SIGTERM
	replies := enginetest.Receive(t, done, "the held request was not answered at shutdown")
	var ir *extprocv3.ImmediateResponse
	if len(replies) > 0 {
		ir = replies[len(replies)-1].GetImmediateResponse()
	}
	retryAfter := ""
	for _, h := range ir.GetHeaders().GetSetHeaders() {
		if h.GetHeader().GetKey() == "retry-after" {
			retryAfter = string(h.GetHeader().GetRawValue())
		}
	}
	if ir.GetStatus().GetCode() != 503 || retryAfter != "7" || !strings.Contains(string(ir.GetBody()), `"type":"service_unavailable"`) {
		t.Errorf("the held request's answer at shutdown: %d, Retry-After %q, %s; want 503, 7 and OpenAI's error JSON",
			ir.GetStatus().GetCode(), retryAfter, ir.GetBody())
	}
	if err := r.wait(t); err != nil {
		t.Errorf("Serve = %v, want a clean shutdown", err)
	}
}

func TestAdminEndpoints(t *testing.T) {
	tests := []struct {
		path  string
		pprof bool
		want  int
	}{
		{"/healthz", false, http.StatusOK},
		{"/readyz", false, http.StatusOK},
		{"/metrics", false, http.StatusOK},
		{"/debug/pprof/", false, http.StatusNotFound},
		{"/debug/pprof/", true, http.StatusOK},
		{"/debug/pprof/cmdline", true, http.StatusOK},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s pprof=%v", tt.path, tt.pprof), func(t *testing.T) {
			r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {decode: {endpoints: [%q]}}", decodeEP), Options{Pprof: tt.pprof}, logr.Discard())
			if code, body := r.get(t, tt.path); code != tt.want {
				t.Errorf("GET %s = %d %.100q, want %d", tt.path, code, body, tt.want)
			}
		})
	}
}

// The profiler answers on loopback only (a port-forward arrives there); a
// client on another address, such as Prometheus reaching the admin port,
// gets 403, while /metrics still answers it.
func TestProfilerAnswersOnLoopbackOnly(t *testing.T) {
	cfg, err := config.Parse([]byte(fmt.Sprintf("connector: kv-nixl\npools: {decode: {endpoints: [%q]}}", decodeEP)))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(cfg, Options{Pprof: true}, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.shutdownTracing(context.Background()) })
	mux := s.adminMux()
	tests := []struct {
		path, remote string
		want         int
	}{
		{"/debug/pprof/cmdline", "127.0.0.1:40000", http.StatusOK},
		{"/debug/pprof/cmdline", "[::1]:40000", http.StatusOK},
		{"/debug/pprof/cmdline", "10.1.2.3:40000", http.StatusForbidden},
		{"/debug/pprof/", "[2001:db8::1]:40000", http.StatusForbidden},
		{"/metrics", "10.1.2.3:40000", http.StatusOK},
	}
	for _, tt := range tests {
		req := httptest.NewRequest(http.MethodGet, tt.path, nil)
		req.RemoteAddr = tt.remote
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		if rec.Code != tt.want {
			t.Errorf("GET %s from %s = %d, want %d", tt.path, tt.remote, rec.Code, tt.want)
		}
	}
}

// A client watching the health service (grpc-go's client-side health
// checking, a monitor) is told NOT_SERVING when the server drains, and its
// watch then ends: it is not a request in flight, and must not hold the
// shutdown for the grace period.
func TestAHealthWatchEndsWithTheDrain(t *testing.T) {
	r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
		refusedEP, decodeEP), Options{Grace: time.Minute}, logr.Discard())
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second) // well within the grace
	defer cancel()
	watch, err := r.health.Watch(ctx, &healthpb.HealthCheckRequest{Service: ""})
	if err != nil {
		t.Fatal(err)
	}
	for {
		resp, err := watch.Recv()
		if err != nil {
			t.Fatalf("watch before the drain: %v", err)
		}
		if resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			break
		}
	}
	r.stop() // SIGTERM
	var told bool
	for {
		resp, err := watch.Recv()
		if status.Code(err) == codes.DeadlineExceeded {
			t.Fatal("the watch outlived the drain")
		}
		if err != nil {
			break
		}
		told = told || resp.GetStatus() == healthpb.HealthCheckResponse_NOT_SERVING
	}
	if !told {
		t.Error("the watch ended without NOT_SERVING")
	}
	if err := r.wait(t); err != nil { // within 10 s: before, the grace's minute
		t.Errorf("Serve = %v, want a clean shutdown", err)
	}
}

// A decode pool whose engines are checked (health.check_interval) is not
// ready before a check has passed: at start the endpoints were taken healthy
// before any check, so /readyz said 200 and gRPC health SERVING while the
// engines refused every connection (vLLM still loading its model), until
// the first round of checks ended and the next poll (up to check_timeout
// and a second later) noticed. Without checks, the endpoints are ready at
// once, as before.
func TestReadinessWaitsForTheFirstCheck(t *testing.T) {
	engine := enginetest.Start(t, func(http.ResponseWriter, *http.Request) {}) // /health: 200
	tests := []struct {
		name   string
		health string // the decode pool's health key
		serve  bool   // run the server (its checks); else only New
		want   healthpb.HealthCheckResponse_ServingStatus
	}{
		{"checks on, none has run: not ready", "{check_interval: 1s}", false, healthpb.HealthCheckResponse_NOT_SERVING},
		{"checks off: ready at once", "{}", false, healthpb.HealthCheckResponse_SERVING},
		{"checks on, the first passed: ready", "{check_interval: 1s}", true, healthpb.HealthCheckResponse_SERVING},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			yaml := fmt.Sprintf("connector: kv-nixl\npools: {decode: {endpoints: [%q], health: %s}}", engine.Addr(), tt.health)
			if tt.serve {
				r := start(t, yaml, Options{HealthInterval: 10 * time.Millisecond}, logr.Discard())
				awaitHealth(t, r.health, "", tt.want)
				return
			}
			cfg, err := config.Parse([]byte(yaml))
			if err != nil {
				t.Fatal(err)
			}
			s, err := New(cfg, Options{}, logr.Discard())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s.shutdownTracing(context.Background()) })
			resp, err := s.ready.health.Check(context.Background(), &healthpb.HealthCheckRequest{})
			if err != nil || resp.GetStatus() != tt.want {
				t.Errorf("gRPC health = %v, %v; want %v", resp.GetStatus(), err, tt.want)
			}
			rec := httptest.NewRecorder()
			s.ready.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz?verbose", nil))
			if wantCode := map[bool]int{true: http.StatusOK, false: http.StatusServiceUnavailable}[tt.want == healthpb.HealthCheckResponse_SERVING]; rec.Code != wantCode {
				t.Errorf("/readyz = %d, want %d:\n%s", rec.Code, wantCode, rec.Body)
			}
		})
	}
}

// Under kv-sglang a request has no way around the prefill pool (SGLang's
// decode engines in PD mode serve only pairs): with no prefill endpoint to
// route to, every request is a 503, so the replica is not ready, as with no
// decode endpoint. Under the other connectors a request goes decode-only
// then, and the replica stays ready.
func TestReadinessNeedsThePrefillPoolWherePairsAreAllThatServe(t *testing.T) {
	prefill := func(healthy, checkedDown, awaits bool) []metrics.EndpointState {
		return []metrics.EndpointState{{Pool: "prefill", Endpoint: "10.0.0.1:8000", Healthy: healthy, CheckedDown: checkedDown, AwaitsCheck: awaits}}
	}
	tests := []struct {
		name      string
		connector string
		prefill   []metrics.EndpointState
		want      healthpb.HealthCheckResponse_ServingStatus
		wantLine  string // in /readyz?verbose
	}{
		{"kv-sglang, no prefill endpoint", "kv-sglang", nil, healthpb.HealthCheckResponse_NOT_SERVING,
			"[-]prefill pool: no healthy prefill endpoint (0 of 0 endpoints healthy)"},
		{"kv-sglang, every prefill endpoint checked down", "kv-sglang", prefill(false, true, false), healthpb.HealthCheckResponse_NOT_SERVING,
			"[-]prefill pool: no healthy prefill endpoint (0 of 1 endpoints healthy)"},
		{"kv-sglang, no prefill endpoint checked yet", "kv-sglang", prefill(true, false, true), healthpb.HealthCheckResponse_NOT_SERVING,
			"[-]prefill pool: no prefill endpoint has passed a health check yet"},
		// The paired prefill pool routes among endpoints failed requests eject, as the decode pool does.
		{"kv-sglang, every prefill endpoint ejected", "kv-sglang", prefill(false, false, false), healthpb.HealthCheckResponse_SERVING,
			"[+]prefill pool: every endpoint failed requests"},
		{"kv-sglang, a healthy prefill endpoint", "kv-sglang", prefill(true, false, false), healthpb.HealthCheckResponse_SERVING,
			"[+]prefill pool: 1 of 1 endpoints healthy"},
		{"kv-nixl, no prefill endpoint: decode-only", "kv-nixl", nil, healthpb.HealthCheckResponse_SERVING, "[+]decode pool"},
		{"kv-nixl, every prefill endpoint checked down", "kv-nixl", prefill(false, true, false), healthpb.HealthCheckResponse_SERVING, "[+]decode pool"},
		{"kv-mooncake, no prefill endpoint", "kv-mooncake", nil, healthpb.HealthCheckResponse_SERVING, "[+]decode pool"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			endpoints := func() []metrics.EndpointState {
				return append(slices.Clone(tt.prefill), metrics.EndpointState{Pool: "decode", Endpoint: decodeEP, Healthy: true})
			}
			r := start(t, fmt.Sprintf("connector: %s\npools: {decode: {endpoints: [%q]}}", tt.connector, decodeEP),
				Options{Endpoints: endpoints}, logr.Discard())
			for _, svc := range []string{"", extProcService, "readiness"} {
				resp, err := r.health.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
				if err != nil || resp.GetStatus() != tt.want {
					t.Errorf("Check(%q) = %v, %v; want %v", svc, resp.GetStatus(), err, tt.want)
				}
			}
			wantCode := map[bool]int{true: http.StatusOK, false: http.StatusServiceUnavailable}[tt.want == healthpb.HealthCheckResponse_SERVING]
			if code, body := r.get(t, "/readyz?verbose"); code != wantCode || !strings.Contains(body, tt.wantLine) {
				t.Errorf("/readyz?verbose = %d\n%s\nwant %d with %q", code, body, wantCode, tt.wantLine)
			}
		})
	}
}

// Active checks turned on by a reload leave a ready replica ready until
// they find something wrong with endpoints that were serving all along:
// those awaited their first check as at start, so readiness dipped
// (NOT_SERVING, /readyz 503) for a round with nothing wrong, taking every
// replica out at once; and a first check that went unanswered (one slow
// answer) took such an endpoint out at once, not after unhealthy_threshold
// of them. A check that finds the engine down still makes it unready. The
// test reads readiness itself while each check is held by the engine (the
// next check comes only once the one before was recorded); every
// transition is logged once ("not ready").
func TestReloadTurningChecksOnKeepsReadiness(t *testing.T) {
	tests := []struct {
		name   string
		checks []int // what the engine answers the checks in turn; 0: no answer, the connection broken
		want   healthpb.HealthCheckResponse_ServingStatus
	}{
		{"the first check passes", []int{http.StatusOK}, healthpb.HealthCheckResponse_SERVING},
		{"the first check finds the engine down", []int{http.StatusServiceUnavailable}, healthpb.HealthCheckResponse_NOT_SERVING},
		{"unanswered checks: down at the third", []int{0, 0, 0}, healthpb.HealthCheckResponse_NOT_SERVING},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checked, answer := make(chan struct{}), make(chan int)
			engine := enginetest.Start(t, func(w http.ResponseWriter, req *http.Request) {
				if req.URL.Path != "/health" {
					return // a scrape: 200
				}
				var code int
				select {
				case checked <- struct{}{}:
				case <-req.Context().Done():
					return
				}
				select {
				case code = <-answer:
				case <-req.Context().Done():
					return
				}
				if code != 0 {
					w.WriteHeader(code)
				} else if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
					// Something that is not HTTP, as a broken peer: Go's
					// client would resend a GET whose connection closed
					// with nothing read.
					conn.Write([]byte("broken\r\n\r\n"))
					conn.Close()
				}
			})
			path := filepath.Join(t.TempDir(), "extproc.yaml")
			yaml := func(health string) string {
				return fmt.Sprintf("connector: kv-nixl\npools: {decode: {endpoints: [%q], health: %s}}\n", engine.Addr(), health)
			}
			if err := os.WriteFile(path, []byte(yaml("{}")), 0o600); err != nil {
				t.Fatal(err)
			}
			logs := &logLines{}
			r := start(t, yaml("{}"), Options{ConfigPath: path, HealthInterval: time.Millisecond}, funcr.NewJSON(logs.add, funcr.Options{}))
			awaitHealth(t, r.health, "", healthpb.HealthCheckResponse_SERVING)
			if err := os.WriteFile(path, []byte(yaml("{check_interval: 10ms, unhealthy_threshold: 3}")), 0o600); err != nil {
				t.Fatal(err)
			}
			for i, code := range tt.checks {
				// Held by the engine, with the checks before it recorded: a
				// poll now is surely within the round.
				enginetest.Receive(t, checked, fmt.Sprintf("check %d never came", i+1))
				r.ready.update()
				if resp, err := r.health.Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil ||
					resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
					t.Errorf("gRPC health while check %d runs = %v, %v; want SERVING", i+1, resp.GetStatus(), err)
				}
				if code, body := r.get(t, "/readyz?verbose"); code != http.StatusOK {
					t.Errorf("/readyz?verbose while check %d runs = %d\n%s", i+1, code, body)
				}
				if n := notReadyLines(t, logs); n != 0 {
					t.Fatalf("%d %q lines by check %d, want none:\n%s", n, "not ready", i+1, logs.raw())
				}
				answer <- code
			}
			awaitHealth(t, r.health, "", tt.want)
		})
	}
}

func notReadyLines(t *testing.T, logs *logLines) int {
	t.Helper()
	n := 0
	for _, l := range logs.all(t) {
		if l["msg"] == "not ready" {
			n++
		}
	}
	return n
}
