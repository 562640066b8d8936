package body

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestLocateFindsTheValueAtAPath(t *testing.T) {
	usage := `{"id":"x","choices":[{"usage":{"cached_tokens":1}}],` +
		`"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":99,"audio_tokens":null}},"kv_transfer_params":null}`
	tests := []struct {
		name string
		doc  string
		path string // dot-separated
		want string // the raw value; "" when it is not found
	}{
		{"nested number", usage, "usage.prompt_tokens_details.cached_tokens", "99"},
		{"a nested object whole", usage, "usage.prompt_tokens_details", `{"cached_tokens":99,"audio_tokens":null}`},
		{"top level", usage, "kv_transfer_params", "null"},
		{"no path is the whole document", ` {"a":1} `, "", ` {"a":1} `},
		{"whitespace around the value", `{"u" : { "c" :  7 , "d":1 } }`, "u.c", "7"},
		{"the last duplicate counts, as in Python", `{"u":{"c":1},"u":{"c":2,"c":3}}`, "u.c", "3"},
		{"an escaped name matches its decoded form", `{"u":{"c\u0061ched":5}}`, "u.cached", "5"},
		{"arrays are not entered", usage, "choices.usage", ""},
		{"absent member", usage, "usage.completion_tokens", ""},
		{"a step that is not an object", usage, "usage.prompt_tokens.x", ""},
		{"a null step", `{"usage":{"prompt_tokens_details":null}}`, "usage.prompt_tokens_details.cached_tokens", ""},
		{"invalid JSON", `{"usage":{"cached_tokens":1}`, "usage.cached_tokens", ""},
		{"not an object", `[{"usage":1}]`, "usage", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var path []string
			if tt.path != "" {
				path = strings.Split(tt.path, ".")
			}
			start, end, ok := Locate([]byte(tt.doc), path...)
			if ok != (tt.want != "") {
				t.Fatalf("Locate(%q) ok = %v, want %v", tt.path, ok, tt.want != "")
			}
			if got := tt.doc[start:end]; ok && got != tt.want {
				t.Errorf("Locate(%q) = %q (at %d..%d), want %q", tt.path, got, start, end, tt.want)
			}
		})
	}
}

// FuzzLocate: whatever the document, Locate finds exactly the value
// encoding/json keeps at the path (the last duplicate at each level), and the
// offsets point at it in the document itself.
func FuzzLocate(f *testing.F) {
	for _, s := range [][2]string{
		{`{"usage":{"prompt_tokens_details":{"cached_tokens":12}}}`, "usage.prompt_tokens_details.cached_tokens"},
		{`{"a":{"b":1},"a":{"b":2}}`, "a.b"},
		{`{"a":{"b":[1,{"c":2}]}}`, "a.b.c"},
		{`{"a" :{ "b\u0022":"\"}"} }`, `a.b"`},
		{`{"a":{}}`, "a"},
		{`{"a":1`, "a"},
	} {
		f.Add([]byte(s[0]), s[1])
	}
	f.Fuzz(func(t *testing.T, b []byte, dotted string) {
		path := strings.Split(dotted, ".")
		start, end, ok := Locate(b, path...)
		want, wantOK := locateWithJSON(b, path)
		if ok != wantOK {
			t.Fatalf("Locate(%q, %q) ok = %v; encoding/json finds it: %v", b, dotted, ok, wantOK)
		}
		if ok && !bytes.Equal(b[start:end], want) {
			t.Fatalf("Locate(%q, %q) = %q, encoding/json keeps %q", b, dotted, b[start:end], want)
		}
	})
}

// locateWithJSON walks path with encoding/json, one level at a time.
func locateWithJSON(b []byte, path []string) ([]byte, bool) {
	raw := json.RawMessage(b)
	if !utf8.Valid(b) || !json.Valid(b) {
		return nil, false
	}
	for _, name := range path {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(raw, &m); err != nil || m == nil {
			return nil, false
		}
		v, ok := m[name]
		if !ok {
			return nil, false
		}
		raw = v
	}
	return raw, true
}
