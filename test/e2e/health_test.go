package e2e

import (
	"fmt"
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
