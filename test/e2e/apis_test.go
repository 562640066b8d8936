package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// request builds a request of api (chat, completions, responses, generate,
// sglang/generate or messages) whose prompt names the case, so that each
// case's legs can be found in the simulators' records (markerOf).
func request(api string, stream bool, prompt string) (path, body string) {
	switch api {
	case "chat":
		return "/v1/chat/completions", fmt.Sprintf(`{"model":"pdsim","messages":[{"role":"user","content":%q}],"stream":%v,"max_tokens":4}`, prompt, stream)
	case "responses":
		return "/v1/responses", fmt.Sprintf(`{"model":"pdsim","input":%q,"stream":%v,"max_output_tokens":4}`, prompt, stream)
	case "generate":
		return "/inference/v1/generate", fmt.Sprintf(`{"token_ids":%s,"stream":%v,"sampling_params":{"max_tokens":4}}`, markerOf(api, prompt), stream)
	case "sglang/generate":
		return "/generate", fmt.Sprintf(`{"text":%q,"stream":%v,"sampling_params":{"max_new_tokens":4}}`, prompt, stream)
	case "messages":
		return "/v1/messages", fmt.Sprintf(`{"model":"pdsim","system":"Be brief.","messages":[{"role":"user","content":%q}],"stream":%v,"max_tokens":4}`, prompt, stream)
	}
	return "/v1/completions", fmt.Sprintf(`{"model":"pdsim","prompt":%q,"stream":%v,"max_tokens":4}`, prompt, stream)
}

// markerOf is what a leg of request(api, …, prompt) carries of the prompt:
// the prompt, or for the token-in API the token ids it is spelt with.
func markerOf(api, prompt string) string {
	if api != "generate" {
		return prompt
	}
	ids := make([]string, len(prompt))
	for i := range len(prompt) {
		ids[i] = fmt.Sprint(prompt[i])
	}
	return "[" + strings.Join(ids, ",") + "]"
}

// checkCompletion checks the client got a chat or completions answer from the
// decode simulator.
func checkCompletion(t *testing.T, stream bool, body string) {
	t.Helper()
	checkAnswer(t, "chat", stream, body)
}

// checkAnswer checks the client got tokens from the decode simulator, in the
// API's shape.
func checkAnswer(t *testing.T, api string, stream bool, body string) {
	t.Helper()
	first := "tok0" // the first output token's text
	if api == "generate" {
		first = `"token_ids":[1000`
	}
	switch {
	case !strings.Contains(body, first):
		t.Errorf("no first token %s in %s", first, excerpt(body))
	case stream && api == "responses":
		if !strings.HasPrefix(body, "event: response.created\ndata: ") || !strings.Contains(body, "event: response.completed\ndata: ") {
			t.Errorf("not a streamed response: %s", excerpt(body))
		}
	case stream && api == "messages":
		if !strings.HasPrefix(body, "event: message_start\ndata: ") || !strings.HasSuffix(body, "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n") {
			t.Errorf("not a streamed Anthropic message: %s", excerpt(body))
		}
	case stream:
		if !strings.HasPrefix(body, "data: ") || !strings.HasSuffix(body, "data: [DONE]\n\n") {
			t.Errorf("not an SSE stream ending in [DONE]: %s", excerpt(body))
		}
	default:
		var a struct {
			Choices []json.RawMessage `json:"choices"`
			Output  []json.RawMessage `json:"output"`
			Text    *string           `json:"text"`
			Type    string            `json:"type"`    // an Anthropic message's
			Content []json.RawMessage `json:"content"` // an Anthropic message's
		}
		err := json.Unmarshal([]byte(body), &a)
		if whole := len(a.Choices) == 1 || len(a.Output) == 1 || a.Text != nil || a.Type == "message" && len(a.Content) == 1; err != nil || !whole {
			t.Errorf("not a whole %s answer: %s", api, excerpt(body))
		}
	}
}

// excerpt is an answer as a failure shows it: whole when short, else its
// length, start and end, so that a truncated answer shows where it stopped.
func excerpt(body string) string {
	if len(body) <= 600 {
		return body
	}
	return fmt.Sprintf("(%d bytes) %s … %s", len(body), body[:300], body[len(body)-300:])
}

