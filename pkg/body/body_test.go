package body

import (
	"bytes"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestParseAcceptsOnlyValidJSONObjects(t *testing.T) {
	deep := func(n int, open, close string) string {
		return `{"a":` + strings.Repeat(open, n) + strings.Repeat(close, n) + `}`
	}
	tests := []struct {
		name      string
		in        string
		wantErr   bool
		notObject bool // the error is ErrNotObject
	}{
		{name: "empty object", in: `{}`},
		{name: "typical chat body", in: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`},
		{name: "whitespace everywhere", in: " \t\r\n{ \n\t\"a\" \r: \n1 ,\t\"b\"\n:\t[ 1 , { } ] , \"c\" : \"x\" \n} \r\n\t"},
		{name: "quotes braces and backslashes inside strings", in: `{"a":"}\"{[\\","b":"\\","c":"\\\""}`},
		{name: "escaped key", in: `{"kv\u005ftransfer_params":{}}`},
		{name: "duplicate keys", in: `{"a":1,"a":2}`},
		{name: "nesting 1,000 deep", in: deep(1000, "[", "]")},
		{name: "invalid UTF-8 in a string", in: "{\"a\":\"\xff\"}", wantErr: true},
		{name: "invalid UTF-8 in a key", in: "{\"\xc3\x28\":1}", wantErr: true},
		{name: "overlong UTF-8", in: "{\"a\":\"\xc0\xaf\"}", wantErr: true},
		{name: "UTF-8 encoded surrogate", in: "{\"a\":\"\xed\xa0\x80\"}", wantErr: true},
		{name: "empty body", in: ``, wantErr: true},
		{name: "only whitespace", in: " \n", wantErr: true},
		{name: "truncated", in: `{"model":"m"`, wantErr: true},
		{name: "trailing comma", in: `{"a":1,}`, wantErr: true},
		{name: "missing value", in: `{"a":}`, wantErr: true},
		{name: "single quotes", in: `{'a':1}`, wantErr: true},
		{name: "NaN", in: `{"a":NaN}`, wantErr: true},
		{name: "two objects", in: `{"a":1}{"b":2}`, wantErr: true},
		{name: "control character in a string", in: "{\"a\":\"\x01\"}", wantErr: true},
		{name: "byte order mark, as Python's json.loads of bytes skips it", in: "\ufeff{\"a\":1}"},
		{name: "two byte order marks", in: "\ufeff\ufeff{}", wantErr: true},
		{name: "byte order mark after space", in: " \ufeff{}", wantErr: true},
		{name: "byte order mark before an array", in: "\ufeff[]", wantErr: true, notObject: true},
		{name: "object nested 100,000 deep", in: deep(100000, `{"a":`, "}"), wantErr: true},
		{name: "array nested 100,000 deep", in: deep(100000, "[", "]"), wantErr: true},
		{name: "top-level array nested 100,000 deep", in: strings.Repeat("[", 100000) + strings.Repeat("]", 100000), wantErr: true},
		{name: "top-level array", in: `[{"model":"m"}]`, wantErr: true, notObject: true},
		{name: "top-level string", in: `"{}"`, wantErr: true, notObject: true},
		{name: "top-level number", in: ` 1 `, wantErr: true, notObject: true},
		{name: "top-level null", in: `null`, wantErr: true, notObject: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := Parse([]byte(tt.in))
			if (err != nil) != tt.wantErr {
				t.Fatalf("Parse error = %v, want error %v", err, tt.wantErr)
			}
			if tt.notObject != errors.Is(err, ErrNotObject) {
				t.Fatalf("Parse error = %v, want ErrNotObject %v", err, tt.notObject)
			}
			if err == nil && string(o.Bytes()) != tt.in {
				t.Fatalf("Bytes() = %q, want the input", o.Bytes())
			}
		})
	}
}

func TestRawReadsTheValueAnEngineReads(t *testing.T) {
	tests := []struct {
		name, in, key, want string
		absent              bool
	}{
		{name: "plain", in: `{"model":"m","n":1}`, key: "n", want: `1`},
		{name: "escaped key matches", in: `{"kv\u005ftransfer_params":{"x":1}}`, key: "kv_transfer_params", want: `{"x":1}`},
		{name: "fully escaped key matches", in: `{"\u006d\u006F\u0064\u0065\u006c":"m"}`, key: "model", want: `"m"`},
		{name: "non-ASCII key", in: `{"mod\u00e8le":1,"modèle":2}`, key: "modèle", want: `2`},
		{name: "last duplicate wins", in: `{"n":1,"model":"m","n":4}`, key: "n", want: `4`},
		{name: "last duplicate wins across spellings", in: `{"kv_transfer_params":1,"kv\u005ftransfer_params":2}`, key: "kv_transfer_params", want: `2`},
		{name: "null is present", in: `{"a":null}`, key: "a", want: `null`},
		{name: "value without surrounding whitespace", in: "{ \"a\" :\n [1, 2]\t, \"b\":0 }", key: "a", want: `[1, 2]`},
		{name: "last member before spaces", in: `{"a":0, "b": true }`, key: "b", want: `true`},
		{name: "string with escaped quote and brace", in: `{"a":"x\"}y","b":1}`, key: "a", want: `"x\"}y"`},
		{name: "after a string ending in a backslash", in: `{"a":"x\\","b":1}`, key: "b", want: `1`},
		{name: "20-digit integer", in: `{"seed":98765432109876543210}`, key: "seed", want: `98765432109876543210`},
		{name: "float out of float64 range", in: `{"t":1e400}`, key: "t", want: `1e400`},
		{name: "a key that begins other keys", in: `{"streams":1,"stream":2,"stream_options":3}`, key: "stream", want: `2`},
		{name: "a key that begins a key with escapes", in: `{"stream\u0073":1,"stre\u0041m":2}`, key: "stream", absent: true},
		{name: "a key with a quote", in: `{"a\"b":1,"a":2}`, key: `a"b`, want: `1`},
		{name: "a key longer than the member", in: `{"a":1}`, key: `a":1}`, absent: true},
		{name: "key is case sensitive", in: `{"Model":"m"}`, key: "model", absent: true},
		{name: "nested keys are not top level", in: `{"a":{"model":"m"}}`, key: "model", absent: true},
		{name: "empty object", in: `{}`, key: "model", absent: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := mustParse(t, tt.in)
			got, ok := o.Raw(tt.key)
			if ok == tt.absent || string(got) != tt.want {
				t.Fatalf("Raw(%q) = %q, %v; want %q, %v", tt.key, got, ok, tt.want, !tt.absent)
			}
			if o.Has(tt.key) != !tt.absent {
				t.Fatalf("Has(%q) = %v, want %v", tt.key, tt.absent, !tt.absent)
			}
		})
	}
}

func TestRoutingFieldReaders(t *testing.T) {
	const in = `{"model":"llama","esc":"m\u00e9\n\"q\"","empty":"","t":true,"f":false,` +
		`"str_true":"true","one":1,"neg":-3,"max":9223372036854775807,"big":9223372036854775808,` +
		`"float":1.0,"exp":1e2,"null":null,"n":1,"n":4}`
	o := mustParse(t, in)

	strings := []struct {
		key  string
		want string
		ok   bool
	}{
		{"model", "llama", true},
		{"esc", "mé\n\"q\"", true},
		{"empty", "", true},
		{"one", "", false},
		{"null", "", false},
		{"absent", "", false},
	}
	for _, tt := range strings {
		if got, ok := o.String(tt.key); got != tt.want || ok != tt.ok {
			t.Errorf("String(%q) = %q, %v; want %q, %v", tt.key, got, ok, tt.want, tt.ok)
		}
	}

	ints := []struct {
		key  string
		want int64
		ok   bool
	}{
		{"one", 1, true},
		{"neg", -3, true},
		{"max", 9223372036854775807, true},
		{"n", 4, true}, // the engine reads the last duplicate, so routing must too
		{"big", 0, false},
		{"float", 0, false},
		{"exp", 0, false},
		{"str_true", 0, false},
		{"null", 0, false},
		{"absent", 0, false},
	}
	for _, tt := range ints {
		if got, ok := o.Int(tt.key); got != tt.want || ok != tt.ok {
			t.Errorf("Int(%q) = %v, %v; want %v, %v", tt.key, got, ok, tt.want, tt.ok)
		}
	}
}

func TestIsNull(t *testing.T) {
	for raw, want := range map[string]bool{"null": true, "": false, `"null"`: false, "nul": false, "{}": false} {
		if got := IsNull([]byte(raw)); got != want {
			t.Errorf("IsNull(%q) = %v, want %v", raw, got, want)
		}
	}
}

func mustParse(t testing.TB, s string) *Object {
	t.Helper()
	o, err := Parse([]byte(s))
	if err != nil {
		t.Fatalf("Parse(%q): %v", s, err)
	}
	return o
}

func TestItems(t *testing.T) {
	tests := []struct {
		raw  string
		want []string // none: not an array, or an empty one
	}{
		{raw: `[]`, want: []string{}},
		{raw: ` [ ] `, want: []string{}},
		{raw: `[1]`, want: []string{`1`}},
		{raw: `[1, -2.5e3 ,true,null]`, want: []string{`1`, `-2.5e3`, `true`, `null`}},
		{raw: `["a,]", "\"]", "\\"]`, want: []string{`"a,]"`, `"\"]"`, `"\\"`}},
		{raw: `[{"role":"user","content":["x",{"y":[1,"]"]}]},[[]],{}]`, want: []string{`{"role":"user","content":["x",{"y":[1,"]"]}]}`, `[[]]`, `{}`}},
		{raw: "[\n\t{\"a\": 1} ,\r\n 2\n]", want: []string{`{"a": 1}`, `2`}},
		{raw: `{"a":[1]}`},
		{raw: `"[1]"`},
		{raw: ``},
	}
	for _, tt := range tests {
		got := slices.Collect(Items([]byte(tt.raw)))
		if len(got) != len(tt.want) {
			t.Errorf("Items(%q) = %q, want %q", tt.raw, got, tt.want)
			continue
		}
		for i := range got {
			if string(got[i]) != tt.want[i] {
				t.Errorf("Items(%q)[%d] = %q, want %q", tt.raw, i, got[i], tt.want[i])
			}
		}
	}
}

// TestMembers: an object's keys as spelt and their values, in order,
// duplicates included; nothing for anything else.
func TestMembers(t *testing.T) {
	tests := []struct {
		raw  string
		want []string // key, value, key, value...
	}{
		{raw: `{}`},
		{raw: `{"a":1,"b":"x"}`, want: []string{`"a"`, `1`, `"b"`, `"x"`}},
		{raw: "{ \"a\" :\n [1, {\"}\":2}] ,\t\"a\" : null }", want: []string{`"a"`, `[1, {"}":2}]`, `"a"`, `null`}},
		{raw: `{"k\"\u0065y":{"n":{}},"z":true}`, want: []string{`"k\"\u0065y"`, `{"n":{}}`, `"z"`, `true`}},
		{raw: `[{"a":1}]`},
		{raw: `"{}"`},
		{raw: ``},
	}
	for _, tt := range tests {
		var got []string
		for k, v := range Members([]byte(tt.raw)) {
			got = append(got, string(k), string(v))
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("Members(%q) = %q, want %q", tt.raw, got, tt.want)
		}
	}
}

// FuzzItems: on any valid JSON array, Items splits as encoding/json does.
func FuzzItems(f *testing.F) {
	for _, seed := range []string{`[]`, `[1,"a]",{"b":[2,"\\"]}]`, ` [ null , true ] `, `[[[]],{}]`} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		var want []json.RawMessage
		if !json.Valid(raw) || json.Unmarshal(raw, &want) != nil {
			return
		}
		got := slices.Collect(Items(raw))
		if len(got) != len(want) {
			t.Fatalf("Items(%q) = %q, want %q", raw, got, want)
		}
		for i := range got {
			if !bytes.Equal(got[i], want[i]) {
				t.Fatalf("Items(%q)[%d] = %q, want %q", raw, i, got[i], want[i])
			}
		}
	})
}
