package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// holdingEngine is a decode engine that starts every streamed answer and
// holds it until released, so that a test can keep many generations open at
// once and choose when they end.
type holdingEngine struct {
	*httptest.Server
	addr    string
	arrived atomic.Int64
	release chan struct{}
}

func startHoldingEngine(t *testing.T) *holdingEngine {
	t.Helper()
	e := &holdingEngine{release: make(chan struct{})}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if poolQuestion(r) {
			http.NotFound(w, r)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		e.arrived.Add(1)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"text\":\"tok0\"}]}\n\n")
		http.NewResponseController(w).Flush()
		select {
		case <-e.release:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	e.addr = strings.TrimPrefix(e.URL, "http://")
	t.Cleanup(e.Close)
	return e
}

// withoutBreakers writes a copy of a shipped Envoy config whose named
// clusters have no circuit_breakers, so Envoy's defaults apply to them.
func withoutBreakers(t *testing.T, file string, clusters ...string) string {
	t.Helper()
	raw, err := os.ReadFile(testbed.MustRepoPath(t, file))
	if err != nil {
		t.Fatal(err)
	}
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		StaticResources struct {
			Clusters []map[string]any `json:"clusters"`
		} `json:"static_resources"`
	}
	var all map[string]any
	if json.Unmarshal(js, &doc) != nil || json.Unmarshal(js, &all) != nil {
		t.Fatal("not a bootstrap")
	}
	removed := 0
	for _, c := range doc.StaticResources.Clusters {
		for _, name := range clusters {
			if c["name"] == name && c["circuit_breakers"] != nil {
				delete(c, "circuit_breakers")
				removed++
			}
		}
	}
	if removed != len(clusters) {
		t.Fatalf("%s: removed the circuit breakers of %d clusters, want %d (%v)", file, removed, len(clusters), clusters)
	}
	all["static_resources"].(map[string]any)["clusters"] = doc.StaticResources.Clusters
	out, _ := json.Marshal(all)
	path := filepath.Join(t.TempDir(), filepath.Base(file))
	if err := os.WriteFile(path, out, 0o600); err != nil { // JSON is YAML
		t.Fatal(err)
	}
	return path
}

// TestCircuitBreakersHoldManyGenerations: with pd-extproc's own stream limit
// above the load, 1,500 generations open at once fail on Envoy's default
// circuit breakers, as Envoy answers (§12), and all complete on the shipped
// thresholds. Each generation is held by the engine until every request has
// either reached it, failed or been queued by Envoy.
func TestCircuitBreakersHoldManyGenerations(t *testing.T) {
	const load = 1500
	over := load - envoyemu.DefaultThresholds.MaxRequests
	envoyYAML := testbed.EnvoyConfigs["full_duplex"]
	tests := []struct {
		name       string
		config     string
		ok, failed int // 200s and 500s (the ext_proc filter failing closed)
		queued     uint64
	}{
		{name: "shipped thresholds", config: envoyYAML, ok: load},
		{name: "Envoy's defaults on both clusters", config: withoutBreakers(t, envoyYAML, "extproc", "pd_original_dst"),
			ok: load - over, failed: over},
		{name: "Envoy's defaults on the decode cluster", config: withoutBreakers(t, envoyYAML, "pd_original_dst"),
			ok: load, queued: uint64(over)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			engine := startHoldingEngine(t)
			mtls := testbed.MustNewMTLS(t, testbed.MTLSConfig{})
			x := startExtproc(t, testbed.ExtprocConfig{MTLS: mtls, Config: fmt.Sprintf(
				"connector: kv-nixl\npools:\n  prefill: {endpoints: []}\n  decode: {endpoints: [%q]}\npd: {mode: never}\nlimits: {max_concurrent_streams: %d}\n",
				engine.addr, load+500)})
			p := testbed.MustStartEnvoy(t, tc.config, x.GRPCAddr, mtls.Envoy)
			var ok, failed atomic.Int64
			var firstFailure sync.Once
			var wg sync.WaitGroup
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			for i := range load {
				wg.Go(func() {
					path, body := request("completions", true, fmt.Sprintf("generation %d", i))
					resp, got, err := testbed.Post(ctx, p.URL()+path, body, nil)
					if resp == nil {
						t.Errorf("request %d: %v", i, err)
						failed.Add(1)
						return
					}
					switch {
					case err == nil && resp.StatusCode == http.StatusOK && strings.HasSuffix(got, "data: [DONE]\n\n"):
						ok.Add(1)
					case resp.StatusCode == http.StatusInternalServerError &&
						resp.Header.Get(envoyemu.DetailsHeader) == "ext_proc_error_gRPC_error_14{upstream_connect_error_or_disconnect/reset_before_headers._reset_reason:_overflow}":
						failed.Add(1)
					default:
						failed.Add(1)
						firstFailure.Do(func() {
							t.Errorf("request %d: %d (%s) %q %v, want 200 or the ext_proc overflow 500",
								i, resp.StatusCode, resp.Header.Get(envoyemu.DetailsHeader), got, err)
						})
					}
				})
			}
			// Every request is now held by the engine, failed, or queued by Envoy.
			pending := func() int { return p.ClusterStats()["pd_original_dst"].RqPendingActive }
			deadline := time.Now().Add(time.Minute)
			for int(engine.arrived.Load())+int(failed.Load())+pending() < load && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond) // waiting on other processes' progress, bounded
			}
			close(engine.release)
			wg.Wait()
			if int(ok.Load()) != tc.ok || int(failed.Load()) != tc.failed {
				t.Errorf("%d completed and %d failed, want %d and %d", ok.Load(), failed.Load(), tc.ok, tc.failed)
			}
			stats := p.ClusterStats()
			if got := stats["extproc"].RqActiveOverflow; got != uint64(tc.failed) {
				t.Errorf("ext_proc cluster overflows = %d, want %d", got, tc.failed)
			}
			if got := stats["pd_original_dst"].RqPendingTotal; got != tc.queued {
				t.Errorf("decode requests queued by Envoy = %d, want %d", got, tc.queued)
			}
			if got := engine.arrived.Load(); got != int64(tc.ok) {
				t.Errorf("the engine saw %d requests, want %d: an overflowing request must not reach it", got, tc.ok)
			}
		})
	}
}
