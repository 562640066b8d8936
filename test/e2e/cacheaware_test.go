package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// TestLaterTurnsSkipThePrefillLeg: a conversation's first turn is P/D; its
// later turns, whose new part is below pd.min_uncached_tokens, go
// decode-only to the decode endpoint that holds the history (cached_prefix),
// which reports the hit. So on one replica and with the turns spread over
// three, with Envoy's response path and without. kv-sglang's decode engines
// cannot prefill, and a bound below the new part keeps P/D.
func TestLaterTurnsSkipThePrefillLeg(t *testing.T) {
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	// About 1,500 characters of history before the turns (375 tokens to the
	// router, at 4 characters each; 262 to the simulator, a token a word),
	// and each turn's new part (the reply, then the question) some 18
	// tokens to the router.
	system := strings.Repeat("You answer as a careful assistant would. ", 36)
	const turns = 3
	tests := []struct {
		name, mode, connector string
		replicas              int
		pd                    string // extproc's pd keys
		decodeOnly            bool   // turns 2 and 3
	}{
		{name: "one replica", mode: "full_duplex", replicas: 1, pd: "{min_uncached_tokens: 100}", decodeOnly: true},
		{name: "three replicas", mode: "full_duplex", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true},
		{name: "without the response path", mode: "no_response", replicas: 1, pd: "{min_uncached_tokens: 100}", decodeOnly: true},
		{name: "three replicas without the response path", mode: "no_response", replicas: 3, pd: "{min_uncached_tokens: 100}", decodeOnly: true},
		{name: "a bound below the new part", mode: "full_duplex", replicas: 1, pd: "{min_uncached_tokens: 10}"},
		{name: "kv-sglang", mode: "full_duplex", connector: "kv-sglang", replicas: 1, pd: "{}"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: tt.mode, connector: tt.connector, replicas: tt.replicas, decodes: 3,
				promptTokensDetails: true, decodePool: "policy: prefix-affinity", prefillPool: "policy: prefix-affinity",
				extra: "pd: " + tt.pd})
			marker := "[conversation " + tt.name + "]"
			history := []message{{"system", system}, {"user", marker + " What is a prefix cache?"}}
			home := -1
			for turn := 1; turn <= turns; turn++ {
				if turn > 1 {
					history = append(history, message{"assistant", "It keeps the KV of prompts seen."},
						message{"user", fmt.Sprintf("Question %d: and then?", turn)})
				}
				b, err := json.Marshal(map[string]any{"model": "pdsim", "max_tokens": 4, "messages": history})
				if err != nil {
					t.Fatal(err)
				}
				resp, got := r.must(t, "/v1/chat/completions", string(b), nil)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("turn %d: status %d: %s", turn, resp.StatusCode, got)
				}
				decode := legsOn(r.decode, marker)
				if turn == 1 {
					for i, n := range decode {
						if n == 1 {
							home = i
						}
					}
				}
				if home < 0 || decode[home] != turn {
					t.Fatalf("turn %d: decode legs per endpoint %v; want all %d on one", turn, decode, turn)
				}
				wantPrefill := turn
				if tt.decodeOnly {
					wantPrefill = 1
				}
				if n := sum(legsOn(r.prefill, marker)); n != wantPrefill {
					t.Errorf("turn %d: %d prefill legs in all, want %d", turn, n, wantPrefill)
				}
				cached, _ := strconv.Atoi(resp.Header.Get("x-pdsim-cached-tokens"))
				if turn > 1 && tt.decodeOnly && cached < 256 { // turn 1's full blocks
					t.Errorf("turn %d: the decode engine reports %d cached tokens (x-pdsim-cached-tokens %q), want the history's",
						turn, cached, resp.Header.Get("x-pdsim-cached-tokens"))
				}
			}
			wantCached := 0.0
			if tt.decodeOnly {
				wantCached = turns - 1
			}
			var decided float64
			for _, x := range r.replicas {
				n, err := x.Metric(t.Context(), `pd_extproc_pd_decisions_total{reason="cached_prefix"}`)
				if err != nil {
					t.Fatal(err)
				}
				decided += max(n, 0)
			}
			if decided != wantCached {
				t.Errorf("pd_decisions_total{reason=cached_prefix} summed over the replicas = %v, want %v", decided, wantCached)
			}
		})
	}
}

func sum(counts []int) int {
	n := 0
	for _, c := range counts {
		n += c
	}
	return n
}
