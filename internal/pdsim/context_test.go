package pdsim

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
)

// A vLLM engine refuses, with a 400 of its API's shape, a request whose
// prompt and output limit together exceed its context, whatever its role,
// and lists that length for its model (null for an adapter) at /v1/models.
func TestContextLength(t *testing.T) {
	const prompt = `"prompt":"a b c"` // 3 tokens
	tests := []struct {
		name, role, path, body string
		status                 int
		message                string
	}{
		{"prompt and limit fill it", RoleDecode, "/v1/completions", `{` + prompt + `,"max_tokens":5}`, 200, ""},
		{"one over", RoleDecode, "/v1/completions", `{` + prompt + `,"max_tokens":6}`, 400,
			"You passed 3 input tokens and requested 6 output tokens. However, the model's context length is only 8 tokens, resulting in a maximum input length of 2 tokens."},
		{"one over, at a prefill", RolePrefill, "/v1/completions", `{` + prompt + `,"max_tokens":6}`, 400, "You passed 3 input tokens"},
		{"a limit past the context", RoleDecode, "/v1/completions", `{` + prompt + `,"max_tokens":9}`, 400, "max_tokens=9 cannot be greater than max_model_len=8."},
		{"a prompt past the context, no limit", RoleDecode, "/v1/completions", `{"prompt":"a b c d e f g h i"}`, 400, "You passed 9 input tokens and requested 0 output tokens."},
		{"chat's max_completion_tokens", RoleDecode, "/v1/chat/completions", chatBody + `,"max_tokens":1,"max_completion_tokens":9}`, 400, "max_completion_tokens=9 cannot be greater"},
		{"messages", RoleDecode, "/v1/messages", chatBody + `,"max_tokens":9}`, 400, "max_tokens=9 cannot be greater"},
		{"responses' max_output_tokens", RoleDecode, "/v1/responses", `{"input":"a b c","max_output_tokens":9}`, 400,
			"max_output_tokens=9 cannot be greater than max_model_len=8."},
		{"responses one over", RoleDecode, "/v1/responses", `{"input":"a b c","max_output_tokens":6}`, 400, "You passed 3 input tokens and requested 6"},
		{"responses that fill it", RoleDecode, "/v1/responses", `{"input":"a b c","max_output_tokens":5}`, 200, ""},
		{"generate is not checked: the engine stops at the context", RoleDecode, "/inference/v1/generate",
			`{"token_ids":[1,2,3],"sampling_params":{"max_tokens":9}}`, 200, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := start(t, Config{Role: tt.role, MaxModelLen: 8})
			r := post(t, s, tt.path, tt.body, "")
			if r.status != tt.status || !strings.Contains(string(r.body), tt.message) {
				t.Fatalf("%d %s, want %d with %q", r.status, r.body, tt.status, tt.message)
			}
			if tt.status != 400 {
				return
			}
			shape := `{"error":{"message":`
			if tt.path == "/v1/messages" {
				shape = `{"type":"error","error":{"type":"BadRequestError","message":`
			}
			if !strings.HasPrefix(string(r.body), shape) || tt.path != "/v1/messages" && !strings.Contains(string(r.body), `"type":"BadRequestError"`) {
				t.Errorf("body %s, want it to start %s, of type BadRequestError", r.body, shape)
			}
		})
	}

	t.Run("listed", func(t *testing.T) {
		s := start(t, Config{Role: RoleDecode, MaxModelLen: 8, LoRA: []string{"sql"}})
		var list struct {
			Data []struct {
				ID          string `json:"id"`
				MaxModelLen *int   `json:"max_model_len"`
			} `json:"data"`
		}
		r := get(t, s, "/v1/models")
		if err := json.Unmarshal(r.body, &list); err != nil || len(list.Data) != 2 ||
			list.Data[0].MaxModelLen == nil || *list.Data[0].MaxModelLen != 8 || list.Data[1].MaxModelLen != nil ||
			!strings.Contains(string(r.body), `"max_model_len":null`) {
			t.Errorf("/v1/models %s: want max_model_len 8 for pdsim, null for its adapter", r.body)
		}
		if r := post(t, s, "/tokenize", `{"prompt":"a"}`, ""); !strings.Contains(string(r.body), `"max_model_len":8`) {
			t.Errorf("/tokenize %s: want max_model_len 8", r.body)
		}
	})
	t.Run("default", func(t *testing.T) {
		s := start(t, Config{Role: RoleDecode})
		if r := get(t, s, "/v1/models"); !strings.Contains(string(r.body), `"max_model_len":32768`) {
			t.Errorf("/v1/models %s: want vLLM's length of a small model, 32768", r.body)
		}
	})
}

