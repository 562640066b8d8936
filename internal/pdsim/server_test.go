package pdsim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// client never keeps idle connections, so goleak sees only what servers leave behind.
var client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

func start(t *testing.T, cfg Config) *Server {
	t.Helper()
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	s, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	})
	return s
}

// finished is a request log that tells the test when the engine is done with a request.
type finished chan string

func (f finished) Write(b []byte) (int, error) {
	if bytes.Contains(b, []byte("msg=request ")) {
		f <- string(b)
	}
	return len(b), nil
}

func (f finished) wait(t *testing.T) string {
	t.Helper()
	select {
	case line := <-f:
		return line
	case <-time.After(5 * time.Second):
		t.Fatal("the engine never finished the request")
		return ""
	}
}

type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r reply) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(r.body, &m); err != nil {
		t.Fatalf("body %q: %v", r.body, err)
	}
	return m
}

func post(t *testing.T, s *Server, path, body, requestID string) reply {
	t.Helper()
	r, err := do(context.Background(), s, path, body, requestID)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	return r
}

// goPost sends in the background: two legs in flight at once, as an SGLang router sends them.
func goPost(s *Server, path, body, requestID string) <-chan reply {
	out := make(chan reply, 1)
	go func() {
		r, err := do(context.Background(), s, path, body, requestID)
		if err != nil {
			r = reply{status: -1, body: []byte(err.Error())}
		}
		out <- r
	}()
	return out
}

func do(ctx context.Context, s *Server, path, body, requestID string) (reply, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+s.Addr()+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if requestID != "" {
		req.Header.Set("X-Request-Id", requestID)
	}
	resp, err := client.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, resp.Header, b}, err
}

func get(t *testing.T, s *Server, path string) reply {
	t.Helper()
	return send(t, s, http.MethodGet, path)
}

// send makes a request without a body.
func send(t *testing.T, s *Server, method, path string) reply {
	t.Helper()
	req, err := http.NewRequest(method, "http://"+s.Addr()+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, resp.Header, b}
}

// events splits an SSE body into its data payloads, failing on bad framing.
func events(t *testing.T, body []byte) []string {
	t.Helper()
	var out []string
	for _, ev := range strings.SplitAfter(string(body), "\n\n") {
		if ev == "" {
			continue
		}
		if !strings.HasPrefix(ev, "data: ") || !strings.HasSuffix(ev, "\n\n") {
			t.Fatalf("bad SSE event %q", ev)
		}
		out = append(out, strings.TrimSuffix(strings.TrimPrefix(ev, "data: "), "\n\n"))
	}
	return out
}

const chatBody = `{"model":"pdsim","messages":[{"role":"user","content":"hello there world"}]`

