package pdsim

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
)

// A Messages request hands the KV over as vLLM's chat does: the prefill's
// whole answer carries kv_transfer_params at the top level, and the decode
// engine that gets them streams Anthropic's events, without them.
func TestMessagesHandOffKV(t *testing.T) {
	p, d := nixlPair(t)
	const ask = `{"model":"pdsim","system":"Be brief.","messages":[{"role":"user","content":"the quick brown fox"}],`
	pr := post(t, p, "/v1/messages", ask+`"max_tokens":1,"stream":false,"kv_transfer_params":`+nixlAsk+`}`, "req-M")
	var whole struct {
		ID, Type, Role, Model, StopReason string
		Content                           []contentBlock
		Usage                             messagesUsage
		KV                                json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(pr.body, &whole); err != nil || pr.status != 200 {
		t.Fatalf("prefill %d %s", pr.status, pr.body)
	}
	if pr.header.Get("x-pdsim-kv") != kvIssued || !strings.HasPrefix(whole.ID, "chatcmpl-req-M-") || whole.Type != "message" ||
		whole.Role != "assistant" || len(whole.Content) != 1 || whole.Content[0] != (contentBlock{"text", "tok0"}) ||
		whole.Usage.OutputTokens != 1 || !strings.Contains(string(whole.KV), `"remote_block_ids"`) {
		t.Fatalf("prefill %v %s: want a whole Anthropic message of one token with the KV params", pr.header, pr.body)
	}
	if strings.Contains(string(pr.body), "stop_sequence") {
		t.Errorf("a whole answer prints no null field: %s", pr.body)
	}

	dr := post(t, d, "/v1/messages", ask+`"max_tokens":2,"stream":true,"kv_transfer_params":`+string(whole.KV)+`}`, "req-M")
	if dr.status != 200 || dr.header.Get("x-pdsim-kv") != kvHit || dr.header.Get("x-pdsim-kv-request-id") != "req-M" {
		t.Fatalf("decode %d %v %s", dr.status, dr.header, dr.body)
	}
	_, id, _ := strings.Cut(string(dr.body), `"id":"`)
	id, _, _ = strings.Cut(id, `"`)
	input := whole.Usage.InputTokens
	want := `event: message_start
data: {"type":"message_start","message":{"id":"` + id + `","content":[],"model":"pdsim","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":` + strconv.Itoa(input) + `,"output_tokens":0}}}

event: content_block_start
data: {"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}

event: content_block_delta
data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"tok0"},"index":0}

event: content_block_delta
data: {"type":"content_block_delta","delta":{"type":"text_delta","text":" tok1"},"index":0}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"input_tokens":` + strconv.Itoa(input) + `,"output_tokens":2}}

event: message_stop
data: {"type":"message_stop"}

`
	if string(dr.body) != want || !strings.HasPrefix(id, "chatcmpl-req-M-") {
		t.Errorf("decode stream\n%s\nwant\n%s", dr.body, want)
	}

	plain := post(t, d, "/v1/messages", ask+`"max_tokens":3}`, "")
	if plain.status != 200 || strings.Contains(string(plain.body), "kv_transfer_params") || !strings.Contains(string(plain.body), `"stop_reason":"max_tokens"`) {
		t.Errorf("an answer without KV params: %d %s; want no kv_transfer_params field", plain.status, plain.body)
	}
}

// Messages errors are Anthropic's: {"type":"error","error":{"type","message"}}.
func TestMessagesErrors(t *testing.T) {
	d := start(t, Config{})
	tests := []struct {
		body, want string
		status     int
	}{
		{`{"model":"pdsim","messages":[]}`, "max_tokens: Field required", 400},
		{`{"model":"pdsim","max_tokens":0,"messages":[]}`, "max_tokens must be at least 1", 400},
		{`{"model":"other","max_tokens":1,"messages":[]}`, "does not exist", 404},
	}
	for _, tt := range tests {
		r := post(t, d, "/v1/messages", tt.body, "")
		var e anthropicError
		if err := json.Unmarshal(r.body, &e); err != nil || r.status != tt.status || e.Type != "error" || !strings.Contains(e.Error.Message, tt.want) {
			t.Errorf("%s: %d %s; want %d with an Anthropic error saying %q", tt.body, r.status, r.body, tt.status, tt.want)
		}
	}
}

// Since vllm-project/vllm#40912 a Messages answer states the cached tokens as
// Anthropic's API does, where the chat answer it is made from states them
// (--enable-prompt-tokens-details, and something cached): input_tokens
// without them, cache_read_input_tokens, cache_creation_input_tokens 0. A
// stream states them in its message_delta only.
func TestMessagesUsageAsVLLMStatesIt(t *testing.T) {
	p := start(t, Config{Role: RolePrefill, Protocol: ProtocolNIXL, PromptTokensDetails: true})
	d := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL, PromptTokensDetails: true})
	ask := `{"model":"pdsim","messages":[{"role":"user","content":"` + strings.TrimSpace(strings.Repeat("word ", 40)) + `"}],`
	leg := ask + `"max_tokens":1,"kv_transfer_params":` + nixlAsk + `}`
	usage := func(answer string) string { // the usage object as printed
		_, u, _ := strings.Cut(answer, `"usage":`)
		u, _, _ = strings.Cut(u, "}")
		return u + "}"
	}

	first, second := post(t, p, "/v1/messages", leg, "req-1"), post(t, p, "/v1/messages", leg, "req-2")
	if got := usage(string(first.body)); got != `{"input_tokens":41,"output_tokens":1}` {
		t.Errorf("a new prompt's usage %s: want the whole prompt as input_tokens, no cache fields", got)
	}
	if got := usage(string(second.body)); got != `{"input_tokens":9,"output_tokens":1,"cache_creation_input_tokens":0,"cache_read_input_tokens":32}` {
		t.Errorf("the same prompt again: usage %s, want its full blocks (32 of 41) read from the cache and the rest as input", got)
	}
	var whole struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(second.body, &whole); err != nil {
		t.Fatal(err)
	}
	pulled := post(t, d, "/v1/messages", ask+`"max_tokens":2,"stream":true,"kv_transfer_params":`+string(whole.KV)+`}`, "req-2")
	var start, delta string
	for line := range strings.SplitSeq(string(pulled.body), "\n") {
		switch {
		case strings.HasPrefix(line, `data: {"type":"message_start"`):
			start = usage(line)
		case strings.HasPrefix(line, `data: {"type":"message_delta"`):
			delta = usage(line)
		}
	}
	if start != `{"input_tokens":41,"output_tokens":0}` ||
		delta != `{"input_tokens":0,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":41}` {
		t.Errorf("decode with the prefill's KV: message_start usage %s, message_delta usage %s; "+
			"want the whole prompt uncached at the start and read from the cache at the end", start, delta)
	}
}
