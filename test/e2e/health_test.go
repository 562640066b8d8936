package e2e

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// TestReadinessFollowsTheDecodePool checks what an operator sees with grpcurl
// and curl: NOT_SERVING and 503 while every decode endpoint is down, SERVING and
// 200 again once one is back.
func TestReadinessFollowsTheDecodePool(t *testing.T) {
	startDecode := func(addr string) *pdsim.Server {
		return testbed.MustStartSim(t, testbed.SimConfig{Role: pdsim.RoleDecode, Addr: addr, Log: logTo(t)})
	}
	decode := startDecode("")
	addr := decode.Addr()
	// Started, not ready: what readiness does is the test.
	x := startExtproc(t, testbed.ExtprocConfig{Wait: testbed.WaitStarted,
		Config: fmt.Sprintf(`{connector: kv-nixl, pools: {decode: {endpoints: [%q], health: {check_interval: 50ms, check_timeout: 1s}}}}`, addr)})

	readyz := func() int {
		resp, err := http.Get("http://" + x.AdminAddr + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	health := func() string {
		out := grpcurl(t, "", "-plaintext", "-d", `{"service":"envoy.service.ext_proc.v3.ExternalProcessor"}`, x.GRPCAddr, "grpc.health.v1.Health/Check")
		if strings.Contains(out, "NOT_SERVING") {
			return "NOT_SERVING"
		}
		return "SERVING"
	}
	// eventually waits, bounded, for the active checks and the readiness poll.
	eventually := func(want string, wantReady int) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for health() != want || readyz() != wantReady {
			if time.Now().After(deadline) {
				t.Fatalf("health %s, /readyz %d; want %s and %d\n%s", health(), readyz(), want, wantReady, x.Logs())
			}
			time.Sleep(50 * time.Millisecond) // the checks run on their own clock; bounded above
		}
	}

	eventually("SERVING", http.StatusOK)
	decode.Close()
	eventually("NOT_SERVING", http.StatusServiceUnavailable)
	startDecode(addr) // the engine comes back on the same address
	eventually("SERVING", http.StatusOK)
}

// TestFailedRequestsDoNotEmptyTheDecodePool: requests that make every decode
// engine answer 500 (a client's input, engines overloaded for a moment) eject
// every decode endpoint, yet the decode pool still routes among them, as
// Envoy's panic routing does, and extproc stays ready: the next request is
// served, rather than refused until the ejections end with every replica,
// which sees the same engines, unready and out of its Service meanwhile.
func TestFailedRequestsDoNotEmptyTheDecodePool(t *testing.T) {
	r := startRig(t, rigOptions{decodePool: "health: {consecutive_failures: 1, base_ejection: 1m}"})
	for _, d := range r.decode {
		d.SetFaults(pdsim.Faults{FailStatus: http.StatusInternalServerError})
	}
	for i := range 2 * len(r.decode) {
		path, body := request("chat", false, fmt.Sprintf("fails %d", i))
		r.must(t, path, body, nil)
	}
	for _, d := range r.decode {
		if v := r.metric(t, fmt.Sprintf(`pd_extproc_endpoint_healthy{endpoint=%q,pool="decode"}`, d.Addr())); v != 0 {
			t.Fatalf("decode endpoint %s healthy = %v after answering 500, want ejected", d.Addr(), v)
		}
		d.SetFaults(pdsim.Faults{})
	}
	resp, err := http.Get("http://" + r.extproc.AdminAddr + "/readyz?verbose") // its checks as they are now
	if err != nil {
		t.Fatal(err)
	}
	text, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(text), "[+]decode pool") {
		t.Errorf("/readyz?verbose with every decode endpoint ejected = %d %q, want ready: the pool routes among them", resp.StatusCode, text)
	}
	r.healthy(t, "with every decode endpoint ejected")
}

// TestReadinessFollowsThePrefillPoolUnderSGLang: with its only prefill
// engine gone, a kv-sglang replica answers every request 503 (SGLang's
// decode engines serve only pairs) and says so: /readyz 503 naming the
// prefill pool (pkg/server's tests read gRPC health, which follows it). A
// kv-nixl replica serves the request decode-only and stays ready.
func TestReadinessFollowsThePrefillPoolUnderSGLang(t *testing.T) {
	tests := []struct {
		connector  string
		wantStatus int // of /readyz and of a request
	}{
		{"kv-sglang", http.StatusServiceUnavailable},
		{"kv-nixl", http.StatusOK},
	}
	for _, tt := range tests {
		t.Run(tt.connector, func(t *testing.T) {
			checked := "health: {check_interval: 50ms, check_timeout: 1s}"
			r := startRig(t, rigOptions{connector: tt.connector, prefills: 1, decodes: 1, prefillPool: checked, decodePool: checked})
			r.prefill[0].Close()
			down := fmt.Sprintf(`pd_extproc_endpoint_healthy{endpoint=%q,pool="prefill"}`, r.prefill[0].Addr())
			readyz := func() (int, string) {
				resp, err := http.Get("http://" + r.extproc.AdminAddr + "/readyz?verbose")
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				return resp.StatusCode, string(b)
			}
			deadline := time.Now().Add(15 * time.Second)
			for code, body := readyz(); r.metric(t, down) != 0 || code != tt.wantStatus; code, body = readyz() {
				if time.Now().After(deadline) {
					t.Fatalf("/readyz = %d with the prefill engine gone, want %d:\n%s", code, tt.wantStatus, body)
				}
				time.Sleep(50 * time.Millisecond) // the checks and readiness run on their own clocks; bounded above
			}
			if _, body := readyz(); tt.wantStatus != http.StatusOK && !strings.Contains(body, "[-]prefill pool") {
				t.Errorf("/readyz?verbose does not name the prefill pool:\n%s", body)
			}
			path, body := request("chat", false, "the prefill engine is gone "+tt.connector)
			if resp, got := r.must(t, path, body, nil); resp.StatusCode != tt.wantStatus {
				t.Errorf("a request = %d (%.200s), want %d", resp.StatusCode, got, tt.wantStatus)
			}
		})
	}
}
