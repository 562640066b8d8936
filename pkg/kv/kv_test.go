package kv

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Client bodies. Each smuggles reserved keys that must never reach an engine and
// carries a 20-digit seed that must reach it unchanged.
const (
	chatStream = `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true,` +
		`"stream_options":{"include_usage":true},"max_completion_tokens":256,"min_tokens":8,` +
		`"seed":98765432109876543210,"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"203.0.113.9"},` +
		`"bootstrap_room":1,"temperature":0.7,"bootstrap_room":2}`
	chatNoStream = `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_tokens":256,` +
		`"min_tokens":8,"bootstrap_host":"203.0.113.9","seed":98765432109876543210,"bootstrap_room":7,"bootstrap_room":8}`
	completionsStream = `{"model":"m","prompt":"Once upon","stream":true,"stream_options":{"include_usage":true},` +
		`"max_tokens":64,"min_tokens":2,"seed":98765432109876543210,"kv_transfer_params":{"do_remote_decode":false},` +
		`"bootstrap_port":1}`
	completionsNoStream = `{"model":"m","prompt":[1,2,3],"stream":false,"min_tokens":1,"seed":98765432109876543210,` +
		`"kv\u005ftransfer_params":{"do_remote_prefill":true},"bootstrap_room":3,"bootstrap_room":4}`
)

// Client bodies of the other APIs, smuggling the same way.
const (
	responsesStream = `{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"Hi"}],"stream":true,` +
		`"max_output_tokens":256,"store":true,"seed":98765432109876543210,"kv_transfer_params":{"do_remote_prefill":true},` +
		`"vllm_xargs":{"kv_transfer_params":"x","kind":"a"},"bootstrap_room":1}`
	generateNoStream = `{"token_ids":[1,2,3],"sampling_params":{"max_tokens":64,"min_tokens":8,"seed":98765432109876543210,` +
		`"extra_args":{"kv_transfer_params":{"remote_host":"203.0.113.9"},"other":1}},"kv_transfer_params":{"do_remote_prefill":true},"stream":false}`
	sglangGenerate = `{"text":"Once upon","sampling_params":{"max_new_tokens":64},"stream":true,"bootstrap_host":"203.0.113.9",` +
		`"seed":98765432109876543210,"bootstrap_room":7}`
)

const (
	// What the prefill engine is asked for, as vLLM's toy proxy sends it.
	nixlAsk = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,` +
		`"remote_block_ids":null,"remote_host":null,"remote_port":null}`
	// What a prefill engine answered: nested lists, keys we do not know, a big integer.
	prefillAnswer = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[11,12,13],[14]],` +
		`"remote_engine_id":"5b0c7a9e-0000-4000-8000-000000000001","remote_request_id":"chatcmpl-7f3d-a1b2c3d4",` +
		`"remote_host":"10.0.3.17","remote_port":5600,"tp_size":1,"remote_num_tokens":98765432109876543210,` +
		`"remote_blocks_expiry_time":null,"transfer_mode":"pull","future_key":{"x":[1.5e-3]}}`
)

const (
	// kv-mooncake's legs: the same transfer id, "xfer-" and the room in hex.
	mooncakeAsk  = `{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-7fffffffffffffff"}`
	mooncakePull = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_bootstrap_addr":"http://10.0.4.21:8998",` +
		`"remote_engine_id":"5b0c7a9e-0000-4000-8000-00000000000a","transfer_id":"xfer-7fffffffffffffff"}`
)

// handoff is the handoff of the client body in, a request of api a.
func handoff(t *testing.T, a *api.API, in string) *Handoff {
	t.Helper()
	o, err := body.Parse([]byte(in))
	if err != nil {
		t.Fatalf("Parse(%q): %v", in, err)
	}
	return &Handoff{
		Body:          o,
		Shape:         &a.Shape,
		PrefillHost:   "10.0.4.21",
		BootstrapPort: 8998,
		Room:          1<<63 - 1,
		EngineID:      "5b0c7a9e-0000-4000-8000-00000000000a",
		PrefillKV:     []byte(prefillAnswer),
	}
}

