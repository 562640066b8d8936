package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// TestMatrix sends real client requests through the Envoy emulator and checks,
// for every body mode × connector × stream × API the connector disaggregates,
// that the client got a correct answer and that the engines saw a KV handoff
// from the prefill endpoint the service chose to the decode endpoint it chose,
// with one request id on both legs. Each rig also checks the rest of the API
// table: pass-through paths reach a decode engine scrubbed, and everything
// else, the engines' admin endpoints first, gets extproc's 404.
func TestMatrix(t *testing.T) {
	apis := map[string][]string{
		"kv-nixl":           {"chat", "completions", "responses", "generate", "messages"},
		"kv-shared-storage": {"chat", "completions", "responses", "generate", "messages"},
		"kv-sglang":         {"chat", "completions", "sglang/generate"},
		"kv-mooncake":       {"chat", "completions", "responses", "generate", "messages"},
	}
	for _, mode := range []string{"full_duplex", "buffered"} {
		t.Run(mode, func(t *testing.T) {
			for _, connector := range []string{"kv-nixl", "kv-shared-storage", "kv-sglang", "kv-mooncake"} {
				t.Run(connector, func(t *testing.T) {
					r := startRig(t, rigOptions{mode: mode, connector: connector})
					for _, stream := range []string{"stream", "non-stream"} {
						for _, api := range apis[connector] {
							t.Run(stream+"/"+api, func(t *testing.T) {
								r.checkHandoff(t, stream == "stream", api, fmt.Sprintf("%s %s %s %s", mode, connector, stream, api))
							})
						}
					}
					t.Run("routes", func(t *testing.T) { r.checkRoutes(t, fmt.Sprintf("routes of %s %s", mode, connector)) })
				})
			}
		})
	}
}

// TestIPv6Engines: engines on IPv6 addresses, under each connector. The
// decode engine must reach the prefill engine's side channel, bootstrap
// server or file at the address the handoff names: an IPv6 bootstrap_host
// bracketed (SGLang joins host and port as they come), a NIXL remote_host
// that is no loopback the router would distrust, a Mooncake bootstrap
// address bracketed in its URL.
func TestIPv6Engines(t *testing.T) {
	if l, err := net.Listen("tcp", "[::1]:0"); err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	} else {
		l.Close()
	}
	for _, connector := range testbed.Connectors {
		t.Run(connector, func(t *testing.T) {
			r := startRig(t, rigOptions{connector: connector, ipv6: true, prefills: 1, decodes: 1})
			for _, stream := range []bool{false, true} {
				r.checkHandoff(t, stream, "chat", fmt.Sprintf("IPv6 %s %v", connector, stream))
			}
		})
	}
}

func (r *rig) checkHandoff(t *testing.T, stream bool, api, prompt string) {
	path, body := request(api, stream, prompt)
	resp, got := r.must(t, path, body, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	checkAnswer(t, api, stream, got)

	marker := markerOf(api, prompt)
	has := func(rec pdsim.Record) bool { return strings.Contains(string(rec.Body), marker) }
	prefill, pRec := served(t, r.prefill, has)
	decode, dRec := served(t, r.decode, has)
	if up := r.proxy.Upstreams(); up[len(up)-1] != decode.Addr() {
		t.Errorf("Envoy forwarded to %s, but the decode leg was served by %s", up[len(up)-1], decode.Addr())
	}
	if dRec.KV != "hit" || resp.Header.Get("x-pdsim-kv") != "hit" {
		t.Errorf("decode KV outcome %q (header %q), want a hit", dRec.KV, resp.Header.Get("x-pdsim-kv"))
	}
	var wantSource string
	switch r.connector {
	case "kv-nixl", "kv-mooncake":
		wantSource = prefill.KVAddr()
	case "kv-sglang":
		wantSource = prefill.BootstrapAddr()
	default:
		wantSource = pRec.KVSource // the prompt's file in the shared directory
	}
	if dRec.KVSource != wantSource {
		t.Errorf("decode pulled KV from %q, want the chosen prefill's %q", dRec.KVSource, wantSource)
	}
	if pRec.RequestID == "" || dRec.RequestID != pRec.RequestID || dRec.KVRequestID != pRec.RequestID {
		t.Errorf("request ids: prefill %q, decode %q, KV issued for %q; want one id", pRec.RequestID, dRec.RequestID, dRec.KVRequestID)
	}
}

func TestPrefillFailureFallsBackToDecodeOnly(t *testing.T) {
	r := startRig(t, rigOptions{})
	for _, p := range r.prefill {
		p.SetFaults(pdsim.Faults{FailStatus: http.StatusServiceUnavailable})
	}
	path, body := request("chat", false, "prefill is down")
	resp, got := r.must(t, path, body, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	checkCompletion(t, false, got)
	_, dRec := served(t, r.decode, func(rec pdsim.Record) bool { return strings.Contains(string(rec.Body), "prefill is down") })
	if dRec.KV != "none" || strings.Contains(string(dRec.Body), "kv_transfer_params") {
		t.Errorf("decode leg after a failed prefill: KV %q, body %s; want a plain request the engine recomputes", dRec.KV, dRec.Body)
	}
	attempts := 0
	for _, p := range r.prefill {
		attempts += len(p.Requests())
	}
	if attempts != 2 {
		t.Errorf("%d prefill attempts, want the first and one retry on the other endpoint", attempts)
	}
}

// TestDecodeEndpointDownIs503: a decode engine that refuses the connection
// gets the client Envoy's 503, worded as the client's API words errors: in
// OpenAI's JSON, and in Anthropic's on the Messages API (any query string
// included), overloaded_error being the type Anthropic gives a 503.
func TestDecodeEndpointDownIs503(t *testing.T) {
	dead := testbed.MustFreeAddr(t)
	r := startRig(t, rigOptions{decodeAddrs: func([]*pdsim.Server) []string { return []string{dead} }})
	path, body := request("chat", true, "decode is down")
	resp, got := r.must(t, path, body, nil)
	checkEnvoyError(t, resp, got, http.StatusServiceUnavailable, "upstream_error", "upstream connect error")

	path, body = request("messages", true, "decode is down, to Claude")
	resp, got = r.must(t, path+"?beta=true", body, nil)
	var e struct {
		Type  string
		Error struct{ Type, Message string }
	}
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Content-Type") != "application/json" ||
		json.Unmarshal([]byte(got), &e) != nil || e.Type != "error" || e.Error.Type != "overloaded_error" ||
		!strings.HasPrefix(e.Error.Message, "upstream connect error") {
		t.Errorf("%d %s %q, want Envoy's 503 in Anthropic's JSON, type overloaded_error", resp.StatusCode, resp.Header.Get("Content-Type"), got)
	}
}
