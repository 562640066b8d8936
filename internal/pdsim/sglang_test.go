package pdsim

import (
	"net"
	"strings"
	"testing"
	"time"
)

// sglangBody is the one body a router sends to both legs.
func sglangBody(t *testing.T, p *Server, room, content string) string {
	host, port, err := net.SplitHostPort(p.BootstrapAddr())
	if err != nil {
		t.Fatal(err)
	}
	return chat(content, `,"stream":true,"max_tokens":4,"bootstrap_host":"`+host+`","bootstrap_port":`+port+`,"bootstrap_room":`+room)
}

func TestSGLangConcurrentLegs(t *testing.T) {
	tests := []struct {
		name         string
		prefillDelay time.Duration // makes the decode likely to arrive first; the outcome must not depend on it
	}{
		{"prefill first or together", 0},
		{"decode first", 50 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := start(t, Config{Role: RolePrefill, Protocol: ProtocolSGLang, Delay: tt.prefillDelay, HandshakeTimeout: 5 * time.Second})
			d := start(t, Config{Role: RoleDecode, Protocol: ProtocolSGLang, HandshakeTimeout: 5 * time.Second})
			body := sglangBody(t, p, "9223372036854775807", "hello sglang")

			prefilled := goPost(p, "/v1/chat/completions", body, "req-S")
			dr := post(t, d, "/v1/chat/completions", body, "req-S")
			pr := <-prefilled

			if dr.status != 200 || dr.header.Get("x-pdsim-kv") != kvHit || dr.header.Get("x-pdsim-kv-source") != p.BootstrapAddr() ||
				dr.header.Get("x-pdsim-kv-request-id") != "req-S" {
				t.Fatalf("decode %d %v %s", dr.status, dr.header, dr.body)
			}
			if data := events(t, dr.body); len(data) != 1+4+1 { // role, 4 tokens, [DONE]
				t.Errorf("decode stream %q", data)
			}
			if pr.status != 200 || pr.header.Get("x-pdsim-kv") != kvIssued || strings.Count(string(pr.body), "tok") != 1 {
				t.Errorf("prefill %d %v %s", pr.status, pr.header, pr.body)
			}
			if rec := d.Requests()[0]; rec.KV != kvHit || rec.KVSource != p.BootstrapAddr() || rec.KVRequestID != "req-S" {
				t.Errorf("decode record %+v", rec)
			}
		})
	}
}

func TestSGLangHandshakeFailures(t *testing.T) {
	const timeout = 100 * time.Millisecond
	tests := []struct {
		name string
		run  func(t *testing.T, p, d *Server) (prefill, decode reply)
	}{
		{"prefill awaited before the decode is sent", func(t *testing.T, p, d *Server) (reply, reply) {
			body := sglangBody(t, p, "42", "hello")
			pr := post(t, p, "/v1/chat/completions", body, "")
			return pr, post(t, d, "/v1/chat/completions", body, "")
		}},
		{"legs with different prompts in one room", func(t *testing.T, p, d *Server) (reply, reply) {
			prefilled := goPost(p, "/v1/chat/completions", sglangBody(t, p, "7", "hello"), "")
			dr := post(t, d, "/v1/chat/completions", sglangBody(t, p, "7", "goodbye"), "")
			return <-prefilled, dr
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := start(t, Config{Role: RolePrefill, Protocol: ProtocolSGLang, HandshakeTimeout: timeout})
			d := start(t, Config{Role: RoleDecode, Protocol: ProtocolSGLang, HandshakeTimeout: timeout})
			began := time.Now()
			pr, dr := tt.run(t, p, d)
			// Both streams have answered 200 already: SGLang ends them with an
			// error event, then [DONE].
			for leg, r := range map[string]reply{"prefill": pr, "decode": dr} {
				data := events(t, r.body)
				if r.status != 200 || r.header.Get("x-pdsim-kv") != kvLoadFailed || len(data) != 2 || data[1] != "[DONE]" ||
					!strings.HasPrefix(data[0], `{"error":{"object":"error","message":"`+map[string]string{"prefill": "Prefill bootstrap", "decode": "Decode transfer"}[leg]+` failed for request`) ||
					!strings.HasSuffix(data[0], `"type":"INTERNAL_SERVER_ERROR","param":null,"code":500}}`) {
					t.Errorf("%s: %d %v %s", leg, r.status, r.header, r.body)
				}
			}
			if time.Since(began) < timeout {
				t.Errorf("failed after %s, before the handshake timeout", time.Since(began))
			}
		})
	}
}