func TestLegBodies(t *testing.T) {
	tests := []struct {
		name      string
		connector string
		api       *api.API // api.Chat when nil
		in        string
		prefill   string
		decode    string
	}{
		// kv-nixl: prefill capped and asked to keep the blocks; decode is the
		// client's body plus the prefill's answer.
		{
			name: "nixl/chat/stream", connector: NIXL, in: chatStream,
			prefill: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_completion_tokens":1,"min_tokens":1,` +
				`"seed":98765432109876543210,"kv_transfer_params":` + nixlAsk + `,"temperature":0.7,"max_tokens":1}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_completion_tokens":256,"min_tokens":8,"seed":98765432109876543210,"kv_transfer_params":` + prefillAnswer +
				`,"temperature":0.7}`,
		},
		{
			name: "nixl/chat/no-stream", connector: NIXL, in: chatNoStream,
			prefill: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_tokens":1,"min_tokens":1,` +
				`"seed":98765432109876543210,"kv_transfer_params":` + nixlAsk + `}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_tokens":256,"min_tokens":8,` +
				`"seed":98765432109876543210,"kv_transfer_params":` + prefillAnswer + `}`,
		},
		{
			name: "nixl/completions/stream", connector: NIXL, in: completionsStream,
			prefill: `{"model":"m","prompt":"Once upon","stream":false,"max_tokens":1,"min_tokens":1,"seed":98765432109876543210,` +
				`"kv_transfer_params":` + nixlAsk + `}`,
			decode: `{"model":"m","prompt":"Once upon","stream":true,"stream_options":{"include_usage":true},"max_tokens":64,` +
				`"min_tokens":2,"seed":98765432109876543210,"kv_transfer_params":` + prefillAnswer + `}`,
		},
		{
			name: "nixl/completions/no-stream", connector: NIXL, in: completionsNoStream,
			prefill: `{"model":"m","prompt":[1,2,3],"stream":false,"min_tokens":1,"seed":98765432109876543210,` +
				`"kv\u005ftransfer_params":` + nixlAsk + `,"max_tokens":1}`,
			decode: `{"model":"m","prompt":[1,2,3],"stream":false,"min_tokens":1,"seed":98765432109876543210,` +
				`"kv\u005ftransfer_params":` + prefillAnswer + `}`,
		},
		// kv-mooncake: prefill capped and asked to keep the blocks for the
		// transfer id; decode names the id, the bootstrap server and the engine.
		{
			name: "mooncake/chat/stream", connector: Mooncake, in: chatStream,
			prefill: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_completion_tokens":1,"min_tokens":1,` +
				`"seed":98765432109876543210,"kv_transfer_params":` + mooncakeAsk + `,"temperature":0.7,"max_tokens":1}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_completion_tokens":256,"min_tokens":8,"seed":98765432109876543210,"kv_transfer_params":` + mooncakePull +
				`,"temperature":0.7}`,
		},
		{
			name: "mooncake/generate", connector: Mooncake, api: api.Generate, in: generateNoStream,
			prefill: `{"token_ids":[1,2,3],"sampling_params":{"max_tokens":1,"min_tokens":1,"seed":98765432109876543210,` +
				`"extra_args":{"kv_transfer_params":` + mooncakeAsk + `,"other":1}},"stream":false}`,
			decode: `{"token_ids":[1,2,3],"sampling_params":{"max_tokens":64,"min_tokens":8,"seed":98765432109876543210,` +
				`"extra_args":{"kv_transfer_params":` + mooncakePull + `,"other":1}},"stream":false}`,
		},
		// kv-shared-storage: prefill capped, nothing about the handoff in either body.
		{
			name: "shared-storage/chat/stream", connector: SharedStorage, in: chatStream,
			prefill: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_completion_tokens":1,"min_tokens":1,` +
				`"seed":98765432109876543210,"temperature":0.7,"max_tokens":1}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_completion_tokens":256,"min_tokens":8,"seed":98765432109876543210,"temperature":0.7}`,
		},
		{
			name: "shared-storage/chat/no-stream", connector: SharedStorage, in: chatNoStream,
			prefill: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_tokens":1,"min_tokens":1,` +
				`"seed":98765432109876543210}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_tokens":256,"min_tokens":8,` +
				`"seed":98765432109876543210}`,
		},
		{
			name: "shared-storage/completions/stream", connector: SharedStorage, in: completionsStream,
			prefill: `{"model":"m","prompt":"Once upon","stream":false,"max_tokens":1,"min_tokens":1,"seed":98765432109876543210}`,
			decode: `{"model":"m","prompt":"Once upon","stream":true,"stream_options":{"include_usage":true},"max_tokens":64,` +
				`"min_tokens":2,"seed":98765432109876543210}`,
		},
		{
			name: "shared-storage/completions/no-stream", connector: SharedStorage, in: completionsNoStream,
			prefill: `{"model":"m","prompt":[1,2,3],"stream":false,"min_tokens":1,"seed":98765432109876543210,"max_tokens":1}`,
			decode:  `{"model":"m","prompt":[1,2,3],"stream":false,"min_tokens":1,"seed":98765432109876543210}`,
		},
		// kv-sglang: the same body on both legs, prefill not capped, our bootstrap
		// fields in place of the client's.
		{
			name: "sglang/chat/stream", connector: SGLang, in: chatStream,
			prefill: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_completion_tokens":256,"min_tokens":8,"seed":98765432109876543210,"bootstrap_room":9223372036854775807,` +
				`"temperature":0.7,"bootstrap_host":"10.0.4.21","bootstrap_port":8998}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_completion_tokens":256,"min_tokens":8,"seed":98765432109876543210,"bootstrap_room":9223372036854775807,` +
				`"temperature":0.7,"bootstrap_host":"10.0.4.21","bootstrap_port":8998}`,
		},
		{
			name: "sglang/chat/no-stream", connector: SGLang, in: chatNoStream,
			prefill: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_tokens":256,"min_tokens":8,` +
				`"bootstrap_host":"10.0.4.21","seed":98765432109876543210,"bootstrap_room":9223372036854775807,"bootstrap_port":8998}`,
			decode: `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":false,"max_tokens":256,"min_tokens":8,` +
				`"bootstrap_host":"10.0.4.21","seed":98765432109876543210,"bootstrap_room":9223372036854775807,"bootstrap_port":8998}`,
		},
		{
			name: "sglang/completions/stream", connector: SGLang, in: completionsStream,
			prefill: `{"model":"m","prompt":"Once upon","stream":true,"stream_options":{"include_usage":true},"max_tokens":64,` +
				`"min_tokens":2,"seed":98765432109876543210,"bootstrap_port":8998,"bootstrap_host":"10.0.4.21",` +
				`"bootstrap_room":9223372036854775807}`,
			decode: `{"model":"m","prompt":"Once upon","stream":true,"stream_options":{"include_usage":true},"max_tokens":64,` +
				`"min_tokens":2,"seed":98765432109876543210,"bootstrap_port":8998,"bootstrap_host":"10.0.4.21",` +
				`"bootstrap_room":9223372036854775807}`,
		},
		{
			name: "sglang/completions/no-stream", connector: SGLang, in: completionsNoStream,
			prefill: `{"model":"m","prompt":[1,2,3],"stream":false,"min_tokens":1,"seed":98765432109876543210,` +
				`"bootstrap_room":9223372036854775807,"bootstrap_host":"10.0.4.21","bootstrap_port":8998}`,
			decode: `{"model":"m","prompt":[1,2,3],"stream":false,"min_tokens":1,"seed":98765432109876543210,` +
				`"bootstrap_room":9223372036854775807,"bootstrap_host":"10.0.4.21","bootstrap_port":8998}`,
		},
		// The Responses API: its own limit and storage caps, the params at the top level.
		{
			name: "nixl/responses/stream", connector: NIXL, api: api.Responses, in: responsesStream,
			prefill: `{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"Hi"}],"stream":false,"max_output_tokens":1,` +
				`"store":false,"seed":98765432109876543210,"kv_transfer_params":` + nixlAsk + `,"vllm_xargs":{"kind":"a"},"background":false,"ignore_eos":true}`,
			decode: `{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"Hi"}],"stream":true,"max_output_tokens":256,` +
				`"store":true,"seed":98765432109876543210,"kv_transfer_params":` + prefillAnswer + `,"vllm_xargs":{"kind":"a"}}`,
		},
		{
			name: "shared-storage/responses/stream", connector: SharedStorage, api: api.Responses, in: responsesStream,
			prefill: `{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"Hi"}],"stream":false,"max_output_tokens":1,` +
				`"store":false,"seed":98765432109876543210,"vllm_xargs":{"kind":"a"},"background":false,"ignore_eos":true}`,
			decode: `{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"Hi"}],"stream":true,"max_output_tokens":256,` +
				`"store":true,"seed":98765432109876543210,"vllm_xargs":{"kind":"a"}}`,
		},
		// vLLM's token-in generate: limits and params inside sampling_params,
		// the client's in both places gone.
		{
			name: "nixl/generate/no-stream", connector: NIXL, api: api.Generate, in: generateNoStream,
			prefill: `{"token_ids":[1,2,3],"sampling_params":{"max_tokens":1,"min_tokens":1,"seed":98765432109876543210,"extra_args":{"kv_transfer_params":` +
				nixlAsk + `,"other":1}},"stream":false}`,
			decode: `{"token_ids":[1,2,3],"sampling_params":{"max_tokens":64,"min_tokens":8,"seed":98765432109876543210,"extra_args":{"kv_transfer_params":` +
				prefillAnswer + `,"other":1}},"stream":false}`,
		},
		{
			name: "shared-storage/generate/no-stream", connector: SharedStorage, api: api.Generate, in: generateNoStream,
			prefill: `{"token_ids":[1,2,3],"sampling_params":{"max_tokens":1,"min_tokens":1,"seed":98765432109876543210,"extra_args":{"other":1}},"stream":false}`,
			decode:  `{"token_ids":[1,2,3],"sampling_params":{"max_tokens":64,"min_tokens":8,"seed":98765432109876543210,"extra_args":{"other":1}},"stream":false}`,
		},
		// SGLang's native generate: the bootstrap fields at the top level, as on chat.
		{
			name: "sglang/generate/stream", connector: SGLang, api: api.SGLangGenerate, in: sglangGenerate,
			prefill: `{"text":"Once upon","sampling_params":{"max_new_tokens":64},"stream":true,"bootstrap_host":"10.0.4.21",` +
				`"seed":98765432109876543210,"bootstrap_room":9223372036854775807,"bootstrap_port":8998}`,
			decode: `{"text":"Once upon","sampling_params":{"max_new_tokens":64},"stream":true,"bootstrap_host":"10.0.4.21",` +
				`"seed":98765432109876543210,"bootstrap_room":9223372036854775807,"bootstrap_port":8998}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Build(tt.connector)
			if err != nil {
				t.Fatal(err)
			}
			a := tt.api
			if a == nil {
				a = api.Chat // chat and completions have one shape
			}
			h := handoff(t, a, tt.in)
			if got := PrefillBody(c, h).Bytes(); string(got) != tt.prefill {
				t.Errorf("prefill body =\n%s\nwant\n%s", got, tt.prefill)
			}
			if got := DecodeBody(c, h).Bytes(); string(got) != tt.decode {
				t.Errorf("decode body =\n%s\nwant\n%s", got, tt.decode)
			}
			if string(h.Body.Bytes()) != tt.in {
				t.Errorf("building the legs changed the client's body to %s", h.Body.Bytes())
			}
		})
	}
}

func TestNIXLDecodeCarriesPrefillParams(t *testing.T) {
	const in = `{"model":"m","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"203.0.113.9"},"stream":true}`
	const without = `{"model":"m","stream":true}`
	tests := []struct {
		name      string
		prefillKV []byte
		want      string
	}{
		{
			name:      "params copied byte for byte",
			prefillKV: []byte(prefillAnswer),
			want:      `{"model":"m","kv_transfer_params":` + prefillAnswer + `,"stream":true}`,
		},
		{
			name:      "whitespace inside the params kept",
			prefillKV: []byte("{\n  \"remote_block_ids\": [ [1, 2] ],\n  \"remote_port\": 5600\n}"),
			want:      "{\"model\":\"m\",\"kv_transfer_params\":{\n  \"remote_block_ids\": [ [1, 2] ],\n  \"remote_port\": 5600\n},\"stream\":true}",
		},
		{
			name:      "vLLM's do_remote_decode, false, left as it came",
			prefillKV: []byte(`{"do_remote_prefill": true, "do_remote_decode" : false, "remote_port": 5600}`),
			want:      `{"model":"m","kv_transfer_params":{"do_remote_prefill": true, "do_remote_decode" : false, "remote_port": 5600},"stream":true}`,
		},
		{
			name:      "a do_remote_decode given twice, true last (which vLLM reads), is made one false",
			prefillKV: []byte(`{"do_remote_decode":false,"do_remote_prefill":true,"do_remote_decode":true}`),
			want:      `{"model":"m","kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true},"stream":true}`,
		},
		{
			name:      "a do_remote_decode handed back is made false",
			prefillKV: []byte(`{"do_remote_prefill":true,"do_remote_decode":true,"remote_port":5600}`),
			want:      `{"model":"m","kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_port":5600},"stream":true}`,
		},
		// No params from the prefill: the decode engine recomputes, and the
		// client's do_remote_prefill:true must not reach it either.
		{name: "nil params", prefillKV: nil, want: without},
		{name: "empty params", prefillKV: []byte{}, want: without},
		{name: "null params", prefillKV: []byte("null"), want: without},
		{name: "empty object params", prefillKV: []byte("{}"), want: without},
		{name: "empty object params with whitespace", prefillKV: []byte(" { \n } "), want: without},
	}
	c, _ := Build(NIXL)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := handoff(t, api.Chat, in)
			h.PrefillKV = tt.prefillKV
			if got := DecodeBody(c, h).Bytes(); string(got) != tt.want {
				t.Fatalf("decode body =\n%s\nwant\n%s", got, tt.want)
			}
		})
	}
}

