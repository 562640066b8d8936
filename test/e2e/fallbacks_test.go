package e2e

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// The fallback list (pools.decode.fallbacks) behind the emulator's gateway
// mode (docs/envoy.md §8.2): Envoy takes the list, goes down it on a refused
// connection or a 503, and tells pd-extproc which endpoint served.

// tried sends a request and returns its answer and the endpoints the
// gateway tried for it, in order.
func (r *rig) tried(t *testing.T, path, body string) (*http.Response, string, []string) {
	t.Helper()
	before := len(r.proxy.Upstreams())
	resp, got := r.must(t, path, body, nil)
	return resp, got, r.proxy.Upstreams()[before:]
}

// ejections is pd_extproc_endpoint_ejections_total of a decode endpoint.
func (r *rig) ejections(t *testing.T, addr string) float64 {
	t.Helper()
	return max(r.metric(t, fmt.Sprintf(`pd_extproc_endpoint_ejections_total{endpoint=%q,pool="decode"}`, addr)), 0)
}

// TestTheGatewayGoesDownTheFallbackList: a P/D request under kv-sglang or
// kv-mooncake is offered two decode endpoints. When the pick is down, or
// answers a 503, the fallback gets the same body, the prefill leg's transfer
// fields included (kv_transfer_params, SGLang's bootstrap_room), gets the KV,
// and its answer judges no decode endpoint: neither is ejected, though one
// failure ejects. Under kv-nixl the decode engine reads blocks the prefill
// engine frees once read, so its pick is offered alone: down, it meets Envoy's
// 503. When the pick answers a 500, the gateway says the pick served, and its
// answer ejects it.
func TestTheGatewayGoesDownTheFallbackList(t *testing.T) {
	tests := []struct {
		name      string
		connector string
		pick      func(*pdsim.Server) // what becomes of the pick, decode engine 0
		fallback  pdsim.Faults
		status    int
		tried     int     // endpoints tried: 1, the pick, or 2
		ejected   float64 // the pick's ejections
	}{
		{name: "the pick is down, kv-nixl: offered alone", pick: func(s *pdsim.Server) { s.Close() }, status: 503, tried: 1},
		{name: "the pick is down, kv-sglang", connector: "kv-sglang", pick: func(s *pdsim.Server) { s.Close() }, status: 200, tried: 2},
		{name: "the pick is down, kv-mooncake", connector: "kv-mooncake", pick: func(s *pdsim.Server) { s.Close() }, status: 200, tried: 2},
		{name: "the pick is down, the fallback fails", connector: "kv-mooncake", pick: func(s *pdsim.Server) { s.Close() },
			fallback: pdsim.Faults{FailStatus: 500}, status: 500, tried: 2},
		{name: "the pick answers a 503", connector: "kv-mooncake", pick: func(s *pdsim.Server) { s.SetFaults(pdsim.Faults{FailStatus: 503}) },
			status: 200, tried: 2},
		{name: "the pick answers a 500", pick: func(s *pdsim.Server) { s.SetFaults(pdsim.Faults{FailStatus: 500}) },
			status: 500, tried: 1, ejected: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{prefills: 1, connector: tt.connector, gatewayFallbacks: true,
				decodePool: "fallbacks: 1, policy: round-robin, health: {consecutive_failures: 1}"})
			pick, fallback := r.decodeAddrs[0], r.decodeAddrs[1]
			tt.pick(r.decode[0])
			r.decode[1].SetFaults(tt.fallback)
			marker := "[fallbacks " + tt.name + "]"
			path, body := request("chat", false, marker)
			resp, got, tried := r.tried(t, path, body)
			if resp.StatusCode != tt.status {
				t.Fatalf("status %d (%.300s), want %d", resp.StatusCode, got, tt.status)
			}
			if want := []string{pick, fallback}[:tt.tried]; !slices.Equal(tried, want) {
				t.Fatalf("the gateway tried %v, want %v (round-robin picks engine 0 first)", tried, want)
			}
			if tt.status == 200 {
				checkCompletion(t, false, got)
				field := `"kv_transfer_params"`
				if tt.connector == "kv-sglang" {
					field = `"bootstrap_room"`
				}
				prefill := recordsWith(r.prefill, marker)
				decode := recordsWith(r.decode[1:], marker)
				if len(prefill) != 1 || len(decode) != 1 || decode[0].KV != "hit" || decode[0].KVRequestID != prefill[0].RequestID ||
					!strings.Contains(string(decode[0].Body), field) {
					t.Errorf("the fallback's legs %d; want one with %s that pulled the prefill leg's KV", len(decode), field)
					for _, rec := range decode {
						t.Logf("KV %q of %q, body %s", rec.KV, rec.KVRequestID, rec.Body)
					}
				}
			}
			if got := r.ejections(t, pick); got != tt.ejected {
				t.Errorf("the pick's ejections %v, want %v", got, tt.ejected)
			}
			if got := r.ejections(t, fallback); got != 0 {
				t.Errorf("the fallback's ejections %v, want none: the pick's answer, if any, judges the pick alone", got)
			}
			if strings.Contains(r.extproc.Logs(), "did not pick") {
				t.Errorf("extproc says the gateway served from an endpoint it did not offer:\n%s", r.extproc.Logs())
			}
		})
	}
}

