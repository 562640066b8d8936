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
