package kv

import (
	"encoding/json"
	"maps"
	"reflect"
	"testing"
	"unicode/utf8"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// FuzzLegs checks every connector's legs, for each API it disaggregates,
// against what an engine reads (Python's json: the last duplicate wins): the
// client's body minus the reserved fields, plus exactly the connector's
// fields where that API reads them. Whatever the client sends, a reserved
// field on a leg is always ours.
func FuzzLegs(f *testing.F) {
	for _, in := range []string{chatStream, chatNoStream, completionsStream, completionsNoStream, responsesStream, generateNoStream, `{}`} {
		for which := range uint8(4) {
			f.Add([]byte(in), []byte(prefillAnswer), "10.0.4.21", 8998, uint64(1<<63-1), which)
		}
	}
	f.Add([]byte(`{"max_completion_tokens":null,"min_completion_tokens":3}`), []byte("null"), "[fd00::1]", 0, uint64(0), uint8(0))
	f.Add([]byte(`{"bootstrap_host":"x","bootstrap_host":"y"}`), []byte(" {} "), "h\"\x01\xff", 65535, uint64(42), uint8(3))
	f.Add([]byte(`{"sampling_params":{"extra_args":[1]},"sampling_params":{"extra_args":{"kv_transfer_params":1},"min_tokens":2}}`),
		[]byte(prefillAnswer), "h", 1, uint64(1), uint8(2))
	f.Add([]byte(`{"vllm_xargs":{"kv_transfer_params":"x","a":1},"store":true,"background":true}`), []byte(prefillAnswer), "h", 1, uint64(1), uint8(1))
	f.Add([]byte(`{"rid":"a","routed_dp_rank":1,"data_parallel_rank":2,"disagg_prefill_dp_rank":3,"bootstrap_pair_key":"k",`+
		`"decode_tp_size":8,"kv_router_hint":{},"rid":"b","vllm_xargs":{"kv_transfer_params":"x"}}`), []byte(prefillAnswer), "h", 1, uint64(1), uint8(3))

	f.Fuzz(func(t *testing.T, in, prefillKV []byte, host string, port int, room uint64, which uint8) {
		o, err := body.Parse(in)
		if err != nil {
			return
		}
		if !json.Valid(prefillKV) || !utf8.Valid(prefillKV) {
			prefillKV = nil // the pipeline hands over parsed JSON or nothing
		}
		a := []*api.API{api.Chat, api.Responses, api.Generate, api.SGLangGenerate}[which%4]
		h := &Handoff{Body: o, Shape: &a.Shape, PrefillHost: host, BootstrapPort: port & 0xffff, Room: room &^ (1 << 63), PrefillKV: prefillKV}

		// What each family's engines may read of the client's body: all of
		// it but the reserved fields (reserved_test.go), which no leg keeps.
		clientFor := func(family api.Family) map[string]any {
			m := decode(t, in)
			top, inExtraArgs := reservedOf(family, &a.Shape)
			for _, k := range top {
				delete(m, k)
			}
			for _, k := range inExtraArgs {
				deleteIn(m, a.Shape.ExtraArgs, k)
			}
			return m
		}
		client := clientFor(api.VLLM)
		paramsIn := []string(nil)
		if a == api.Generate {
			paramsIn = []string{"sampling_params", "extra_args"}
		}
		with := func(fields map[string]any, inner ...func(map[string]any)) map[string]any {
			m := deepClone(client)
			for k, v := range fields {
				if v == nil {
					delete(m, k)
				} else {
					m[k] = v
				}
			}
			for _, edit := range inner {
				edit(m)
			}
			return m
		}
		params := func(v []byte) func(map[string]any) {
			return func(m map[string]any) { setIn(m, paramsIn, "kv_transfer_params", enginetest.Decode(t, v)) }
		}
		one := json.Number("1")
		var capsFields map[string]any
		var capsInner []func(map[string]any)
		switch a {
		case api.Chat:
			capsFields = map[string]any{"stream": false, "stream_options": nil, "max_tokens": one, "min_tokens": one, "min_completion_tokens": nil}
			if _, ok := client["max_completion_tokens"]; ok {
				capsFields["max_completion_tokens"] = one
			}
		case api.Responses:
			capsFields = map[string]any{"stream": false, "stream_options": nil, "max_output_tokens": one, "store": false, "background": false, "ignore_eos": true}
		case api.Generate:
			capsFields = map[string]any{"stream": false, "stream_options": nil}
			capsInner = append(capsInner, func(m map[string]any) {
				setIn(m, []string{"sampling_params"}, "max_tokens", one)
				setIn(m, []string{"sampling_params"}, "min_tokens", one)
			})
		}
		sharedPrefill := with(capsFields, capsInner...)
		nixlPrefill := with(capsFields, append(capsInner, params(nixlPrefillParams))...)
		nixlDecode := client
		if HasParams(prefillKV) {
			nixlDecode = with(nil, params(prefillKV))
		}
		vllmClient := client
		client = clientFor(api.SGLang) // the base of with from here on
		bootstrap := with(map[string]any{
			"bootstrap_host": enginetest.Decode(t, body.Quote(host)),
			"bootstrap_port": enginetest.Decode(t, body.Uint(uint64(h.BootstrapPort))),
			"bootstrap_room": enginetest.Decode(t, body.Uint(h.Room)),
		})

		type legs struct {
			connector       string
			prefill, decode map[string]any
		}
		var cases []legs
		if a.Pairs.Has(api.VLLM) {
			cases = append(cases, legs{NIXL, nixlPrefill, nixlDecode}, legs{SharedStorage, sharedPrefill, vllmClient})
		}
		if a.Pairs.Has(api.SGLang) {
			cases = append(cases, legs{SGLang, bootstrap, bootstrap})
		}
		for _, tt := range cases {
			c, err := Build(tt.connector)
			if err != nil {
				t.Fatal(err)
			}
			if got := decode(t, PrefillBody(c, h).Bytes()); !reflect.DeepEqual(got, tt.prefill) {
				t.Fatalf("%s %s prefill leg of %q reads as\n%v\nwant\n%v", tt.connector, a.Name, in, got, tt.prefill)
			}
			if got := decode(t, DecodeBody(c, h).Bytes()); !reflect.DeepEqual(got, tt.decode) {
				t.Fatalf("%s %s decode leg of %q reads as\n%v\nwant\n%v", tt.connector, a.Name, in, got, tt.decode)
			}
		}
		for _, name := range []string{NIXL, SharedStorage, SGLang} {
			c, _ := Build(name)
			if !a.Serves.Has(c.Family()) {
				continue
			}
			if got, want := decode(t, Scrubbed(c, o, &a.Shape).Bytes()), clientFor(c.Family()); !reflect.DeepEqual(got, want) {
				t.Fatalf("%s: Scrubbed(%q) reads as %v, want %v", name, in, got, want)
			}
		}
	})
}

// setIn sets key in the object at path of m, making the objects on the way
// (replacing what is not one), as a nested body.Set does.
func setIn(m map[string]any, path []string, key string, v any) {
	for _, seg := range path {
		next, ok := m[seg].(map[string]any)
		if !ok {
			next = map[string]any{}
			m[seg] = next
		}
		m = next
	}
	m[key] = v
}

// deleteIn deletes key in the object at path of m, if the path is all objects.
func deleteIn(m map[string]any, path []string, key string) {
	for _, seg := range path {
		next, ok := m[seg].(map[string]any)
		if !ok {
			return
		}
		m = next
	}
	delete(m, key)
}

func deepClone(m map[string]any) map[string]any {
	out := maps.Clone(m)
	for k, v := range out {
		if sub, ok := v.(map[string]any); ok {
			out[k] = deepClone(sub)
		}
	}
	return out
}

// decode reads a leg as vLLM and SGLang do; it fails on anything but a UTF-8 JSON object.
func decode(t *testing.T, b []byte) map[string]any {
	t.Helper()
	if !utf8.Valid(b) {
		t.Fatalf("leg is not UTF-8: %q", b)
	}
	m, ok := enginetest.Decode(t, b).(map[string]any)
	if !ok {
		t.Fatalf("leg is not a JSON object: %q", b)
	}
	return m
}