// TestTheServedEndpointDecidesWhoseCacheAnAnswerJudges: a conversation's
// later turns go decode-only to the engine that holds its history, with a
// fallback. When that engine serves them, having lost its cache, three such
// answers end its cache trust and the next turn goes P/D again. When it is
// down and the fallback serves them, from an empty cache, they say nothing
// of the pick: it stays trusted, and the turns stay decode-only.
func TestTheServedEndpointDecidesWhoseCacheAnAnswerJudges(t *testing.T) {
	tests := []struct {
		name     string
		down     bool      // the home engine is down from turn 3, and the fallback serves
		prefills []int     // prefill legs so far, after each turn
		trusted  []float64 // the home's cache trust after each turn
	}{
		{name: "the pick serves", prefills: []int{1, 1, 1, 1, 1, 2}, trusted: []float64{1, 1, 1, 1, 0, 0}},
		{name: "the fallback serves", down: true, prefills: []int{1, 1, 1, 1, 1, 1}, trusted: []float64{1, 1, 1, 1, 1, 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{prefills: 1, promptTokensDetails: true, gatewayFallbacks: true,
				decodePool: "fallbacks: 1, policy: prefix-affinity", extra: "pd: {min_uncached_tokens: 100}"})
			c := conversation{marker: "[served " + tt.name + "]"}
			home, other := -1, -1
			for i, want := range tt.prefills {
				turn := i + 1
				if turn >= 3 {
					if tt.down && turn == 3 {
						r.decode[home].Close()
					}
					r.decode[other].ResetPrefixCache()
					if !tt.down {
						r.decode[home].ResetPrefixCache()
					}
				}
				c.next(t, r)
				if turn == 1 {
					home = slices.Index(legsOn(r.decode, c.marker), 1)
					if home < 0 {
						t.Fatalf("turn 1: decode legs %v, want one", legsOn(r.decode, c.marker))
					}
					other = 1 - home
				}
				if n := sum(legsOn(r.prefill, c.marker)); n != want {
					t.Errorf("turn %d: %d prefill legs so far, want %d", turn, n, want)
				}
				series := fmt.Sprintf(`pd_extproc_endpoint_cache_trusted{endpoint=%q,pool="decode"}`, r.decodeAddrs[home])
				if got := r.metric(t, series); got != tt.trusted[i] {
					t.Errorf("turn %d: the home's pd_extproc_endpoint_cache_trusted = %v, want %v", turn, got, tt.trusted[i])
				}
			}
			if served := legsOn(r.decode, c.marker)[other]; tt.down && served != 4 {
				t.Errorf("the fallback served %d turns, want turns 3 to 6", served)
			}
		})
	}
}

// TestAStoredResponseIsOfferedItsPickAlone: a Responses request that
// pd-extproc gives a response id naming its decode engine (store: true, the
// default) is offered that engine alone, and meets Envoy's 503 when it is
// down; one with store: false is offered the fallback, which answers
// (kv-shared-storage: a kv-nixl pull is offered its pick alone in any case).
func TestAStoredResponseIsOfferedItsPickAlone(t *testing.T) {
	r := startRig(t, rigOptions{prefills: 1, connector: "kv-shared-storage", gatewayFallbacks: true, decodePool: "fallbacks: 1, policy: round-robin"})
	down, up := r.decodeAddrs[0], r.decodeAddrs[1]
	r.decode[0].Close()
	send := func(store, marker string) (int, []string) {
		t.Helper()
		resp, _, tried := r.tried(t, "/v1/responses", fmt.Sprintf(`{"model":"pdsim","input":%q,"max_output_tokens":4%s}`, marker, store))
		return resp.StatusCode, tried
	}
	// Round-robin: the first pick is the engine that is down, then the other.
	if status, tried := send(`,"store":false`, "[not stored]"); status != 200 || !slices.Equal(tried, []string{down, up}) {
		t.Errorf("store false: status %d, tried %v; want 200 from the fallback, after %s", status, tried, down)
	}
	if status, tried := send("", "[stored on the engine that is up]"); status != 200 || !slices.Equal(tried, []string{up}) {
		t.Errorf("stored, its pick up: status %d, tried %v; want 200 from %s alone", status, tried, up)
	}
	if status, tried := send(`,"store":true`, "[stored on the engine that is down]"); status != http.StatusServiceUnavailable || !slices.Equal(tried, []string{down}) {
		t.Errorf("stored, its pick down: status %d, tried %v; want Envoy's 503 from %s alone", status, tried, down)
	}
}
