package e2e

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// Engines started with --api-key ask for their key on every path but their
// health and metrics ones. With prefill.api_key_file and
// pools.decode.api_key_file, pd-extproc's own requests (prefill legs, model
// lists, SGLang's server info) and the decode leg carry the key in place of
// the client's, and the client's request is served whatever key it sent the
// gateway. Without them the client's Authorization reaches the engines, as
// before: the engines' key is served, another is refused as the engine
// refuses it.
func TestEnginesThatAskForAKeyGetIt(t *testing.T) {
	const engineKey = "sk-engine"
	file := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(file, []byte(engineKey+"\n"), 0o600); err != nil { // as a Secret's volume holds it
		t.Fatal(err)
	}
	keyed := fmt.Sprintf("api_key_file: %q", file)
	tests := []struct {
		name, connector string
		mode            string // Envoy's processing mode; default full_duplex
		keys            bool
		clientKey       string
		want            int
	}{
		{"keys given", "kv-nixl", "", true, "Bearer client-key", http.StatusOK},
		{"keys given, BUFFERED", "kv-nixl", "buffered", true, "Bearer client-key", http.StatusOK},
		{"keys given, no client key", "kv-nixl", "", true, "", http.StatusOK},
		{"keys given", "kv-sglang", "", true, "Bearer client-key", http.StatusOK},
		{"no keys, the client sends the engines'", "kv-nixl", "", false, "Bearer " + engineKey, http.StatusOK},
		{"no keys, the client sends another", "kv-nixl", "", false, "Bearer client-key", http.StatusUnauthorized},
	}
	for _, tc := range tests {
		t.Run(tc.connector+", "+tc.name, func(t *testing.T) {
			o := rigOptions{connector: tc.connector, mode: tc.mode, apiKey: engineKey}
			if tc.keys {
				o.extra, o.decodePool = "prefill: {"+keyed+"}", keyed
			}
			r := startRig(t, o)
			if tc.keys { // each engine's model list was read with the key
				for pool, sims := range map[string][]string{"prefill": testbed.Addrs(r.prefill), "decode": testbed.Addrs(r.decode)} {
					for _, addr := range sims {
						series := fmt.Sprintf(`pd_extproc_endpoint_models{endpoint=%q,pool=%q}`, addr, pool)
						waitFor(t, 10*time.Second, "the models of "+addr, func() bool { return r.extproc.MustMetric(t, series) == 1 })
					}
				}
			}
			header := http.Header{}
			if tc.clientKey != "" {
				header.Set("Authorization", tc.clientKey)
			}
			resp, got := r.must(t, "/v1/chat/completions", `{"model":"pdsim","max_tokens":4,"messages":[{"role":"user","content":"who holds the key?"}]}`, header)
			if resp.StatusCode != tc.want {
				t.Fatalf("status %d, want %d: %.300s", resp.StatusCode, tc.want, got)
			}
			switch {
			case tc.want == http.StatusOK && resp.Header.Get("x-pdsim-kv") != "hit":
				t.Errorf("KV %q, want a hit: both legs served", resp.Header.Get("x-pdsim-kv"))
			case tc.want == http.StatusUnauthorized && strings.TrimSpace(got) != `{"error":"Unauthorized"}`:
				t.Errorf("body %s, want the engine's refusal", got)
			}
			if !tc.keys {
				return
			}
			if resp, got := r.get(t, "/v1/models"); resp.StatusCode != http.StatusOK || !strings.Contains(got, `"id":"pdsim"`) {
				t.Errorf("GET /v1/models: %d %.300s, want the decode engine's list", resp.StatusCode, got)
			}
		})
	}
}