// checkRoutes checks the rest of the API table on a rig: a pass-through
// request reaches one decode simulator with the client's body less the
// handoff fields, bodiless ones too; the engines' admin endpoints and paths
// that could resolve into them get extproc's 404, with or without a body,
// and no simulator ever sees them.
func (r *rig) checkRoutes(t *testing.T, marker string) {
	const smuggled = `,"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"203.0.113.9"},"bootstrap_room":1,"bootstrap_host":"203.0.113.9"`
	in := fmt.Sprintf(`{"model":"pdsim","input":%q%s,"seed":98765432109876543210}`, marker, smuggled)
	want := fmt.Sprintf(`{"model":"pdsim","input":%q,"seed":98765432109876543210}`, marker)
	resp, got := r.must(t, "/v1/embeddings", in, nil)
	if resp.StatusCode != http.StatusOK || !strings.Contains(got, `"embedding"`) {
		t.Fatalf("pass-through: status %d: %.300s", resp.StatusCode, got)
	}
	if _, rec := served(t, r.decode, func(rec pdsim.Record) bool { return strings.Contains(string(rec.Body), marker) }); string(rec.Body) != want {
		t.Errorf("the decode engine got\n%s\nwant\n%s", rec.Body, want)
	}
	if recs := recordsWith(r.prefill, marker); len(recs) != 0 {
		t.Errorf("a pass-through request reached a prefill engine: %+v", recs)
	}

	tests := []struct {
		method, path, body string
		want               int
		by                 string // extproc or engine
	}{
		{"GET", "/v1/models", "", 200, "engine"},
		{"POST", "/v1/messages/count_tokens", `{"model":"pdsim","messages":[{"role":"user","content":"` + marker + ` count"}]}`, 200, "engine"},
		{"POST", "/tokenize", `{"model":"pdsim","prompt":"hi"}`, 200, "engine"},
		{"GET", "/v1/responses/resp_nowhere", "", 404, "engine"},    // passed through: the engine's own 404
		{"DELETE", "/v1/responses/resp_nowhere", "", 405, "engine"}, // passed through: no engine serves it
		{"POST", "/flush_cache", `{}`, 404, "extproc"},
		{"POST", "/flush_cache", "", 404, "extproc"},
		{"GET", "/start_profile", "", 404, "extproc"},
		{"POST", "/sleep", `{"level":1}`, 404, "extproc"},
		{"POST", "/reset_prefix_cache", "", 404, "extproc"},
		{"POST", "/v1/models", `{}`, 404, "extproc"},
		{"GET", "/v1/responses/x/..%2F..%2Fflush_cache", "", 404, "extproc"},
		{"POST", "/v1//embeddings", `{}`, 404, "extproc"},
		// vLLM's request cancelling (vllm/entrypoints/serve/cancel/api_router.py, abort_requests
		// with no ids aborts every request in flight) and collective_rpc; SGLang's admin endpoints
		// (python/sglang/srt/entrypoints/http_server.py).
		{"POST", "/abort_requests", `{}`, 404, "extproc"},
		{"POST", "/v1/requests/cancel", `{"request_ids":["x"]}`, 404, "extproc"},
		{"DELETE", "/v1/requests/x", "", 404, "extproc"},
		{"POST", "/collective_rpc", `{"method":"x"}`, 404, "extproc"},
		{"POST", "/update_weights_from_disk", `{"model_path":"/tmp"}`, 404, "extproc"},
		{"POST", "/abort_request", `{"rid":"x","abort_all":true}`, 404, "extproc"},
		{"POST", "/shutdown", "", 404, "extproc"},
		{"GET", "/v1/models/%2e%2e/%2e%2e/flush_cache", "", 404, "extproc"},
		{"GET", "/v1/models/x/%2E%2E%2fabort_requests", "", 404, "extproc"},
	}
	for _, tt := range tests {
		req, err := http.NewRequest(tt.method, r.proxy.URL()+tt.path, strings.NewReader(tt.body)) // "": no body
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := testbed.Client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		fromExtproc := resp.Header.Get(envoyemu.DetailsHeader) == fmt.Sprintf("pd_extproc_%d", tt.want)
		if resp.StatusCode != tt.want || fromExtproc != (tt.by == "extproc") {
			t.Errorf("%s %s (body %q): status %d, from extproc %v; want %d from %s", tt.method, tt.path, tt.body, resp.StatusCode, fromExtproc, tt.want, tt.by)
		}
	}
	if n, m := sum(legsOn(r.decode, marker+" count")), sum(legsOn(r.prefill, marker+" count")); n != 1 || m != 0 {
		t.Errorf("count_tokens on the default list: %d decode and %d prefill requests, want it on one decode engine alone", n, m)
	}
	if r.connector == "kv-sglang" {
		path, body := request("chat", false, marker+" n=2")
		body = strings.Replace(body, `"max_tokens":4`, `"max_tokens":4,"n":2`, 1)
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusBadRequest || !strings.Contains(got, "cannot pair several samples") {
			t.Errorf("kv-sglang n=2: status %d (%.200s), want 400 saying it cannot pair them", resp.StatusCode, got)
		}
		batch := `{"model":"pdsim","prompt":["` + marker + ` batch a","b"],"max_tokens":2}` // one room: room+i for prompt i, on both legs
		if resp, got := r.must(t, "/v1/completions", batch, nil); resp.StatusCode != http.StatusOK || resp.Header.Get("x-pdsim-kv") != "hit" {
			t.Errorf("kv-sglang completions batch: status %d, KV %q (%.200s), want 200 and a hit", resp.StatusCode, resp.Header.Get("x-pdsim-kv"), got)
		}
		// SGLang answers a batch /generate with an array: more of them than
		// it takes failures to eject an endpoint must all be served.
		generate := `{"text":["` + marker + ` generate a","b"],"sampling_params":{"max_new_tokens":2}}`
		for i := range 4 {
			if resp, got := r.must(t, "/generate", generate, nil); resp.StatusCode != http.StatusOK || !strings.HasPrefix(got, "[") {
				t.Errorf("kv-sglang /generate batch %d: status %d (%.200s), want 200 and an array", i, resp.StatusCode, got)
			}
		}
		if n := r.metric(t, `pd_extproc_prefill_failures_total{reason="malformed"}`); n > 0 {
			t.Errorf("prefill_failures_total{reason=malformed} = %v after batch /generate legs, want none", n)
		}
		logprobs := `{"text":"` + marker + ` logprobs","return_logprob":true,"logprob_start_len":0}`
		if resp, got := r.must(t, "/generate", logprobs, nil); resp.StatusCode != http.StatusBadRequest ||
			!strings.Contains(got, "only the prefill engine computes; SGLang's own gateway merges the prefill answer's input_token_logprobs") {
			t.Errorf("kv-sglang prompt logprobs: status %d (%.300s), want 400 saying why", resp.StatusCode, got)
		}
		lists := []struct{ sampling, want string }{
			{`[{"n":2,"max_new_tokens":2},{"n":2}]`, "n is 2: kv-sglang cannot pair several samples"},
			{`[{"max_new_tokens":2},{"n":2}]`, "sampling_params[1] has n 2 and sampling_params[0] has n 1"},
		}
		for _, l := range lists {
			list := `{"text":["` + marker + ` a","b"],"sampling_params":` + l.sampling + `}`
			if resp, got := r.must(t, "/generate", list, nil); resp.StatusCode != http.StatusBadRequest || !strings.Contains(got, l.want) {
				t.Errorf("kv-sglang /generate with sampling_params %s: status %d (%.200s), want 400 with %q", l.sampling, resp.StatusCode, got, l.want)
			}
		}
	}
	for _, sims := range [][]*pdsim.Server{r.prefill, r.decode} {
		for _, s := range sims {
			for _, rec := range s.Requests() {
				if p := rec.Path; strings.Contains(p, "flush_cache") || strings.Contains(p, "abort_request") || strings.HasPrefix(p, "/v1/requests") ||
					slices.Contains([]string{"/start_profile", "/sleep", "/reset_prefix_cache", "/collective_rpc", "/update_weights_from_disk", "/shutdown"}, p) {
					t.Errorf("%s reached the engine at %s", p, s.Addr())
				}
			}
		}
	}
}