func TestSGLangBootstrapFields(t *testing.T) {
	tests := []struct {
		name, host string
		port       int
		room       uint64
		want       string
	}{
		{
			name: "IPv4", host: "10.0.4.21", port: 8998, room: 4611686018427388111,
			want: `{"model":"m","bootstrap_host":"10.0.4.21","bootstrap_port":8998,"bootstrap_room":4611686018427388111}`,
		},
		{
			name: "IPv6 in brackets", host: "[fd00::1]", port: 30001, room: 0,
			want: `{"model":"m","bootstrap_host":"[fd00::1]","bootstrap_port":30001,"bootstrap_room":0}`,
		},
		{
			name: "largest room", host: "p-0.prefill", port: 1, room: 1<<63 - 1,
			want: `{"model":"m","bootstrap_host":"p-0.prefill","bootstrap_port":1,"bootstrap_room":9223372036854775807}`,
		},
	}
	c, _ := Build(SGLang)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := body.Parse([]byte(`{"model":"m"}`))
			if err != nil {
				t.Fatal(err)
			}
			h := &Handoff{Body: o, Shape: &api.Chat.Shape, PrefillHost: tt.host, BootstrapPort: tt.port, Room: tt.room}
			prefill, decode := PrefillBody(c, h).Bytes(), DecodeBody(c, h).Bytes()
			if string(prefill) != tt.want || string(decode) != tt.want {
				t.Fatalf("legs =\n%s\n%s\nwant both\n%s", prefill, decode, tt.want)
			}
			// SGLang computes bootstrap_room % dp_size: it must be a JSON integer.
			var fields struct {
				BootstrapRoom json.RawMessage `json:"bootstrap_room"`
			}
			if err := json.Unmarshal(decode, &fields); err != nil {
				t.Fatal(err)
			}
			if n, err := json.Number(fields.BootstrapRoom).Int64(); err != nil || uint64(n) != tt.room {
				t.Fatalf("bootstrap_room = %s, want the integer %d", fields.BootstrapRoom, tt.room)
			}
		})
	}
}

