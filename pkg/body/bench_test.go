package body_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// Benchmarks compare our byte splicing with the obvious alternative, encoding/json
// into map[string]any and back, on chat bodies of growing size. Each pair runs in
// the same process so the ratio is meaningful:
//
//	go test -run='^$' -bench=. -benchmem ./pkg/body/

var benchSizes = []struct {
	name string
	n    int
}{
	{"1KiB", 1 << 10},
	{"64KiB", 64 << 10},
	{"1MiB", 1 << 20},
	{"English-1MiB", 1 << 20}, // English text and code; the others are multilingual
	{"8MiB", 8 << 20},
}

// Conversation text of the benchmark bodies: a multilingual one, a third of
// its bytes non-ASCII with an escape every 15 bytes (the hard case for a
// scanner), and an English one with code, as most long prompts are.
var (
	multilingual = "Voici le rapport trimestriel — revenue rose 12% “year over year”.\n" +
		"```go\nfmt.Println(\"hello\\tworld\")\n```\n日本語のテキストも含まれます。 "
	english = "The quarterly report shows revenue rose 12 percent year over year, driven by the " +
		"inference platform; the attached function computes the weighted average of the latencies. " +
		"func avg(xs []float64) float64 { s := 0.0; for _, x := range xs { s += x }; return s / float64(len(xs)) }\n"
)

// chatBody returns a chat completions body of about size bytes: a long
// conversation followed by the usual parameters.
func chatBody(size int) []byte { return chatBodyOf(multilingual, size) }

// sizedBody is the body of one benchSizes entry.
func sizedBody(name string, size int) []byte {
	if strings.HasPrefix(name, "English") {
		return chatBodyOf(english, size)
	}
	return chatBody(size)
}

func chatBodyOf(turn string, size int) []byte {
	const tail = `],"stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":512,` +
		`"temperature":0.7,"top_p":0.95,"n":1,"seed":1234567890,"user":"u-42"}`
	var b strings.Builder
	b.WriteString(`{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[`)
	b.WriteString(`{"role":"system","content":"You are a helpful assistant."}`)
	roles := [2]string{"user", "assistant"}
	for i := 0; b.Len()+len(tail) < size; i++ {
		quoted, _ := json.Marshal(strings.Repeat(turn, 16)) // about 2.5 KiB per turn
		room := size - b.Len() - len(tail) - len(`,{"role":"assistant","content":}`)
		if room < len(quoted) {
			quoted, _ = json.Marshal(strings.Repeat(".", max(room-2, 0)))
		}
		fmt.Fprintf(&b, `,{"role":%q,"content":%s}`, roles[i%2], quoted)
	}
	b.WriteString(tail)
	return []byte(b.String())
}

var sink int

func BenchmarkReadRoutingFields(b *testing.B) {
	for _, size := range benchSizes {
		in := sizedBody(size.name, size.n)
		b.Run(size.name+"/splice", func(b *testing.B) {
			b.SetBytes(int64(len(in)))
			for b.Loop() {
				o, err := body.Parse(in)
				if err != nil {
					b.Fatal(err)
				}
				model, _ := o.String("model")
				n, _ := o.Int("n")
				messages, _ := o.Raw("messages")
				sink += len(model) + len(messages) + int(n)
			}
		})
		b.Run(size.name+"/map", func(b *testing.B) {
			b.SetBytes(int64(len(in)))
			for b.Loop() {
				var m map[string]any
				if err := json.Unmarshal(in, &m); err != nil {
					b.Fatal(err)
				}
				model, _ := m["model"].(string)
				n, _ := m["n"].(float64)
				messages, _ := m["messages"].([]any)
				size := 0
				for _, msg := range messages {
					content, _ := msg.(map[string]any)["content"].(string)
					size += len(content)
				}
				sink += len(model) + size + int(n)
			}
		})
	}
}

// A realistic NIXL prefill answer, as the decode leg carries it.
var prefillAnswer = []byte(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[11,12,13,14,15,16,17,18]],` +
	`"remote_engine_id":"5b0c7a9e-0000-4000-8000-000000000001","remote_request_id":"chatcmpl-7f3d0b6a-a1b2c3d4",` +
	`"remote_host":"10.0.3.17","remote_port":5600,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":318,` +
	`"remote_blocks_expiry_time":null,"transfer_mode":"pull"}`)

