package pdsim

import (
	"encoding/json"
	"net"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

func nixlPair(t *testing.T) (prefill, decode *Server) {
	return start(t, Config{Role: RolePrefill, Protocol: ProtocolNIXL}),
		start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL})
}

func chat(content, extra string) string {
	return `{"model":"pdsim","messages":[{"role":"user","content":"` + content + `"}]` + extra + `}`
}

// prefillLeg sends what a router sends to a NIXL prefill and returns the
// kv_transfer_params exactly as the engine printed them.
func prefillLeg(t *testing.T, p *Server, content, requestID string) json.RawMessage {
	t.Helper()
	r := post(t, p, "/v1/chat/completions", chat(content, `,"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`), requestID)
	var resp struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		}
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(r.body, &resp); err != nil || r.status != 200 {
		t.Fatalf("prefill: %d %s", r.status, r.body)
	}
	if resp.Choices[0].FinishReason != "length" || r.header.Get("x-pdsim-kv") != "issued" {
		t.Errorf("prefill answer %s, kv header %q", r.body, r.header.Get("x-pdsim-kv"))
	}
	return resp.KV
}

func TestNIXLPrefillIssuesCurrentVLLMParams(t *testing.T) {
	p, _ := nixlPair(t)
	params := prefillLeg(t, p, "the quick brown fox", "req-A")

	keys := regexp.MustCompile(`"([a-z_]+)":`).FindAllStringSubmatch(string(params), -1)
	var order []string
	for _, k := range keys {
		order = append(order, k[1])
	}
	want := "do_remote_prefill do_remote_decode remote_block_ids remote_engine_id remote_request_id remote_host remote_port tp_size dcp_size pp_size remote_num_tokens remote_blocks_expiry_time transfer_mode"
	if strings.Join(order, " ") != want {
		t.Errorf("key order\n got %v\nwant %s", order, want)
	}
	var kv struct {
		DoRemotePrefill bool      `json:"do_remote_prefill"`
		DoRemoteDecode  bool      `json:"do_remote_decode"`
		BlockIDs        [][]int64 `json:"remote_block_ids"`
		RequestID       string    `json:"remote_request_id"`
		Host            string    `json:"remote_host"`
		Port            int       `json:"remote_port"`
		Expiry          *float64  `json:"remote_blocks_expiry_time"`
		Mode            string    `json:"transfer_mode"`
	}
	json.Unmarshal(params, &kv)
	host, port, _ := net.SplitHostPort(p.KVAddr())
	if !kv.DoRemotePrefill || kv.DoRemoteDecode || len(kv.BlockIDs) != 1 || len(kv.BlockIDs[0]) == 0 || kv.Expiry != nil ||
		kv.Mode != "pull" || kv.Host != host || strconv.Itoa(kv.Port) != port || p.KVAddr() == p.Addr() {
		t.Errorf("params %s (side channel %s)", params, p.KVAddr())
	}
	if !regexp.MustCompile(`^chatcmpl-req-A-[0-9a-f]{8}$`).MatchString(kv.RequestID) {
		t.Errorf("remote_request_id %q", kv.RequestID)
	}

	r := post(t, p, "/v1/completions", `{"prompt":"x","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}`, "req-B")
	if id := r.json(t)["kv_transfer_params"].(map[string]any)["remote_request_id"].(string); !strings.HasPrefix(id, "cmpl-req-B-") {
		t.Errorf("completions remote_request_id %q", id)
	}
}

func TestNIXLPrefillWithoutHandoff(t *testing.T) {
	p, _ := nixlPair(t)
	tests := []struct{ name, body string }{
		{"streamed: vLLM has no params field in chunks", chat("a b", `,"stream":true,"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}`)},
		{"no do_remote_decode", chat("a b", `,"max_tokens":1,"kv_transfer_params":{"do_remote_decode":false}`)},
		{"no params", chat("a b", `,"max_tokens":1`)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := post(t, p, "/v1/chat/completions", tt.body, "")
			if r.status != 200 || r.header.Get("x-pdsim-kv") != "none" {
				t.Fatalf("%d %v %s", r.status, r.header, r.body)
			}
			if strings.Contains(string(r.body), "remote_block_ids") {
				t.Errorf("params handed out: %s", r.body)
			}
		})
	}
}

