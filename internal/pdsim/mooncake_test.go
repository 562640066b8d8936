package pdsim

import (
	"strings"
	"testing"
	"time"
)

// TestMooncakeHandoff: the prefill engine keeps a length-capped answer's
// blocks under the router's transfer_id and hands nothing back; the decode
// engine finds the engine it is told through the bootstrap server and pulls
// them, waiting for a prefill not finished yet; what vLLM's connector would
// not find, or would wait for in vain, fails the decode request. A one-token
// answer that stopped (Config.StopOneToken) is not length-capped either.
func TestMooncakeHandoff(t *testing.T) {
	const ask = `,"max_tokens":1,"min_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-1"}`
	tests := []struct {
		name          string
		prefill       string // the prefill leg's fields after messages
		decodeFirst   bool   // the decode leg goes out before the prefill leg, whose compute then takes 200 ms
		engineID      string // the decode leg's remote_engine_id; "" for the prefill engine's
		params        string // the decode leg's kv_transfer_params; "" for all of them
		prefillKV     string // x-pdsim-kv of each leg
		decodeKV      string
		decodeFailure string // in the decode's error
		stopOneToken  bool   // the prefill's Config.StopOneToken
	}{
		{name: "a transfer", prefill: ask, prefillKV: "issued", decodeKV: "hit"},
		{name: "the decode leg first", prefill: ask, decodeFirst: true, prefillKV: "issued", decodeKV: "hit"},
		{name: "no transfer_id: nothing kept", prefill: strings.Replace(ask, `,"transfer_id":"xfer-1"`, "", 1),
			prefillKV: "none", decodeKV: "load-failed", decodeFailure: "Timeout waiting for P side ready"},
		{name: "an answer its length did not cut: nothing kept", prefill: strings.Replace(ask, `"max_tokens":1,"min_tokens":1`, `"max_tokens":64`, 1),
			prefillKV: "none", decodeKV: "load-failed", decodeFailure: "Timeout waiting for P side ready"},
		{name: "a one-token answer that stopped: nothing kept", prefill: strings.Replace(ask, `,"min_tokens":1`, "", 1), stopOneToken: true,
			prefillKV: "none", decodeKV: "load-failed", decodeFailure: "Timeout waiting for P side ready"},
		{name: "min_tokens forbids the stop", prefill: ask, stopOneToken: true, prefillKV: "issued", decodeKV: "hit"},
		{name: "another engine", prefill: ask, engineID: "not-this-one", prefillKV: "issued", decodeKV: "load-failed",
			decodeFailure: "remote engine_id not-this-one not found from bootstrap server"},
		{name: "a key missing", prefill: ask, params: `{"do_remote_prefill":true,"transfer_id":"xfer-1"}`, prefillKV: "issued",
			decodeKV: "load-failed", decodeFailure: "without remote_engine_id"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Role: RolePrefill, Protocol: ProtocolMooncake, HandshakeTimeout: 300 * time.Millisecond, StopOneToken: tc.stopOneToken}
			if tc.decodeFirst {
				cfg.TTFT, cfg.HandshakeTimeout = 200*time.Millisecond, 10*time.Second
			}
			p := start(t, cfg)
			d := start(t, Config{Role: RoleDecode, Protocol: ProtocolMooncake})
			engineID := tc.engineID
			if engineID == "" {
				engineID = p.engineID
			}
			params := tc.params
			if params == "" {
				params = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_bootstrap_addr":"http://` + p.BootstrapAddr() +
					`","remote_engine_id":"` + engineID + `","transfer_id":"xfer-1"}`
			}
			decodeBody := chat("the quick brown fox", `,"kv_transfer_params":`+params)
			var decoded <-chan reply
			if tc.decodeFirst {
				decoded = goPost(d, "/v1/chat/completions", decodeBody, "req-D")
			}
			pr := post(t, p, "/v1/chat/completions", chat("the quick brown fox", tc.prefill), "req-P")
			if !tc.decodeFirst {
				decoded = goPost(d, "/v1/chat/completions", decodeBody, "req-D")
			}
			dr := <-decoded
			if got := pr.header.Get("x-pdsim-kv"); pr.status != 200 || got != tc.prefillKV || !strings.Contains(string(pr.body), `"kv_transfer_params":null`) {
				t.Errorf("prefill: %d, KV %q, %s; want 200, %q, kv_transfer_params null", pr.status, got, pr.body, tc.prefillKV)
			}
			if got := dr.header.Get("x-pdsim-kv"); got != tc.decodeKV || !strings.Contains(string(dr.body), tc.decodeFailure) {
				t.Errorf("decode: %d, KV %q, %.300s; want %q, %q", dr.status, got, dr.body, tc.decodeKV, tc.decodeFailure)
			}
			if tc.decodeKV == "hit" && (dr.status != 200 || dr.header.Get("x-pdsim-kv-source") != p.KVAddr() || dr.header.Get("x-pdsim-kv-request-id") != "req-P") {
				t.Errorf("decode: %d from %q for %q; want 200 from the prefill's worker %s, its request req-P",
					dr.status, dr.header.Get("x-pdsim-kv-source"), dr.header.Get("x-pdsim-kv-request-id"), p.KVAddr())
			}
		})
	}
}