// An SGLang engine refuses, with its flat 400, a prompt of its whole context
// or more, and a prompt and output limit that reach it (one token must stay
// free; a completion's limit is 16 when not given, chat's none), whatever
// its role; and lists the length at /v1/models as vLLM does.
func TestSGLangContextLength(t *testing.T) {
	const prompt = `"prompt":"a b c"` // 3 tokens
	tests := []struct {
		name, role, path, body string
		message                string // "": it fits, and the bootstrap check is next
	}{
		{"prompt and limit one short of it", RoleDecode, "/v1/completions", `{` + prompt + `,"max_tokens":4}`, ""},
		{"prompt and limit fill it", RoleDecode, "/v1/completions", `{` + prompt + `,"max_tokens":5}`,
			"Requested token count exceeds the model's maximum context length of 8 tokens. You requested a total of 8 tokens: " +
				"3 tokens from the input messages and 5 tokens for the completion. Please reduce the number of tokens in the input " +
				"messages or the completion to fit within the limit."},
		{"at a prefill", RolePrefill, "/v1/completions", `{` + prompt + `,"max_tokens":5}`, "You requested a total of 8 tokens"},
		{"a completion's default limit, 16", RoleDecode, "/v1/completions", `{` + prompt + `}`,
			"You requested a total of 19 tokens: 3 tokens from the input messages and 16 tokens for the completion."},
		{"a prompt of the whole context", RoleDecode, "/v1/completions", `{"prompt":"a b c d e f g h","max_tokens":1}`,
			"The input (8 tokens) is longer than the model's context length (8 tokens)."},
		{"chat without a limit", RoleDecode, "/v1/chat/completions", chat("hi", ""), ""},
		{"chat's max_completion_tokens", RoleDecode, "/v1/chat/completions", chat("hi", `,"max_completion_tokens":100`),
			"Requested token count exceeds the model's maximum context length of 8 tokens."},
		{"generate's max_new_tokens", RoleDecode, "/generate", `{"text":"a b c","sampling_params":{"max_new_tokens":5}}`,
			"You requested a total of 8 tokens: 3 tokens from the input messages and 5 tokens for the completion."},
		{"generate's max_new_tokens one short of it", RolePrefill, "/generate", `{"text":"a b c","sampling_params":{"max_new_tokens":4}}`, ""},
		{"generate without a limit", RoleDecode, "/generate", `{"text":"a b c"}`, ""},
		{"generate's prompt of the whole context", RoleDecode, "/generate", `{"input_ids":[1,2,3,4,5,6,7,8]}`,
			"The input (8 tokens) is longer than the model's context length (8 tokens)."},
		// Responses: max_new_tokens is max_output_tokens, at most max(context - prompt, 512), less 2.
		{"responses' limit, less 2, one short of it", RoleDecode, "/v1/responses", `{"input":"a b c","max_output_tokens":6}`, ""},
		{"responses' limit, less 2, that fills it", RoleDecode, "/v1/responses", `{"input":"a b c","max_output_tokens":7}`,
			"You requested a total of 8 tokens: 3 tokens from the input messages and 5 tokens for the completion."},
		{"responses without a limit: 512 less 2", RoleDecode, "/v1/responses", `{"input":"a b c"}`, "You requested a total of 513 tokens"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := start(t, Config{Role: tt.role, Protocol: ProtocolSGLang, MaxModelLen: 8})
			r := post(t, s, tt.path, tt.body, "")
			want := tt.message
			if want == "" {
				want = "bootstrap_room is required"
			}
			if r.status != 400 || !strings.HasPrefix(string(r.body), `{"object":"error","message":`) || !strings.Contains(string(r.body), want) ||
				!strings.Contains(string(r.body), `"type":"BadRequestError"`) {
				t.Errorf("%d %s, want SGLang's 400 with %q", r.status, r.body, want)
			}
		})
	}

	t.Run("listed", func(t *testing.T) {
		s := start(t, Config{Role: RoleDecode, Protocol: ProtocolSGLang, MaxModelLen: 8, LoRA: []string{"sql"}})
		if r := get(t, s, "/v1/models"); !strings.Contains(string(r.body), `"max_model_len":8`) || !strings.Contains(string(r.body), `"max_model_len":null`) {
			t.Errorf("/v1/models %s: want max_model_len 8 for pdsim, null for its adapter", r.body)
		}
	})
}

// SGLang's /v1/messages runs the request as a chat completion; a length the
// tokenizer manager refuses comes back as the chat handler's error answer,
// which the Anthropic handler turns into its own 500
// (AnthropicServing._handle_non_streaming). A stream has sent its 200 before
// the refusal, which then ends the connection without an event. A request
// that fits, and vLLM's /v1/messages, are as before.
func TestSGLangMessagesPastTheContext(t *testing.T) {
	const over = `,"max_tokens":7` // 3 prompt tokens + 7 > 8
	tests := []struct {
		name, protocol, body string
		status               int
		want                 string // the whole body; "": cut short
	}{
		{"sglang", ProtocolSGLang, chat("hi", over), 500, `{"type":"error","error":{"type":"internal_error","message":"Internal processing error"}}`},
		{"sglang, streamed", ProtocolSGLang, chat("hi", over+`,"stream":true`), 200, ""},
		{"sglang, fits", ProtocolSGLang, chat("hi", `,"max_tokens":4`), 400, `{"type":"error","error":{"type":"BadRequestError","message":"bootstrap_room is required for disaggregated serving"}}`},
		{"vllm", ProtocolNIXL, chat("hi", `,"max_tokens":9`), 400, `{"type":"error","error":{"type":"BadRequestError","message":"max_tokens=9 cannot be greater than max_model_len=8. Please request fewer output tokens."}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := start(t, Config{Protocol: tt.protocol, MaxModelLen: 8})
			r, err := do(context.Background(), s, "/v1/messages", tt.body, "")
			if tt.want == "" {
				if r.status != tt.status || r.header.Get("Content-Type") != "text/event-stream; charset=utf-8" || len(r.body) != 0 || err == nil {
					t.Errorf("%d %q %q (%v), want %d, an event stream, then the connection dropped", r.status, r.header.Get("Content-Type"), r.body, err, tt.status)
				}
				return
			}
			if err != nil || r.status != tt.status || string(r.body) != tt.want {
				t.Errorf("%d %s (%v), want %d %s", r.status, r.body, err, tt.status, tt.want)
			}
		})
	}
}