func TestNIXLDecode(t *testing.T) {
	const prompt = "the quick brown fox"
	tests := []struct {
		name string
		// decodeBody builds the decode leg from the params the prefill issued for prompt.
		decodeBody func(t *testing.T, p, d *Server, params json.RawMessage) string
		status     int
		kv         string
	}{
		{"params passed on unchanged: KV read from the prefill", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			return chat(prompt, `,"stream":true,"kv_transfer_params":`+string(params))
		}, 200, kvHit},
		{"params of another request with another prompt", func(t *testing.T, p, d *Server, _ json.RawMessage) string {
			other := prefillLeg(t, p, "a different prompt", "req-other")
			return chat(prompt, `,"kv_transfer_params":`+string(other))
		}, 500, kvLoadFailed},
		{"params of another request, streamed: 200, then vLLM's error event", func(t *testing.T, p, d *Server, _ json.RawMessage) string {
			other := prefillLeg(t, p, "a different prompt", "req-other")
			return chat(prompt, `,"stream":true,"kv_transfer_params":`+string(other))
		}, 200, kvLoadFailed},
		{"right params, wrong prompt", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			return chat("the quick brown cat", `,"kv_transfer_params":`+string(params))
		}, 500, kvLoadFailed},
		// The template renders a request's tools and template variables into its prompt: a
		// decode leg that has lost them (or gained them) is another prompt.
		{"the decode leg with tools the prefill did not have", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			return chat(prompt, `,"tools":[{"type":"function","function":{"name":"f"}}],"kv_transfer_params":`+string(params))
		}, 500, kvLoadFailed},
		{"the decode leg with a template variable the prefill did not have", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			return chat(prompt, `,"chat_template_kwargs":{"enable_thinking":false},"kv_transfer_params":`+string(params))
		}, 500, kvLoadFailed},
		{"blocks already read", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			body := chat(prompt, `,"kv_transfer_params":`+string(params))
			if r := post(t, d, "/v1/chat/completions", body, ""); r.status != 200 {
				t.Fatalf("first decode: %d %s", r.status, r.body)
			}
			return body
		}, 500, kvLoadFailed},
		{"another engine id", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			return chat(prompt, `,"kv_transfer_params":`+edit(t, params, "remote_engine_id", "5b0c7a9e-0000-4000-8000-000000000001"))
		}, 500, kvLoadFailed},
		{"block ids flattened (pre-2026 shape)", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			var kv struct {
				IDs [][]int64 `json:"remote_block_ids"`
			}
			json.Unmarshal(params, &kv)
			return chat(prompt, `,"kv_transfer_params":`+edit(t, params, "remote_block_ids", kv.IDs[0]))
		}, 500, kvLoadFailed},
		{"unknown remote_request_id", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			return chat(prompt, `,"kv_transfer_params":`+edit(t, params, "remote_request_id", "chatcmpl-nope-00000000"))
		}, 500, kvLoadFailed},
		{"do_remote_prefill with empty block ids", func(t *testing.T, p, d *Server, _ json.RawMessage) string {
			return chat(prompt, `,"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[]}`)
		}, 500, kvLoadFailed},
		{"do_remote_prefill alone (what a confused router sends when P gave null)", func(t *testing.T, p, d *Server, _ json.RawMessage) string {
			return chat(prompt, `,"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false}`)
		}, 500, kvLoadFailed},
		{"remote_host null: the handshake fails", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			return chat(prompt, `,"kv_transfer_params":`+edit(t, params, "remote_host", json.RawMessage("null")))
		}, 500, kvLoadFailed},
		{"remote_port null: the handshake fails", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			return chat(prompt, `,"kv_transfer_params":`+edit(t, params, "remote_port", json.RawMessage("null")))
		}, 500, kvLoadFailed},
		{"remote_request_id missing: vLLM would wait for ever, pdsim fails it", func(t *testing.T, p, d *Server, params json.RawMessage) string {
			return chat(prompt, `,"kv_transfer_params":`+edit(t, params, "remote_request_id", nil))
		}, 500, kvLoadFailed},
		{"no params", func(t *testing.T, p, d *Server, _ json.RawMessage) string {
			return chat(prompt, "")
		}, 200, kvNone},
		{"params null", func(t *testing.T, p, d *Server, _ json.RawMessage) string {
			return chat(prompt, `,"kv_transfer_params":null`)
		}, 200, kvNone},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := nixlPair(t)
			params := prefillLeg(t, p, prompt, "req-A")
			r := post(t, d, "/v1/chat/completions", tt.decodeBody(t, p, d, params), "req-A")
			if r.status != tt.status || r.header.Get("x-pdsim-kv") != tt.kv {
				t.Fatalf("status %d kv %q, want %d %q: %s", r.status, r.header.Get("x-pdsim-kv"), tt.status, tt.kv, r.body)
			}
			recs := d.Requests()
			last := recs[len(recs)-1]
			if last.KV != tt.kv || last.Status != tt.status {
				t.Errorf("record %+v", last)
			}
			if tt.status == 500 && r.json(t)["error"].(map[string]any)["type"] != "InternalServerError" {
				t.Errorf("error body %s", r.body)
			}
			if tt.status == 200 && tt.kv == kvLoadFailed {
				data := events(t, r.body)
				if len(data) != 3 || !strings.Contains(data[0], `"delta":{"role":"assistant","content":""}`) || data[2] != "[DONE]" ||
					data[1] != `{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}` {
					t.Errorf("stream %q", data)
				}
			}
			if tt.kv != kvHit {
				return
			}
			if last.KVSource != p.KVAddr() || last.KVRequestID != "req-A" ||
				r.header.Get("x-pdsim-kv-source") != p.KVAddr() || r.header.Get("x-pdsim-kv-request-id") != "req-A" {
				t.Errorf("hit from %q (%q), want %q req-A; headers %v", last.KVSource, last.KVRequestID, p.KVAddr(), r.header)
			}
			if data := events(t, r.body); data[len(data)-1] != "[DONE]" {
				t.Errorf("decode stream %s", r.body)
			}
		})
	}
}