func TestRequestValidation(t *testing.T) {
	tests := []struct {
		name, protocol, path, body string
		status                     int
		message                    string
	}{
		{"invalid JSON", "", "/v1/chat/completions", `{"model":`, 400, "JSON decode error"},
		{"not an object", "", "/v1/chat/completions", `[1]`, 400, "JSON decode error"},
		{"unknown model", "", "/v1/chat/completions", `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`, 404, "The model `gpt-9` does not exist."},
		{"no messages", "", "/v1/chat/completions", `{"model":"pdsim"}`, 400, "messages: Field required"},
		{"no prompt", "", "/v1/completions", `{"model":"pdsim"}`, 400, "prompt: Field required"},
		{"stream_options without stream", "", "/v1/chat/completions", chatBody + `,"stream_options":{"include_usage":true}}`, 400, "Stream options can only be defined when `stream=True`."},
		{"stream_options with stream false", "", "/v1/completions", `{"prompt":"x","stream":false,"stream_options":{"include_usage":true}}`, 400, "Stream options"},
		{"min_tokens above max_tokens", "", "/v1/chat/completions", chatBody + `,"max_tokens":1,"min_tokens":5}`, 400, "min_tokens must be less than or equal to max_tokens=1, got 5."},
		{"min_tokens above max_completion_tokens", "", "/v1/chat/completions", chatBody + `,"max_tokens":10,"max_completion_tokens":2,"min_tokens":5}`, 400, "max_tokens=2"},
		{"max_tokens zero", "", "/v1/completions", `{"prompt":"x","max_tokens":0}`, 400, "max_tokens must be at least 1"},
		{"max_tokens not an integer", "", "/v1/completions", `{"prompt":"x","max_tokens":1.5}`, 400, "valid integer"},
		{"kv_transfer_params a string", "", "/v1/chat/completions", chatBody + `,"kv_transfer_params":"do_remote_decode"}`, 400, "kv_transfer_params: Input should be a valid dictionary"},
		{"an empty cache_salt", "", "/v1/chat/completions", chatBody + `,"cache_salt":""}`, 400, "Parameter 'cache_salt' must be a non-empty string if provided."},
		{"a cache_salt not a string", "", "/v1/completions", `{"prompt":"x","cache_salt":7}`, 400, "cache_salt"},
		{"a cache_salt with a slash", "", "/v1/chat/completions", chatBody + `,"cache_salt":"tenant/acme"}`, 400,
			`Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\', or NUL.`},
		{"a cache_salt of 129 characters", "", "/v1/completions", `{"prompt":"x","cache_salt":"` + strings.Repeat("é", 129) + `"}`, 400, "at most 128 characters"},
		{"sglang: unknown model, flat error shape", ProtocolSGLang, "/v1/chat/completions", `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`, 404, "does not exist"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Config{Role: RoleDecode, Protocol: ProtocolNIXL}
			if tt.protocol != "" {
				cfg.Protocol = tt.protocol
			}
			s := start(t, cfg)
			r := post(t, s, tt.path, tt.body, "")
			if r.status != tt.status {
				t.Fatalf("status %d, want %d: %s", r.status, tt.status, r.body)
			}
			e := r.json(t)
			if tt.protocol != ProtocolSGLang { // vLLM nests the error; SGLang does not
				e, _ = e["error"].(map[string]any)
			} else if e["object"] != "error" {
				t.Errorf("sglang error without object:error: %s", r.body)
			}
			if msg, _ := e["message"].(string); !strings.Contains(msg, tt.message) {
				t.Errorf("message %q, want it to contain %q", msg, tt.message)
			}
			if e["code"] != float64(tt.status) || !strings.HasSuffix(e["type"].(string), "Error") {
				t.Errorf("error fields: %s", r.body)
			}
			if got := s.Requests(); len(got) != 1 || got[0].Status != tt.status || got[0].Body == nil {
				t.Errorf("record %+v", got)
			}
		})
	}
}

func TestNonStreamedAnswers(t *testing.T) {
	tests := []struct {
		name, path, body, object, text, finish string
	}{
		{"natural length stops", "/v1/chat/completions", chatBody + `}`, "chat.completion", "tok0 tok1 tok2 tok3", "stop"},
		{"max_tokens caps", "/v1/chat/completions", chatBody + `,"max_tokens":2}`, "chat.completion", "tok0 tok1", "length"},
		{"max_completion_tokens wins", "/v1/chat/completions", chatBody + `,"max_tokens":3,"max_completion_tokens":1}`, "chat.completion", "tok0", "length"},
		{"min_tokens extends", "/v1/chat/completions", chatBody + `,"min_tokens":6}`, "chat.completion", "tok0 tok1 tok2 tok3 tok4 tok5", "stop"},
		{"stream_options {} without stream is allowed", "/v1/chat/completions", chatBody + `,"stream_options":{}}`, "chat.completion", "tok0 tok1 tok2 tok3", "stop"},
		{"completions", "/v1/completions", `{"prompt":"one two three","max_tokens":3}`, "text_completion", "tok0 tok1 tok2", "length"},
	}
	s := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL, OutputTokens: 4})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := post(t, s, tt.path, tt.body, "rid-1")
			if r.status != 200 {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			var c struct {
				ID, Object, Model string
				Choices           []struct {
					Text         string
					Message      struct{ Role, Content string }
					FinishReason string `json:"finish_reason"`
				}
				Usage struct {
					PromptTokens     int `json:"prompt_tokens"`
					CompletionTokens int `json:"completion_tokens"`
				}
				KV json.RawMessage `json:"kv_transfer_params"`
			}
			if err := json.Unmarshal(r.body, &c); err != nil {
				t.Fatal(err)
			}
			text := c.Choices[0].Text + c.Choices[0].Message.Content
			if c.Object != tt.object || text != tt.text || c.Choices[0].FinishReason != tt.finish || c.Model != "pdsim" {
				t.Errorf("got %s", r.body)
			}
			if c.Usage.CompletionTokens != len(strings.Fields(tt.text)) || c.Usage.PromptTokens == 0 {
				t.Errorf("usage: %s", r.body)
			}
			if string(c.KV) != "null" { // vLLM prints the field on every non-streamed answer
				t.Errorf("kv_transfer_params %s, want null", c.KV)
			}
			if !strings.Contains(c.ID, "-rid-1-") && !strings.HasPrefix(c.ID, "cmpl-rid-1-") {
				t.Errorf("id %q does not carry X-Request-Id", c.ID)
			}
			if r.header.Get("x-pdsim-role") != "decode" || r.header.Get("x-pdsim-kv") != "none" {
				t.Errorf("headers %v", r.header)
			}
		})
	}
}