// BenchmarkEdit builds both legs of one request: parse once, then the prefill and
// the decode body. splice builds each leg as extproc sends it, the client's
// bytes with the edits between them (FULL_DUPLEX replies and the prefill client
// send the pieces); joined also copies each leg into one buffer, as a BUFFERED
// reply needs. The map variant decodes once and marshals each leg from a copy.
func BenchmarkEdit(b *testing.B) {
	for _, name := range []string{kv.NIXL, kv.SharedStorage, kv.SGLang} {
		c, err := kv.Build(name)
		if err != nil {
			b.Fatal(err)
		}
		short := strings.TrimPrefix(name, "kv-")
		for _, size := range benchSizes {
			in := sizedBody(size.name, size.n)
			for _, variant := range []struct {
				name string
				size func(body.Spliced) int
			}{
				{"splice", body.Spliced.Len},
				{"joined", func(s body.Spliced) int { return len(s.Bytes()) }},
			} {
				b.Run(short+"/"+size.name+"/"+variant.name, func(b *testing.B) {
					b.SetBytes(int64(len(in)))
					for b.Loop() {
						o, err := body.Parse(in)
						if err != nil {
							b.Fatal(err)
						}
						h := &kv.Handoff{Body: o, Shape: &api.Chat.Shape, PrefillHost: "10.0.4.21", BootstrapPort: 8998, Room: 4611686018427388111, PrefillKV: prefillAnswer}
						sink += variant.size(kv.PrefillBody(c, h)) + variant.size(kv.DecodeBody(c, h))
					}
				})
			}
			b.Run(short+"/"+size.name+"/map", func(b *testing.B) {
				b.SetBytes(int64(len(in)))
				for b.Loop() {
					var m map[string]any
					if err := json.Unmarshal(in, &m); err != nil {
						b.Fatal(err)
					}
					prefill, decode := mapLegs(name, m)
					p, err := json.Marshal(prefill)
					if err != nil {
						b.Fatal(err)
					}
					d, err := json.Marshal(decode)
					if err != nil {
						b.Fatal(err)
					}
					sink += len(p) + len(d)
				}
			})
		}
	}
}

// mapLegs is what the connectors do, written against a decoded map.
func mapLegs(connector string, client map[string]any) (prefill, decode map[string]any) {
	prefill, decode = maps.Clone(client), maps.Clone(client)
	for _, k := range []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"} {
		delete(prefill, k)
		delete(decode, k)
	}
	capPrefill := func() {
		prefill["stream"] = false
		delete(prefill, "stream_options")
		prefill["max_tokens"] = 1
		if _, ok := prefill["max_completion_tokens"]; ok {
			prefill["max_completion_tokens"] = 1
		}
		delete(prefill, "min_tokens")
		delete(prefill, "min_completion_tokens")
	}
	switch connector {
	case kv.NIXL:
		capPrefill()
		prefill["kv_transfer_params"] = map[string]any{
			"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
			"remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
		}
		decode["kv_transfer_params"] = json.RawMessage(prefillAnswer)
	case kv.SharedStorage:
		capPrefill()
	case kv.SGLang:
		for _, leg := range []map[string]any{prefill, decode} {
			leg["bootstrap_host"] = "10.0.4.21"
			leg["bootstrap_port"] = 8998
			leg["bootstrap_room"] = uint64(4611686018427388111)
		}
	}
	return prefill, decode
}

// BenchmarkValidate splits Parse's cost: the one-pass validation it starts with
// (utf8.Valid then json.Valid) and the whole Parse.
func BenchmarkValidate(b *testing.B) {
	for _, size := range benchSizes {
		in := sizedBody(size.name, size.n)
		for _, step := range []struct {
			name string
			run  func() bool
		}{
			{"utf8.Valid", func() bool { return utf8.Valid(in) }},
			{"json.Valid", func() bool { return json.Valid(in) }},
			{"Parse", func() bool { _, err := body.Parse(in); return err == nil }},
		} {
			b.Run(size.name+"/"+step.name, func(b *testing.B) {
				b.SetBytes(int64(len(in)))
				for b.Loop() {
					if !step.run() {
						b.Fatal("invalid body")
					}
				}
			})
		}
	}
}

func TestBenchBodiesAreValidAndSized(t *testing.T) {
	for _, size := range benchSizes {
		in := chatBody(size.n)
		if _, err := body.Parse(in); err != nil {
			t.Fatalf("%s body: %v", size.name, err)
		}
		if d := len(in) - size.n; d < -64 || d > 64 {
			t.Errorf("%s body is %d bytes, want about %d", size.name, len(in), size.n)
		}
	}
}