// edit sets (or with nil, removes) one key of a params object.
func edit(t *testing.T, params json.RawMessage, key string, value any) string {
	t.Helper()
	var m map[string]any
	if err := decodeNumbers(params, &m); err != nil {
		t.Fatal(err)
	}
	if value == nil {
		delete(m, key)
	} else {
		m[key] = value
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// With --enable-prompt-tokens-details vLLM reports the prompt tokens found
// cached: the full blocks of a prompt it computed before (never the last
// token), and, on a decode that loaded the prompt's KV from the prefill
// engine, the whole prompt; and, as most releases, no details at all when
// nothing was cached.
func TestCachedTokensAsVLLMReportsThem(t *testing.T) {
	prompt := strings.TrimSpace(strings.Repeat("word ", 40)) // 41 tokens with the role
	cached := func(t *testing.T, r reply) any {
		t.Helper()
		u, _ := r.json(t)["usage"].(map[string]any)
		if d, ok := u["prompt_tokens_details"].(map[string]any); ok {
			return d["cached_tokens"]
		}
		return nil
	}
	p := start(t, Config{Role: RolePrefill, Protocol: ProtocolNIXL, PromptTokensDetails: true})
	d := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL, PromptTokensDetails: true})
	leg := `,"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}`

	first := post(t, p, "/v1/chat/completions", chat(prompt, leg), "req-1")
	second := post(t, p, "/v1/chat/completions", chat(prompt, leg), "req-2")
	if cached(t, first) != nil || cached(t, second) != 32.0 {
		t.Errorf("prefill cached_tokens %v, then %v; want no details for a new prompt, then its full blocks (32 of 41)", cached(t, first), cached(t, second))
	}
	params := second.json(t)["kv_transfer_params"]
	b, _ := json.Marshal(params)
	pulled := post(t, d, "/v1/chat/completions", chat(prompt, `,"kv_transfer_params":`+string(b)), "req-2")
	if pulled.header.Get("x-pdsim-kv") != kvHit || cached(t, pulled) != 41.0 {
		t.Errorf("decode with the prefill's KV: kv %q, cached_tokens %v; want a hit and all 41 prompt tokens", pulled.header.Get("x-pdsim-kv"), cached(t, pulled))
	}
	if r := post(t, d, "/v1/chat/completions", chat("a prompt never seen", ""), ""); cached(t, r) != nil {
		t.Errorf("decode computing a new prompt: cached_tokens %v, want no details", cached(t, r))
	}

	plain := start(t, Config{Role: RolePrefill, Protocol: ProtocolNIXL})
	if r := post(t, plain, "/v1/chat/completions", chat(prompt, leg), ""); strings.Contains(string(r.body), "prompt_tokens_details") {
		t.Errorf("without the option the usage has details: %s", r.body)
	}
}

// A decode leg that keeps do_remote_decode true (a router that forgot to
// turn it off) is, to vLLM's connector, a prefill too: the engine holds its
// blocks for a lease and its answer carries kv_transfer_params, which the
// client then sees.
func TestNIXLDecodeLegLeftAsAPrefill(t *testing.T) {
	const prompt = "the quick brown fox"
	for _, tt := range []struct {
		flag       string
		wantParams bool
	}{{"false", false}, {"true", true}} {
		t.Run("do_remote_decode "+tt.flag, func(t *testing.T) {
			p, d := nixlPair(t)
			params := edit(t, prefillLeg(t, p, prompt, "req-A"), "do_remote_decode", json.RawMessage(tt.flag))
			r := post(t, d, "/v1/chat/completions", chat(prompt, `,"kv_transfer_params":`+params), "req-A")
			if r.status != 200 || r.header.Get("x-pdsim-kv") != kvHit {
				t.Fatalf("status %d kv %q: %s", r.status, r.header.Get("x-pdsim-kv"), r.body)
			}
			if got := r.json(t)["kv_transfer_params"] != nil; got != tt.wantParams {
				t.Errorf("the answer carries kv_transfer_params: %v, want %v (%s)", got, tt.wantParams, r.body)
			}
		})
	}
}