func TestStreamFraming(t *testing.T) {
	s := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL})
	tests := []struct {
		name, path, body string
		usage            bool
	}{
		{"chat", "/v1/chat/completions", chatBody + `,"stream":true,"max_tokens":3}`, false},
		{"chat with usage", "/v1/chat/completions", chatBody + `,"stream":true,"max_tokens":3,"stream_options":{"include_usage":true}}`, true},
		{"completions with usage", "/v1/completions", `{"prompt":"a b","stream":true,"max_tokens":3,"stream_options":{"include_usage":true}}`, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := post(t, s, tt.path, tt.body, "")
			if r.status != 200 || !strings.HasPrefix(r.header.Get("Content-Type"), "text/event-stream") {
				t.Fatalf("status %d, content type %q", r.status, r.header.Get("Content-Type"))
			}
			data := events(t, r.body)
			if data[len(data)-1] != "[DONE]" {
				t.Fatalf("last event %q, want [DONE]", data[len(data)-1])
			}
			var text, finish string
			var sawUsage bool
			for _, d := range data[:len(data)-1] {
				var c struct {
					Object  string
					Choices []struct {
						Text         string
						Delta        struct{ Content string }
						FinishReason *string `json:"finish_reason"`
					}
					Usage *usage
				}
				if err := json.Unmarshal([]byte(d), &c); err != nil {
					t.Fatalf("chunk %q: %v", d, err)
				}
				if c.Usage != nil {
					sawUsage = c.Usage.CompletionTokens == 3 && len(c.Choices) == 0
					continue
				}
				text += c.Choices[0].Text + c.Choices[0].Delta.Content
				if c.Choices[0].FinishReason != nil {
					finish = *c.Choices[0].FinishReason
				}
			}
			if text != "tok0 tok1 tok2" || finish != "length" || sawUsage != tt.usage {
				t.Errorf("text %q finish %q usage %v", text, finish, sawUsage)
			}
			if rec := s.Requests(); !rec[len(rec)-1].Stream {
				t.Error("record does not say stream")
			}
		})
	}
}

// SGLang retrieves its served model at GET /v1/models/{model}, a name with
// slashes included, and answers any other name 404; vLLM has no such route.
func TestModelRetrieval(t *testing.T) {
	tests := []struct {
		protocol, path string
		status         int
		want           string
	}{
		{ProtocolSGLang, "/v1/models/Qwen/Qwen3-8B", 200, `"id":"Qwen/Qwen3-8B"`},
		{ProtocolSGLang, "/v1/models/llama", 404, `"code":"model_not_found"`},
		{ProtocolNIXL, "/v1/models/Qwen/Qwen3-8B", 404, `"detail":"Not Found"`},
	}
	for _, tt := range tests {
		s := start(t, Config{Role: RoleDecode, Protocol: tt.protocol, Model: "Qwen/Qwen3-8B"})
		if r := get(t, s, tt.path); r.status != tt.status || !strings.Contains(string(r.body), tt.want) {
			t.Errorf("%s: GET %s: %d %s, want %d with %s", tt.protocol, tt.path, r.status, r.body, tt.status, tt.want)
		}
	}
}

// A test's Queues.Waiting adds to the waiting queue an engine reports,
// under either protocol's name, and goes when set back to none.
func TestQueuesStandForLoadFromElsewhere(t *testing.T) {
	for protocol, series := range map[string]string{
		ProtocolNIXL:   `vllm:num_requests_waiting{engine="0",model_name="pdsim"}`,
		ProtocolSGLang: `sglang:num_queue_reqs{engine_type="decode",model_name="pdsim",pp_rank="0",tp_rank="0"}`,
	} {
		s := start(t, Config{Role: RoleDecode, Protocol: protocol})
		for _, n := range []int{7, 0} {
			s.SetQueues(Queues{Waiting: n})
			if want, m := fmt.Sprintf("%s %d\n", series, n), string(get(t, s, "/metrics").body); !strings.Contains(m, want) {
				t.Errorf("%s, Waiting %d: /metrics lacks %q:\n%s", protocol, n, want, m)
			}
		}
	}
}

