package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestRolloutDropsNoRequest stops one of two extproc replicas as Kubernetes
// stops a pod in a rollout: the pod leaves the Envoy's cluster (its Service's
// endpoints, then DNS or EDS) during its preStop sleep, then gets SIGTERM.
// The generations streaming through it, whose ext_proc streams last as long
// (the response path is processed), must finish whole; the requests sent
// meanwhile go to the other replica; and the stopping replica exits cleanly
// once its streams have ended, well before --shutdown-grace runs out. Left in
// the rotation, as an Envoy would leave it while DNS still lists the pod, it
// fails its share of those requests with 500: hence the chart's preStop sleep,
// or outside Kubernetes --shutdown-delay, which serves them until Envoy's
// health checks take the replica out (the emulator has none: a second
// SIGTERM ends the delay here).
func TestRolloutDropsNoRequest(t *testing.T) {
	for _, tt := range []struct {
		name     string
		leaves   bool     // the replica leaves the rotation before SIGTERM
		args     []string // the replicas' flags
		wantFail bool     // some requests sent while it stops fail
	}{
		{name: "left the rotation", leaves: true},
		{name: "still in the rotation", wantFail: true},
		{name: "still in the rotation, with --shutdown-delay", args: []string{"--shutdown-delay=1h"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			const tokens = 1500 // a millisecond each: the streams outlast the stop
			r := startRig(t, rigOptions{replicas: 2, outputTokens: tokens, args: tt.args})
			leaving := r.replicas[0]

			// Four streams, two on each replica (the emulator takes them in turn),
			// each until its first bytes have come back.
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var streams []*http.Response
			for i := range 4 {
				path, body := request("chat", true, fmt.Sprintf("rollout stream %d", i))
				body = strings.Replace(body, `"max_tokens":4`, fmt.Sprintf(`"max_tokens":%d`, tokens), 1)
				streams = append(streams, r.stream(t, ctx, path, body))
			}
			if n := leaving.MustMetric(t, "pd_extproc_streams_in_flight"); n != 2 {
				t.Fatalf("the replica to stop holds %v streams, want 2", n)
			}

			if tt.leaves {
				if err := r.proxy.RemoveExtProcEndpoint(leaving.GRPCAddr); err != nil {
					t.Fatal(err)
				}
			}
			if err := leaving.Signal(syscall.SIGTERM); err != nil { // the kubelet's, after the preStop sleep
				t.Fatal(err)
			}
			waitFor(t, 10*time.Second, "the stopping replica to turn not ready", func() bool {
				resp, err := http.Get("http://" + leaving.AdminAddr + "/readyz")
				if err != nil {
					return true
				}
				resp.Body.Close()
				return resp.StatusCode != http.StatusOK
			})

			failed := 0
			for i := range 6 {
				path, body := request("chat", false, fmt.Sprintf("rollout during %d", i))
				if resp, _ := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
					failed++
				}
			}
			if (failed > 0) != tt.wantFail {
				t.Errorf("%d of 6 requests sent while the replica stopped failed; want failures: %v", failed, tt.wantFail)
			}
			if tt.args != nil {
				if err := leaving.Signal(syscall.SIGTERM); err != nil { // an operator's second: the delay ends
					t.Fatal(err)
				}
			}
			for i, resp := range streams {
				rest, err := io.ReadAll(resp.Body)
				if err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
					t.Errorf("stream %d was cut by the stop: read %d more bytes, then %v; ends %q", i, len(rest), err, rest[max(0, len(rest)-40):])
				}
			}
			select {
			case <-leaving.Exited():
			case <-time.After(8 * time.Second): // below the testbed's own kill after 10 s
				t.Fatal("the stopping replica did not exit once its streams had ended")
			}
			if code := leaving.ExitCode(); code != 0 || strings.Contains(leaving.Logs(), "grace period over") {
				t.Errorf("the stopping replica exited with %d; want 0, its streams drained within the grace:\n%s", code, leaving.Logs())
			}
		})
	}
}

// SIGHUP asks a daemon to read its config again. Go's default for it is to
// exit, and extproc did, cutting the generations streaming through it; it
// now reads --config and serves on.
func TestSIGHUPReadsTheConfigAndServesOn(t *testing.T) {
	const tokens = 1500 // a millisecond each: the stream outlasts the signal
	r := startRig(t, rigOptions{outputTokens: tokens})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	path, body := request("chat", true, "streaming through SIGHUP")
	body = strings.Replace(body, `"max_tokens":4`, fmt.Sprintf(`"max_tokens":%d`, tokens), 1)
	stream := r.stream(t, ctx, path, body)

	if err := r.extproc.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	r.extproc.waitLog(t, "SIGHUP: reading the config file again")
	if rest, err := io.ReadAll(stream.Body); err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Errorf("the stream was cut by SIGHUP: read %d more bytes, then %v", len(rest), err)
	}
	path, body = request("chat", false, "after SIGHUP")
	if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
		t.Errorf("a request after SIGHUP = %d %.200s, want 200", resp.StatusCode, got)
	}
	select {
	case <-r.extproc.Exited():
		t.Errorf("extproc exited on SIGHUP with %d", r.extproc.ExitCode())
	default:
	}
}