func TestScrubbed(t *testing.T) {
	tests := []struct {
		name string
		api  *api.API
		in   string
		want string
	}{
		{
			name: "every reserved key and every duplicate removed",
			api:  api.Chat,
			in: `{"bootstrap_host":"a","model":"m","kv_transfer_params":{},"bootstrap_port":1,"bootstrap_room":1,` +
				`"stream":true,"kv\u005ftransfer_params":null,"bootstrap_room":2}`,
			want: `{"model":"m","stream":true}`,
		},
		{
			name: "vllm_xargs cannot carry kv_transfer_params into vLLM's extra_args",
			api:  api.Completions,
			in:   `{"model":"m","vllm_xargs":{"kv_transfer_params":"x","a":1,"kv_transfer_params":"y"}}`,
			want: `{"model":"m","vllm_xargs":{"a":1}}`,
		},
		{
			name: "other nested reserved keys are the client's business",
			api:  api.Chat,
			in:   `{"model":"m","metadata":{"kv_transfer_params":1,"bootstrap_room":2}}`,
			want: `{"model":"m","metadata":{"kv_transfer_params":1,"bootstrap_room":2}}`,
		},
		{
			name: "a body with only reserved keys",
			api:  api.Chat,
			in:   `{"bootstrap_room":1}`,
			want: `{}`,
		},
		{
			name: "generate: in sampling_params.extra_args and at the top level",
			api:  api.Generate,
			in:   `{"token_ids":[1],"sampling_params":{"extra_args":{"kv_transfer_params":{"do_remote_prefill":true}}},"kv_transfer_params":{}}`,
			want: `{"token_ids":[1],"sampling_params":{"extra_args":{}}}`,
		},
		{
			name: "pass-through: the top-level handoff fields",
			api:  passthrough(t),
			in:   `{"model":"m","input":"x","bootstrap_room":1,"vllm_xargs":{"kv_transfer_params":"x"}}`,
			want: `{"model":"m","input":"x","vllm_xargs":{"kv_transfer_params":"x"}}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := body.Parse([]byte(tt.in))
			if err != nil {
				t.Fatal(err)
			}
			c, _ := Build(NIXL)
			if got := Scrubbed(c, o, &tt.api.Shape).Bytes(); string(got) != tt.want {
				t.Fatalf("Scrubbed = %s, want %s", got, tt.want)
			}
		})
	}

	t.Run("a clean body is not copied", func(t *testing.T) {
		in := []byte(`{"model":"m","messages":[]}`)
		o, err := body.Parse(in)
		if err != nil {
			t.Fatal(err)
		}
		c, _ := Build(SGLang)
		if got := Scrubbed(c, o, &api.Chat.Shape).Bytes(); &got[0] != &in[0] {
			t.Fatalf("Scrubbed copied a body with nothing to remove")
		}
	})
}

// passthrough is the API of the default pass-through list.
func passthrough(t *testing.T) *api.API {
	t.Helper()
	routes, err := api.ParseRoutes("routes.passthrough", api.DefaultPassthrough)
	if err != nil {
		t.Fatal(err)
	}
	a, err := api.NewTable(routes).Match("POST", "/v1/embeddings")
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func TestBuild(t *testing.T) {
	// What the pipeline, scheduling and config ask of each connector.
	type properties struct {
		family                  api.Family
		dispatch                Dispatch
		paired, handsBackParams bool
		rendezvous              Rendezvous
		repeatedPull            bool // a second pull goes wrong (RepeatedPull says how)
	}
	tests := []struct {
		name string
		want properties
	}{
		{name: "kv-nixl", want: properties{family: api.VLLM, dispatch: Sequential, handsBackParams: true, repeatedPull: true}},
		{name: "kv-shared-storage", want: properties{family: api.VLLM, dispatch: Sequential}},
		{name: "kv-sglang", want: properties{family: api.SGLang, dispatch: Concurrent, paired: true, rendezvous: SGLangBootstrapPort, repeatedPull: true}},
		{name: "kv-mooncake", want: properties{family: api.VLLM, dispatch: Concurrent, rendezvous: MooncakeEngineIDs, repeatedPull: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Build(tt.name)
			if err != nil {
				t.Fatalf("Build(%q): %v", tt.name, err)
			}
			if got := (properties{c.Family(), c.Dispatch(), c.Paired(), c.HandsBackParams(), c.Rendezvous(), c.RepeatedPull() != ""}); got != tt.want {
				t.Fatalf("Build(%q) = %+v, want %+v", tt.name, got, tt.want)
			}
		})
	}

	for _, name := range []string{"", "bogus", "KV-NIXL", "nixl", " kv-nixl"} {
		t.Run("unknown "+name, func(t *testing.T) {
			c, err := Build(name)
			if err == nil {
				t.Fatalf("Build(%q) = %v, want an error", name, c)
			}
			for _, want := range []string{name, NIXL, SharedStorage, SGLang, Mooncake} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Build(%q) error %q does not name %q", name, err, want)
				}
			}
		})
	}
}

func TestSequentialIsTheZeroDispatch(t *testing.T) {
	// A zero Dispatch must never launch a prefill concurrently by accident.
	var d Dispatch
	if d != Sequential || Sequential == Concurrent {
		t.Fatalf("zero Dispatch = %v, want Sequential (%v) distinct from Concurrent (%v)", d, Sequential, Concurrent)
	}
}

func TestHasParams(t *testing.T) {
	for raw, want := range map[string]bool{
		"": false, "null": false, " null ": false, "{}": false, "{ \n\t}": false, "{": true,
		`{"do_remote_prefill":true}`: true, "[]": true, `"x"`: true,
	} {
		if got := HasParams([]byte(raw)); got != want {
			t.Errorf("HasParams(%q) = %v, want %v", raw, got, want)
		}
	}
	if !bytes.Equal(nixlPrefillParams, []byte(nixlAsk)) {
		t.Errorf("nixl prefill params = %s, want %s", nixlPrefillParams, nixlAsk)
	}
}
