package pdsim

import (
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// nixlAsk is what a router asks a NIXL prefill for.
const nixlAsk = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// kvOf reads the top-level kv_transfer_params of a non-streamed answer.
func kvOf(t *testing.T, r reply) json.RawMessage {
	t.Helper()
	var a struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(r.body, &a); err != nil || r.status != 200 {
		t.Fatalf("answer %d %s", r.status, r.body)
	}
	return a.KV
}

// Each vLLM API hands the KV over where vLLM reads and writes it: the
// Responses API at the top level both ways, the token-in generate API in
// sampling_params.extra_args going in and at the top level coming back.
func TestVLLMAPIsHandOffKV(t *testing.T) {
	tests := []struct {
		name, path      string
		prefill, decode func(kv string) string
		streamed        string // in the streamed decode answer
	}{
		{
			name: "responses", path: "/v1/responses",
			prefill: func(kv string) string {
				return `{"input":"the quick brown fox","max_output_tokens":1,"stream":false,"store":false,"kv_transfer_params":` + kv + `}`
			},
			decode: func(kv string) string {
				return `{"input":"the quick brown fox","stream":true,"kv_transfer_params":` + kv + `}`
			},
			streamed: "event: response.completed\ndata: ",
		},
		{
			name: "generate", path: "/inference/v1/generate",
			prefill: func(kv string) string {
				return `{"token_ids":[11,12,13],"stream":false,"sampling_params":{"max_tokens":1,"extra_args":{"kv_transfer_params":` + kv + `}}}`
			},
			decode: func(kv string) string {
				return `{"token_ids":[11,12,13],"stream":true,"sampling_params":{"max_tokens":3,"extra_args":{"kv_transfer_params":` + kv + `}}}`
			},
			streamed: `"token_ids":[1002]`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := nixlPair(t)
			pr := post(t, p, tt.path, tt.prefill(nixlAsk), "req-"+tt.name)
			kv := kvOf(t, pr)
			if pr.header.Get("x-pdsim-kv") != kvIssued || !strings.Contains(string(kv), `"remote_block_ids"`) {
				t.Fatalf("prefill %v %s: want KV issued, its params at the top level", pr.header, pr.body)
			}
			dr := post(t, d, tt.path, tt.decode(string(kv)), "req-"+tt.name)
			if dr.status != 200 || dr.header.Get("x-pdsim-kv") != kvHit || dr.header.Get("x-pdsim-kv-request-id") != "req-"+tt.name {
				t.Fatalf("decode %d %v %s", dr.status, dr.header, dr.body)
			}
			if !strings.Contains(string(dr.body), tt.streamed) || !strings.Contains(string(dr.body), "\n\n") {
				t.Errorf("decode stream %s, want it to contain %q", dr.body, tt.streamed)
			}
		})
	}

	t.Run("generate ignores params at the top level", func(t *testing.T) {
		p, _ := nixlPair(t)
		r := post(t, p, "/inference/v1/generate", `{"token_ids":[1],"sampling_params":{"max_tokens":1},"kv_transfer_params":`+nixlAsk+`}`, "")
		if r.header.Get("x-pdsim-kv") != kvNone || string(kvOf(t, r)) != "null" {
			t.Fatalf("answer %v %s: want no KV issued", r.header, r.body)
		}
	})
}