// TestDecodeOnlyByRequestOrConfig: a Responses request with a tool other
// than a function goes to the decode engine alone (builtin_tools), in both
// body modes; with function tools it is P/D, and routes.pair_builtin_tools
// pairs both (under kv-shared-storage: kv-nixl refuses the key). routes.messages_decode_only sends Anthropic Messages requests,
// P/D by default, to the decode engine alone (unpaired_api).
func TestDecodeOnlyByRequestOrConfig(t *testing.T) {
	responses := func(tools string) string {
		return `{"model":"pdsim","input":"{marker} what is new?","max_output_tokens":4,"tools":` + tools + `}`
	}
	tests := []struct {
		name, mode, extra, path, body string // body: {marker} marks the case's legs
		connector                     string // "": kv-nixl
		wantPrefill                   int
		reason                        string // of a decode-only request
	}{
		{name: "a built-in tool", path: "/v1/responses",
			body: responses(`[{"type":"function","name":"f","parameters":{}},{"type":"web_search_preview"}]`), reason: "builtin_tools"},
		{name: "a built-in tool, buffered", mode: "buffered", path: "/v1/responses", body: responses(`[{"type":"mcp","server_label":"x"}]`), reason: "builtin_tools"},
		{name: "function tools", path: "/v1/responses", body: responses(`[{"type":"function","name":"f","parameters":{}}]`), wantPrefill: 1},
		{name: "a built-in tool, paired by config", connector: "kv-shared-storage", extra: "routes: {pair_builtin_tools: true}", path: "/v1/responses",
			body: responses(`[{"type":"code_interpreter","container":{"type":"auto"}}]`), wantPrefill: 1},
		{name: "messages, decode-only by config", extra: "routes: {messages_decode_only: true}", path: "/v1/messages",
			body: `{"model":"pdsim","messages":[{"role":"user","content":"{marker} what is new?"}],"max_tokens":4}`, reason: "unpaired_api"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: tt.mode, connector: tt.connector, extra: tt.extra})
			marker := "[decode-only? " + tt.name + "]"
			if resp, got := r.must(t, tt.path, strings.ReplaceAll(tt.body, "{marker}", marker), nil); resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %.300s", resp.StatusCode, got)
			}
			if n := sum(legsOn(r.prefill, marker)); n != tt.wantPrefill {
				t.Errorf("%d prefill legs, want %d", n, tt.wantPrefill)
			}
			if n := sum(legsOn(r.decode, marker)); n != 1 {
				t.Errorf("%d decode legs, want 1", n)
			}
			if tt.reason != "" {
				series := fmt.Sprintf(`pd_extproc_pd_decisions_total{reason="%s"}`, tt.reason)
				if n := r.metric(t, series); n != 1 {
					t.Errorf("%s = %v, want 1", series, n)
				}
			}
		})
	}
}

// TestMultipartIsRefusedOnAListedPath: a body that is not JSON gets a 400
// even on a path routes.passthrough lists, in both body modes, as the README
// says. (POST /v1/messages/count_tokens, on the default list, is in
// checkRoutes.)
func TestMultipartIsRefusedOnAListedPath(t *testing.T) {
	for _, mode := range []string{"full_duplex", "buffered"} {
		t.Run(mode, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: mode, extra: `routes: {passthrough: ["POST /v1/audio/transcriptions"]}`})
			multipart := "--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\npdsim\r\n--b--\r\n"
			h := http.Header{"Content-Type": {"multipart/form-data; boundary=b"}}
			if resp, got := r.must(t, "/v1/audio/transcriptions", multipart, h); resp.StatusCode != http.StatusBadRequest || !strings.Contains(got, "not valid JSON") {
				t.Errorf("multipart: status %d (%.200s), want 400 saying the body is not JSON", resp.StatusCode, got)
			}
			if n := sum(legsOn(r.decode, "pdsim")) + sum(legsOn(r.prefill, "pdsim")); n != 0 {
				t.Errorf("the refused body reached %d engines", n)
			}
		})
	}
}
