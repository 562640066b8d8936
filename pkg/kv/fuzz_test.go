package kv

import (
	"bytes"
	"encoding/json"
	"maps"
	"reflect"
	"testing"
	"unicode/utf8"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// FuzzLegs checks every connector's legs against what an engine reads (Python's
// json: the last duplicate wins): the client's body minus the reserved keys, plus
// exactly the connector's fields. Whatever the client sends, a reserved key on a
// leg is always ours.
func FuzzLegs(f *testing.F) {
	for _, in := range []string{chatStream, chatNoStream, completionsStream, completionsNoStream, `{}`} {
		f.Add([]byte(in), []byte(prefillAnswer), "10.0.4.21", 8998, uint64(1<<63-1))
	}
	f.Add([]byte(`{"max_completion_tokens":null,"min_completion_tokens":3}`), []byte("null"), "[fd00::1]", 0, uint64(0))
	f.Add([]byte(`{"bootstrap_host":"x","bootstrap_host":"y"}`), []byte(" {} "), "h\"\x01\xff", 65535, uint64(42))

	f.Fuzz(func(t *testing.T, in, prefillKV []byte, host string, port int, room uint64) {
		o, err := body.Parse(in)
		if err != nil {
			return
		}
		if !json.Valid(prefillKV) || !utf8.Valid(prefillKV) {
			prefillKV = nil // the pipeline hands over parsed JSON or nothing
		}
		h := &Handoff{Body: o, PrefillHost: host, BootstrapPort: port & 0xffff, Room: room &^ (1 << 63), PrefillKV: prefillKV}

		client := decode(t, in)
		for _, k := range reservedKeys {
			delete(client, k)
		}
		with := func(fields map[string]any) map[string]any {
			m := maps.Clone(client)
			for k, v := range fields {
				if v == nil {
					delete(m, k)
				} else {
					m[k] = v
				}
			}
			return m
		}
		capped := func(extra map[string]any) map[string]any {
			fields := map[string]any{
				"stream": false, "stream_options": nil, "max_tokens": json.Number("1"),
				"min_tokens": nil, "min_completion_tokens": nil,
			}
			if _, ok := client["max_completion_tokens"]; ok {
				fields["max_completion_tokens"] = json.Number("1")
			}
			maps.Copy(fields, extra)
			return with(fields)
		}
		bootstrap := with(map[string]any{
			"bootstrap_host": decodeValue(t, body.Quote(host)),
			"bootstrap_port": decodeValue(t, body.Uint(uint64(h.BootstrapPort))),
			"bootstrap_room": decodeValue(t, body.Uint(h.Room)),
		})
		nixlDecode := client
		if HasParams(prefillKV) {
			nixlDecode = with(map[string]any{"kv_transfer_params": decodeValue(t, prefillKV)})
		}

		for _, tt := range []struct {
			connector       string
			prefill, decode map[string]any
		}{
			{NIXL, capped(map[string]any{"kv_transfer_params": decodeValue(t, nixlPrefillParams)}), nixlDecode},
			{SharedStorage, capped(nil), client},
			{SGLang, bootstrap, bootstrap},
		} {
			c, err := Build(tt.connector)
			if err != nil {
				t.Fatal(err)
			}
			if got := decode(t, PrefillBody(c, h).Bytes()); !reflect.DeepEqual(got, tt.prefill) {
				t.Fatalf("%s prefill leg of %q reads as\n%v\nwant\n%v", tt.connector, in, got, tt.prefill)
			}
			if got := decode(t, DecodeBody(c, h).Bytes()); !reflect.DeepEqual(got, tt.decode) {
				t.Fatalf("%s decode leg of %q reads as\n%v\nwant\n%v", tt.connector, in, got, tt.decode)
			}
		}
		if got := decode(t, Scrubbed(o).Bytes()); !reflect.DeepEqual(got, client) {
			t.Fatalf("Scrubbed(%q) reads as %v, want %v", in, got, client)
		}
	})
}

// decode reads a leg as vLLM and SGLang do; it fails on anything but a UTF-8 JSON object.
func decode(t *testing.T, b []byte) map[string]any {
	t.Helper()
	if !utf8.Valid(b) {
		t.Fatalf("leg is not UTF-8: %q", b)
	}
	m, ok := decodeValue(t, b).(map[string]any)
	if !ok {
		t.Fatalf("leg is not a JSON object: %q", b)
	}
	return m
}

func decodeValue(t *testing.T, b []byte) any {
	t.Helper()
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil || d.More() {
		t.Fatalf("not one JSON value (%v): %q", err, b)
	}
	return v
}
