package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// TestRolloutDropsNoRequest stops one of two extproc replicas as Kubernetes
// stops a pod in a rollout: the pod leaves the Envoy's cluster (its Service's
// endpoints, then DNS or EDS) during its preStop sleep, then gets SIGTERM.
// The generations streaming through it, whose ext_proc streams last as long
// (the response path is processed), must finish whole; the requests sent
// meanwhile go to the other replica; and the stopping replica exits once its
// streams have ended, before --shutdown-grace runs out. (A replica still in
// the rotation once it stopped listening fails its share of the requests with
// 500: hence the chart's preStop sleep, longer than DNS takes to drop it.)
func TestRolloutDropsNoRequest(t *testing.T) {
	const tokens = 1500 // a millisecond each: the streams outlast the stop
	r := startRig(t, rigOptions{replicas: 2, outputTokens: tokens})
	leaving := r.replicas[0]

	// Four streams, two on each replica (the emulator takes them in turn),
	// each until its first bytes have come back.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var streams []*http.Response
	for i := range 4 {
		path, body := request("chat", true, fmt.Sprintf("rollout stream %d", i))
		body = strings.Replace(body, `"max_tokens":4`, fmt.Sprintf(`"max_tokens":%d`, tokens), 1)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.proxy.URL()+path, strings.NewReader(body))
		resp, err := testbed.Client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("stream %d: status %d", i, resp.StatusCode)
		}
		if _, err := io.ReadFull(resp.Body, make([]byte, 1)); err != nil {
			t.Fatalf("stream %d: no first byte: %v", i, err)
		}
		streams = append(streams, resp)
	}

	if n := leaving.MustMetric(t, "pd_extproc_streams_in_flight"); n != 2 {
		t.Fatalf("the replica to stop holds %v streams, want 2", n)
	}
	if err := r.proxy.RemoveExtProcEndpoint(leaving.GRPCAddr); err != nil {
		t.Fatal(err)
	}
	stopped := make(chan struct{})
	go func() { leaving.Stop(); close(stopped) }() // SIGTERM
	waitFor(t, 10*time.Second, "the stopping replica to turn not ready", func() bool {
		resp, err := http.Get("http://" + leaving.AdminAddr + "/readyz")
		if err != nil {
			return true
		}
		resp.Body.Close()
		return resp.StatusCode != http.StatusOK
	})

	for i := range 6 {
		path, body := request("chat", false, fmt.Sprintf("rollout during %d", i))
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
			t.Errorf("a request during the stop: status %d (%.200s), want 200 from the other replica", resp.StatusCode, got)
		}
	}
	for i, resp := range streams {
		rest, err := io.ReadAll(resp.Body)
		if err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
			t.Errorf("stream %d was cut by the stop: read %d more bytes, then %v; ends %q", i, len(rest), err, rest[max(0, len(rest)-40):])
		}
	}
	select {
	case <-stopped:
	case <-time.After(20 * time.Second):
		t.Fatal("the stopping replica did not exit once its streams had ended")
	}
	if logs := leaving.Logs(); !strings.Contains(logs, "shutting down") || strings.Contains(logs, "grace period over") {
		t.Errorf("the stopping replica did not drain within its grace:\n%s", logs)
	}
}