func TestSGLangBootstrapFields(t *testing.T) {
	tests := []struct {
		name, role, fields string
	}{
		{"room as a string", RoleDecode, `"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":"42"`},
		{"room as a UUID", RolePrefill, `"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":"5b0c7a9e-0000-4000-8000-000000000001"`},
		{"room as a float", RoleDecode, `"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":4.6e18`},
		{"room above 2^63-1", RoleDecode, `"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":9223372036854775808`},
		{"negative room", RolePrefill, `"bootstrap_room":-1`},
		{"no room", RolePrefill, `"bootstrap_host":"127.0.0.1"`},
		{"decode without host", RoleDecode, `"bootstrap_port":8998,"bootstrap_room":1`},
		{"port as a string", RoleDecode, `"bootstrap_host":"127.0.0.1","bootstrap_port":"8998","bootstrap_room":1`},
		{"fields inside kv_transfer_params, where SGLang never looks", RoleDecode, `"kv_transfer_params":{"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":1}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := start(t, Config{Role: tt.role, Protocol: ProtocolSGLang})
			r := post(t, s, "/v1/chat/completions", chat("x", ","+tt.fields), "")
			if r.status != 400 || !strings.Contains(r.json(t)["message"].(string), "bootstrap_") {
				t.Errorf("%d %s", r.status, r.body)
			}
		})
	}
}

// An SGLang engine reports its load under SGLang's names and labels, P/D
// queues included, and its KV pool's size and token counters as SGLang's
// scheduler and tokenizer manager do; a test sets the queues to stand for a
// busy engine.
func TestSGLangMetricsUseSGLangNames(t *testing.T) {
	s := start(t, Config{Role: RoleDecode, Protocol: ProtocolSGLang, KVBlocks: 1000})
	labels := `{engine_type="decode",model_name="pdsim",pp_rank="0",tp_rank="0"}`
	m := string(get(t, s, "/metrics").body)
	for _, want := range []string{"sglang:num_running_reqs" + labels + " 0", "sglang:num_queue_reqs" + labels + " 0", "sglang:token_usage" + labels + " 0",
		"sglang:num_prefill_bootstrap_queue_reqs" + labels + " 0", "sglang:num_decode_transfer_queue_reqs" + labels + " 0",
		"sglang:max_total_num_tokens" + labels + " 16000", `sglang:prompt_tokens_total{model_name="pdsim"} 0`,
		`sglang:cached_tokens_total{model_name="pdsim"} 0`, `sglang:generation_tokens_total{model_name="pdsim"} 0`} {
		if !strings.Contains(m, want+"\n") {
			t.Errorf("/metrics lacks %q:\n%s", want, m)
		}
	}
	if strings.Contains(m, "vllm:") {
		t.Errorf("an SGLang engine serves vLLM names:\n%s", m)
	}
	s.SetQueues(Queues{PrefillBootstrap: 1, PrefillInflight: 2, DecodePrealloc: 3, DecodeTransfer: 4})
	m = string(get(t, s, "/metrics").body)
	for name, v := range map[string]string{"num_prefill_bootstrap_queue_reqs": "1", "num_prefill_inflight_queue_reqs": "2",
		"num_decode_prealloc_queue_reqs": "3", "num_decode_transfer_queue_reqs": "4"} {
		if want := "sglang:" + name + labels + " " + v + "\n"; !strings.Contains(m, want) {
			t.Errorf("after SetQueues /metrics lacks %q", want)
		}
	}
}

// The decode side reaches the prefill engine's bootstrap server at
// host:port as SGLang joins them: an IPv6 host the router sent bracketed
// (as SGLang's own gateway and pd-extproc do) makes an address, an
// unbracketed one none.
func TestBootstrapSource(t *testing.T) {
	for host, want := range map[string]string{"10.0.0.1": "10.0.0.1:8998", "[fd00::1]": "[fd00::1]:8998", "fd00::1": "fd00::1:8998"} {
		if got := (bootstrapFields{host: host, port: 8998}).source(); got != want {
			t.Errorf("bootstrap_host %q: source %q, want %q", host, got, want)
		}
	}
}

// An SGLang server tells its disaggregation mode and its prefill's bootstrap
// port in its server info, under both of the names SGLang serves it; a vLLM
// server has none.
func TestSGLangServerInfo(t *testing.T) {
	p := start(t, Config{Role: RolePrefill, Protocol: ProtocolSGLang})
	_, port, _ := net.SplitHostPort(p.BootstrapAddr())
	tests := []struct {
		name       string
		s          *Server
		path       string
		wantStatus int
		want       []string
	}{
		{"prefill", p, "/server_info", 200, []string{`"disaggregation_mode":"prefill"`, `"disaggregation_bootstrap_port":` + port + `,`}},
		{"prefill, older name", p, "/get_server_info", 200, []string{`"disaggregation_bootstrap_port":` + port + `,`}},
		{"decode", start(t, Config{Role: RoleDecode, Protocol: ProtocolSGLang}), "/server_info", 200,
			[]string{`"disaggregation_mode":"decode"`, `"disaggregation_bootstrap_port":8998,`}},
		{"--api-key", start(t, Config{Role: RolePrefill, Protocol: ProtocolSGLang, RefuseServerInfo: true}), "/server_info", 401, []string{`"error":"Unauthorized"`}},
		{"vLLM", start(t, Config{Role: RolePrefill, Protocol: ProtocolNIXL}), "/server_info", 404, []string{`"detail":"Not Found"`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := get(t, tc.s, tc.path)
			if r.status != tc.wantStatus {
				t.Fatalf("status %d, want %d: %s", r.status, tc.wantStatus, r.body)
			}
			for _, w := range tc.want {
				if !strings.Contains(string(r.body), w) {
					t.Errorf("%s lacks %s", r.body, w)
				}
			}
		})
	}
}
