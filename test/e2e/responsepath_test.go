package e2e

import (
	"bufio"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// With the response path processed (envoy.yaml) a generation holds its
// ext_proc stream, a slot of limits.max_concurrent_streams, until its last
// token; with it skipped (envoy-no-response.yaml) Envoy ends the stream once
// the request is routed, and the tokens keep coming, through Envoy alone.
func TestResponsePathHoldsTheStreamForTheGeneration(t *testing.T) {
	for _, tc := range []struct {
		mode string
		held float64 // pd_extproc_streams_in_flight while the generation streams
	}{{"full_duplex", 1}, {"no_response", 0}} {
		t.Run(tc.mode, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: tc.mode, prefills: 1, decodes: 1, outputTokens: 100000, maxModelLen: 200000})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			body := `{"model":"pdsim","messages":[{"role":"user","content":"a long generation"}],"stream":true,"max_tokens":100000}`
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.proxy.URL()+"/v1/chat/completions", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := testbed.Client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK || resp.Header.Get("x-pdsim-kv") != "hit" {
				t.Fatalf("status %d, x-pdsim-kv %q: want a P/D generation", resp.StatusCode, resp.Header.Get("x-pdsim-kv"))
			}
			events := bufio.NewScanner(resp.Body)
			next := func() {
				t.Helper()
				for events.Scan() {
					if strings.HasPrefix(events.Text(), "data: ") {
						return
					}
				}
				t.Fatalf("the generation ended early: %v", events.Err())
			}
			next()
			waitFor(t, 10*time.Second, "the streams in flight to settle", func() bool {
				return r.metric(t, "pd_extproc_streams_in_flight") == tc.held
			})
			for range 20 {
				next() // tokens still streaming
			}
			if got := r.metric(t, "pd_extproc_streams_in_flight"); got != tc.held {
				t.Errorf("streams in flight %v while the generation streams, want %v", got, tc.held)
			}
		})
	}
}