func TestResponsesStore(t *testing.T) {
	d := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL, OutputTokens: 3})
	first := post(t, d, "/v1/responses", `{"input":"hi","max_output_tokens":2}`, "r1")
	var resp struct {
		ID     string `json:"id"`
		Status string `json:"status"`
		Output []struct {
			Content []struct{ Text string } `json:"content"`
		} `json:"output"`
		Usage struct {
			OutputTokens int `json:"output_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(first.body, &resp); err != nil || first.status != 200 {
		t.Fatalf("first %d %s", first.status, first.body)
	}
	if resp.Status != "incomplete" || resp.Usage.OutputTokens != 2 || resp.Output[0].Content[0].Text != "tok0 tok1" {
		t.Errorf("max_output_tokens 2: %s", first.body)
	}
	if r := get(t, d, "/v1/responses/"+resp.ID); r.status != 200 || !strings.Contains(string(r.body), resp.ID) {
		t.Errorf("GET the stored response: %d %s", r.status, r.body)
	}
	if r := post(t, d, "/v1/responses", `{"input":"more","previous_response_id":"`+resp.ID+`"}`, ""); r.status != 200 {
		t.Errorf("continuing a stored response: %d %s", r.status, r.body)
	}
	if r := post(t, d, "/v1/responses", `{"input":"more","previous_response_id":"resp_elsewhere"}`, ""); r.status != http.StatusNotFound {
		t.Errorf("continuing a response stored elsewhere: %d %s, want 404", r.status, r.body)
	}
	unstored := kvlessID(t, post(t, d, "/v1/responses", `{"input":"hi","store":false}`, ""))
	if r := get(t, d, "/v1/responses/"+unstored); r.status != http.StatusNotFound {
		t.Errorf("store:false was stored: %d %s", r.status, r.body)
	}
	if r := send(t, d, http.MethodDelete, "/v1/responses/"+resp.ID); r.status != http.StatusMethodNotAllowed {
		t.Errorf("DELETE: %d %s, want vLLM's 405: it serves no DELETE", r.status, r.body)
	}
	if r := get(t, d, "/v1/responses/"+resp.ID); r.status != http.StatusOK {
		t.Errorf("GET after DELETE: %d, want the response still stored", r.status)
	}
	var paths []string
	for _, rec := range d.Requests() {
		paths = append(paths, rec.Path)
	}
	if len(paths) != 7 || paths[1] != "/v1/responses/"+resp.ID {
		t.Errorf("records %q: want every request, stored-response ones included", paths)
	}
}

func kvlessID(t *testing.T, r reply) string {
	t.Helper()
	var resp struct{ ID string }
	if err := json.Unmarshal(r.body, &resp); err != nil || resp.ID == "" {
		t.Fatalf("answer %d %s", r.status, r.body)
	}
	return resp.ID
}

// SGLang's native generate pairs like chat, with the rooms SGLang's
// tokenizer manager gives each request it makes: a batch's prompts room+i of
// a scalar room or their list entries; the samples of a prompt, and its
// prefix-cache request, all the prompt's room, which fails on both legs
// whatever rooms the router sends. A list of sampling_params whose n differ
// is SGLang's 400.
func TestSGLangGenerate(t *testing.T) {
	tests := []struct {
		name, text, sampling, fields string
		want                         int // the status of both legs
		message                      string
	}{
		{"one room", `"once upon a time"`, `{"max_new_tokens":2}`, `"bootstrap_room":42`, 200, ""},
		{"a batch: room+i for prompt i", `["once","upon"]`, `{"max_new_tokens":2}`, `"bootstrap_room":4`, 200, ""},
		{"a batch: a room per prompt", `["once","upon"]`, `[{"max_new_tokens":2},{"max_new_tokens":2}]`,
			`"bootstrap_host":["H","H"],"bootstrap_port":["P","P"],"bootstrap_room":[1,9]`, 200, ""},
		{"a batch: one room for two prompts", `["once","upon"]`, `{"max_new_tokens":2}`, `"bootstrap_room":[6,6]`, 200, `"type":"abort"`},
		{"a batch: fewer rooms than prompts", `["once","upon"]`, `{"max_new_tokens":2}`, `"bootstrap_room":[7]`, 400, "1 entries for a batch of 2"},
		{"n 2: the samples share the room", `"once upon a time"`, `{"max_new_tokens":2,"n":2}`, `"bootstrap_room":42`, 200, `"type":"abort"`},
		{"n 3: a room per sample is never read", `"once upon a time"`, `{"max_new_tokens":2,"n":3}`, `"bootstrap_room":[1,2,3]`, 200, `"type":"abort"`},
		{"a list of sampling_params whose n differ", `["once","upon"]`, `[{"max_new_tokens":2},{"n":2}]`, `"bootstrap_room":5`, 400,
			"The parallel_sample_num should be the same for all samples in sample params."},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			handshake := 5 * time.Second
			if tt.message != "" {
				handshake = 100 * time.Millisecond // the decode's wait for a prefill that refused
			}
			p := start(t, Config{Role: RolePrefill, Protocol: ProtocolSGLang, HandshakeTimeout: handshake})
			d := start(t, Config{Role: RoleDecode, Protocol: ProtocolSGLang, HandshakeTimeout: handshake})
			host, port, _ := net.SplitHostPort(p.BootstrapAddr())
			fields := strings.NewReplacer(`"H"`, `"`+host+`"`, `"P"`, port).Replace(tt.fields)
			if !strings.Contains(fields, "bootstrap_host") {
				fields += `,"bootstrap_host":"` + host + `","bootstrap_port":` + port
			}
			body := `{"text":` + tt.text + `,"sampling_params":` + tt.sampling + `,"stream":true,` + fields + `}`
			prefilled := goPost(p, "/generate", body, "req-G")
			dr := post(t, d, "/generate", body, "req-G")
			pr := <-prefilled
			if pr.status != tt.want || dr.status != tt.want || !strings.Contains(string(pr.body), tt.message) || !strings.Contains(string(dr.body), tt.message) {
				t.Fatalf("prefill %d %s, decode %d %s; want both %d with %q", pr.status, pr.body, dr.status, dr.body, tt.want, tt.message)
			}
			if tt.message != "" {
				return
			}
			if dr.header.Get("x-pdsim-kv") != kvHit {
				t.Errorf("decode KV %q, want a hit", dr.header.Get("x-pdsim-kv"))
			}
			if data := events(t, dr.body); len(data) != 3 || !strings.Contains(data[1], `"text":"tok0 tok1"`) || data[2] != "[DONE]" {
				t.Errorf("decode stream %q", data)
			}
		})
	}
}

func TestOtherEndpointsAreRecorded(t *testing.T) {
	d := start(t, Config{})
	for _, path := range []string{"/v1/embeddings", "/tokenize", "/v1/messages/count_tokens", "/detokenize", "/flush_cache", "/reset_prefix_cache"} {
		if r := post(t, d, path, `{"model":"pdsim","input":"x `+path+`","prompt":"x"}`, ""); r.status != 200 {
			t.Errorf("POST %s: %d %s", path, r.status, r.body)
		}
	}
	recs := d.Requests()
	if len(recs) != 6 || recs[0].Path != "/v1/embeddings" || string(recs[4].Body) != `{"model":"pdsim","input":"x /flush_cache","prompt":"x"}` || recs[4].Status != 200 {
		t.Errorf("records %+v: want each request with its body", recs)
	}
}

// A /generate request whose KV handoff fails is aborted by SGLang's
// scheduler with status 500 (prepare_abort in disaggregation/decode.py and
// prefill.py). The tokenizer manager raises it as a 500 on a whole answer,
// but on a stream yields the abort as the stream's last chunk, a chunk like
// the others (_handle_abort_finish_reason and _wait_one_response in
// python/sglang/srt/managers/tokenizer_manager.py @ 001067ff), which
// /generate writes as it writes every chunk, then data: [DONE]
// (generate_request in python/sglang/srt/entrypoints/http_server.py
// @ 0025436e): no error event, its 200 sent long before. Only the OpenAI
// servers turn it into an error event.
func TestSGLangGenerateAbortedStream(t *testing.T) {
	for _, role := range []string{RolePrefill, RoleDecode} {
		t.Run(role, func(t *testing.T) {
			s := start(t, Config{Role: role, Protocol: ProtocolSGLang, HandshakeTimeout: 50 * time.Millisecond})
			fields := `"bootstrap_host":"127.0.0.1","bootstrap_port":1,"bootstrap_room":3` // no peer: the handoff fails
			whole := post(t, s, "/generate", `{"text":"once","sampling_params":{"max_new_tokens":2},`+fields+`}`, "req-A")
			if whole.status != http.StatusInternalServerError {
				t.Errorf("whole answer: %d %s, want 500", whole.status, whole.body)
			}
			r := post(t, s, "/generate", `{"text":"once","sampling_params":{"max_new_tokens":2},"stream":true,`+fields+`}`, "req-A")
			data := events(t, r.body)
			if r.status != http.StatusOK || len(data) != 2 || data[1] != "[DONE]" {
				t.Fatalf("stream: %d %q, want 200, one chunk and [DONE]", r.status, data)
			}
			var chunk struct {
				Text     *string `json:"text"`
				MetaInfo struct {
					ID           string `json:"id"`
					FinishReason struct {
						Type       string `json:"type"`
						Message    string `json:"message"`
						StatusCode int    `json:"status_code"`
					} `json:"finish_reason"`
				} `json:"meta_info"`
			}
			if err := json.Unmarshal([]byte(data[0]), &chunk); err != nil || chunk.Text == nil || chunk.MetaInfo.ID != "req-A" ||
				chunk.MetaInfo.FinishReason.Type != "abort" || chunk.MetaInfo.FinishReason.StatusCode != 500 ||
				!strings.Contains(chunk.MetaInfo.FinishReason.Message, "failed for request") {
				t.Errorf("chunk %s (%v), want a generate chunk whose finish_reason is an abort with status_code 500", data[0], err)
			}
		})
	}
}

// A path the engine serves, asked with another method, is FastAPI's 405 with
// an Allow header naming the route's methods (Route.handle in Starlette's
// routing.py; FastAPI's APIRoute adds no HEAD); an unknown path is its 404
// whatever the method. Neither vLLM nor SGLang serves DELETE of a stored
// response (vllm/entrypoints/openai/responses/api_router.py,
// python/sglang/srt/entrypoints/http_server.py).
func TestWrongMethodIsFastAPIs405(t *testing.T) {
	const notAllowed, notFound = `{"detail":"Method Not Allowed"}`, `{"detail":"Not Found"}`
	tests := []struct {
		protocol, method, path string
		status                 int
		allow, body            string
	}{
		{ProtocolNIXL, http.MethodDelete, "/v1/responses/resp_1", 405, "GET", notAllowed},
		{ProtocolSGLang, http.MethodDelete, "/v1/responses/resp_1", 405, "GET", notAllowed},
		{ProtocolNIXL, http.MethodGet, "/v1/responses/resp_1/cancel", 405, "POST", notAllowed},
		{ProtocolNIXL, http.MethodGet, "/v1/chat/completions", 405, "POST", notAllowed},
		{ProtocolSGLang, http.MethodPut, "/v1/completions", 405, "POST", notAllowed},
		{ProtocolNIXL, http.MethodPost, "/v1/models", 405, "GET", notAllowed},
		{ProtocolNIXL, http.MethodGet, "/generate", 404, "", notFound},
		{ProtocolNIXL, http.MethodDelete, "/nope", 404, "", notFound},
	}
	engines := map[string]*Server{}
	for _, tt := range tests {
		d := engines[tt.protocol]
		if d == nil {
			d = start(t, Config{Protocol: tt.protocol})
			engines[tt.protocol] = d
		}
		r := send(t, d, tt.method, tt.path)
		if r.status != tt.status || string(r.body) != tt.body || r.header.Get("Allow") != tt.allow {
			t.Errorf("%s: %s %s: %d %s (Allow %q), want %d %s (Allow %q)", tt.protocol, tt.method, tt.path,
				r.status, r.body, r.header.Get("Allow"), tt.status, tt.body, tt.allow)
		}
	}
}

// Each engine serves only its own routes; another engine's is FastAPI's 404.
// vLLM serves token-in generate and /tokenize, SGLang its /generate and
// /tokenize spelled with /v1 too; both serve Anthropic's /v1/messages.
func TestRoutesAreTheEngines(t *testing.T) {
	const notFound = `{"detail":"Not Found"}`
	tests := []struct {
		protocol, path, body string
		served               bool
	}{
		{ProtocolNIXL, "/generate", `{"text":"hi"}`, false},
		{ProtocolSharedStorage, "/generate", `{"text":"hi"}`, false},
		{ProtocolMooncake, "/generate", `{"text":"hi"}`, false},
		{ProtocolNIXL, "/v1/tokenize", `{"prompt":"hi"}`, false},
		{ProtocolNIXL, "/v1/detokenize", `{"tokens":[1]}`, false},
		{ProtocolSGLang, "/inference/v1/generate", `{"token_ids":[1],"sampling_params":{}}`, false},
		{ProtocolNIXL, "/inference/v1/generate", `{"token_ids":[1],"sampling_params":{}}`, true},
		{ProtocolNIXL, "/tokenize", `{"prompt":"hi"}`, true},
		{ProtocolNIXL, "/detokenize", `{"tokens":[1]}`, true},
		{ProtocolNIXL, "/v1/messages", `{"model":"pdsim","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`, true},
		{ProtocolSGLang, "/generate", `{"text":"hi"}`, true},
		{ProtocolSGLang, "/tokenize", `{"prompt":"hi"}`, true},
		{ProtocolSGLang, "/v1/tokenize", `{"prompt":"hi"}`, true},
		{ProtocolSGLang, "/v1/detokenize", `{"tokens":[1]}`, true},
		{ProtocolSGLang, "/v1/messages", `{"model":"pdsim","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`, true},
		{ProtocolSGLang, "/v1/messages/count_tokens", `{"model":"pdsim","messages":[{"role":"user","content":"hi"}]}`, true},
	}
	engines := map[string]*Server{}
	for _, tt := range tests {
		d := engines[tt.protocol]
		if d == nil {
			d = start(t, Config{Protocol: tt.protocol, SharedDir: t.TempDir()})
			engines[tt.protocol] = d
		}
		r := post(t, d, tt.path, tt.body, "")
		if missing := r.status == http.StatusNotFound && string(r.body) == notFound; missing == tt.served {
			t.Errorf("%s POST %s: %d %s, want served %v", tt.protocol, tt.path, r.status, r.body, tt.served)
		}
	}
}