func TestOtherEndpoints(t *testing.T) {
	s := start(t, Config{Role: RolePrefill, Protocol: ProtocolNIXL, Model: "m1"})
	big := `{"model":"m1","messages":[{"role":"user","content":"x"}],"max_tokens":1,"seed":123456789012345678901234567890}`
	post(t, s, "/v1/chat/completions", big, "rid-big")

	tests := []struct {
		path   string
		status int
		want   string
	}{
		{"/health", 200, ""},
		{"/v1/models", 200, `"id":"m1"`},
		{"/metrics", 200, `vllm:kv_cache_usage_perc{engine="0",model_name="m1"}`},
		{"/metrics", 200, `vllm:num_requests_waiting{engine="0",model_name="m1"} 0`},
		{"/metrics", 200, `vllm:num_requests_running{engine="0",model_name="m1"} 0`},
		{"/nope", 404, `"detail":"Not Found"`},
	}
	for _, tt := range tests {
		r := get(t, s, tt.path)
		if r.status != tt.status || !strings.Contains(string(r.body), tt.want) || r.header.Get("x-pdsim-role") != "prefill" {
			t.Errorf("GET %s: %d %q (role header %q)", tt.path, r.status, r.body, r.header.Get("x-pdsim-role"))
		}
	}

	listing := get(t, s, "/pdsim/requests").body
	if !bytes.Contains(listing, []byte(`\"seed\":123456789012345678901234567890`)) {
		t.Errorf("/pdsim/requests does not show the body as text: %s", listing)
	}
	var recs []Record
	if err := json.Unmarshal(listing, &recs); err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 || string(recs[0].Body) != big || recs[0].RequestID != "rid-big" || recs[0].KV != "none" || recs[0].Status != 200 {
		t.Errorf("records over HTTP: %+v", recs)
	}
}

// streamUntilFirstToken starts a streamed request and returns once the engine
// has sent its first token, so the test knows the request is in flight.
func streamUntilFirstToken(t *testing.T, s *Server, body string) context.CancelFunc {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+s.Addr()+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.Contains(line, "tok0") {
		t.Fatalf("first line %q: %v", line, err)
	}
	return func() { cancel(); resp.Body.Close() }
}

func TestClientCancelReachesEngine(t *testing.T) {
	done := make(finished, 1)
	s := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL, TPOT: time.Hour, Log: done})
	stop := streamUntilFirstToken(t, s, `{"prompt":"a b c d e","stream":true}`)
	if m := get(t, s, "/metrics").body; !bytes.Contains(m, []byte(`vllm:num_requests_running{engine="0",model_name="pdsim"} 1`)) ||
		!bytes.Contains(m, []byte(`vllm:kv_cache_usage_perc{engine="0",model_name="pdsim"} 0.0001`)) {
		t.Errorf("metrics do not show the running request:\n%s", m)
	}
	stop()
	if line := done.wait(t); !strings.Contains(line, "canceled=true") {
		t.Errorf("log line %q", line)
	}
	if r := s.Requests(); len(r) != 1 || !r[0].Canceled || !r[0].Stream {
		t.Errorf("record %+v, want Canceled", r)
	}
}

// TestRecordsAreBounded: a simulator keeps its last requests only, so that
// one left under load (1 MiB prompts, for hours) does not grow without end;
// a request it forgot while in flight finishes as any other.
func TestRecordsAreBounded(t *testing.T) {
	done := make(finished, 1)
	s := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL, TPOT: time.Hour, MaxRecords: 4, Log: done})
	stop := streamUntilFirstToken(t, s, `{"prompt":"in flight","stream":true,"max_tokens":2}`)
	var want []string
	for i := range 10 {
		id := fmt.Sprintf("r%d", i)
		if r := post(t, s, "/v1/completions", `{"prompt":"hello","max_tokens":1}`, id); r.status != http.StatusOK {
			t.Fatalf("request %s: %d %s", id, r.status, r.body)
		}
		done.wait(t)
		want = append(want, id)
	}
	stop()
	if line := done.wait(t); !strings.Contains(line, "canceled=true") {
		t.Errorf("the forgotten request's log line %q, want it cancelled", line)
	}
	var got []string
	for _, r := range s.Requests() {
		if r.Status != http.StatusOK {
			t.Errorf("record %s: status %d, want 200 (updated in its own place)", r.RequestID, r.Status)
		}
		got = append(got, r.RequestID)
	}
	// Past 4 records the older two go: "in flight", then r0..r9, leave r7..r9.
	if !slices.Equal(got, want[7:]) {
		t.Errorf("records %v, want %v", got, want[7:])
	}
}
