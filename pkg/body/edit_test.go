package body

import (
	"encoding/json"
	"testing"
	"unicode/utf8"
)

func TestSpliceWritesExactBytes(t *testing.T) {
	tests := []struct {
		name, in string
		edits    []Edit
		want     string
	}{
		// Set.
		{
			name:  "set replaces the value in place",
			in:    `{"model":"m","stream":true,"n":1}`,
			edits: []Edit{Set("stream", False)},
			want:  `{"model":"m","stream":false,"n":1}`,
		},
		{
			name:  "set in place keeps the whitespace around the member",
			in:    "{ \"stream\" :  true ,\n  \"n\": 1 }",
			edits: []Edit{Set("stream", False)},
			want:  "{ \"stream\" :  false ,\n  \"n\": 1 }",
		},
		{
			name:  "set appends to an empty object",
			in:    `{}`,
			edits: []Edit{Set("max_tokens", One)},
			want:  `{"max_tokens":1}`,
		},
		{
			name:  "set appends to an empty object with whitespace inside",
			in:    "{ \n}",
			edits: []Edit{Set("max_tokens", One)},
			want:  "{ \n\"max_tokens\":1}",
		},
		{
			name:  "set appends after the last member",
			in:    `{"model":"m"}`,
			edits: []Edit{Set("max_tokens", One)},
			want:  `{"model":"m","max_tokens":1}`,
		},
		{
			name:  "set appends inside a pretty-printed body, before its closing newline",
			in:    "{\n  \"model\": \"m\"\n}\n",
			edits: []Edit{Set("max_tokens", One)},
			want:  "{\n  \"model\": \"m\",\"max_tokens\":1\n}\n",
		},
		{
			name:  "appended keys come in the order the edits first name them",
			in:    `{"a":0}`,
			edits: []Edit{Delete("c"), Set("b", One), Set("c", True)},
			want:  `{"a":0,"c":true,"b":1}`,
		},
		{
			name:  "set replaces the first duplicate and drops the rest",
			in:    `{"k":1,"a":0,"k":2,"b":0,"k":3}`,
			edits: []Edit{Set("k", One)},
			want:  `{"k":1,"a":0,"b":0}`,
		},
		{
			name:  "set keeps the client's spelling of an escaped key",
			in:    `{"\u006b":1,"k":2}`,
			edits: []Edit{Set("k", True)},
			want:  `{"\u006b":true}`,
		},
		{
			name:  "set appends a key that needs JSON escapes",
			in:    `{}`,
			edits: []Edit{Set("a\"b\\\n\x01\x7f", True)},
			want:  `{"a\"b\\\n\u0001` + "\x7f" + `":true}`,
		},
		{
			name:  "set inserts the value bytes as given",
			in:    `{"p":null}`,
			edits: []Edit{Set("p", []byte("{ \"remote_block_ids\": [[1, 2]],\n \"x\": 98765432109876543210 }"))},
			want:  "{\"p\":{ \"remote_block_ids\": [[1, 2]],\n \"x\": 98765432109876543210 }}",
		},
		// Delete.
		{
			name:  "delete the first member",
			in:    `{"a":1,"b":2,"c":3}`,
			edits: []Edit{Delete("a")},
			want:  `{"b":2,"c":3}`,
		},
		{
			name:  "delete a middle member",
			in:    `{"a":1,"b":2,"c":3}`,
			edits: []Edit{Delete("b")},
			want:  `{"a":1,"c":3}`,
		},
		{
			name:  "delete the last member",
			in:    `{"a":1,"b":2,"c":3}`,
			edits: []Edit{Delete("c")},
			want:  `{"a":1,"b":2}`,
		},
		{
			name:  "delete the only member",
			in:    `{"a":1}`,
			edits: []Edit{Delete("a")},
			want:  `{}`,
		},
		{
			name:  "delete the first member of a pretty-printed body",
			in:    "{\n  \"a\": 1,\n  \"b\": 2\n}",
			edits: []Edit{Delete("a")},
			want:  "{\n  \"b\": 2\n}",
		},
		{
			name:  "delete the last member of a pretty-printed body",
			in:    "{\n  \"a\": 1,\n  \"b\": 2\n}",
			edits: []Edit{Delete("b")},
			want:  "{\n  \"a\": 1\n}",
		},
		{
			name:  "delete every duplicate",
			in:    `{"k":1,"a":0,"k":2,"k":3}`,
			edits: []Edit{Delete("k")},
			want:  `{"a":0}`,
		},
		{
			name:  "delete matches an escaped key",
			in:    `{"kv\u005ftransfer_params":{"do_remote_prefill":true},"a":1}`,
			edits: []Edit{Delete("kv_transfer_params")},
			want:  `{"a":1}`,
		},
		{
			name:  "delete every member",
			in:    ` { "a" : 1 , "b" : 2 } `,
			edits: []Edit{Delete("a"), Delete("b")},
			want:  ` {  } `,
		},
		{
			name:  "delete everything then append",
			in:    `{"a":1,"b":2}`,
			edits: []Edit{Delete("a"), Delete("b"), Set("c", One)},
			want:  `{"c":1}`,
		},
		{
			name:  "an empty value deletes rather than writing an invalid member",
			in:    `{"a":1,"b":2}`,
			edits: []Edit{Set("a", []byte{}), Set("z", []byte{})},
			want:  `{"b":2}`,
		},
		// SetIfPresent.
		{
			name:  "set if present rewrites a present key",
			in:    `{"max_completion_tokens":512,"a":0}`,
			edits: []Edit{SetIfPresent("max_completion_tokens", One)},
			want:  `{"max_completion_tokens":1,"a":0}`,
		},
		{
			name:  "set if present rewrites a present null",
			in:    `{"max_completion_tokens":null}`,
			edits: []Edit{SetIfPresent("max_completion_tokens", One)},
			want:  `{"max_completion_tokens":1}`,
		},
		{
			name:  "set if present leaves an absent key out",
			in:    `{"a":0,"b":1}`,
			edits: []Edit{Delete("b"), SetIfPresent("max_completion_tokens", One)},
			want:  `{"a":0}`,
		},
		// Several edits of one key: the last one wins.
		{
			name:  "set twice",
			in:    `{"a":0}`,
			edits: []Edit{Set("a", One), Set("a", True)},
			want:  `{"a":true}`,
		},
		{
			name:  "set then delete",
			in:    `{"a":0,"b":0}`,
			edits: []Edit{Set("a", One), Delete("a")},
			want:  `{"b":0}`,
		},
		{
			name:  "delete then set replaces in place",
			in:    `{"a":0,"b":0,"a":2}`,
			edits: []Edit{Delete("a"), Set("a", One)},
			want:  `{"a":1,"b":0}`,
		},
		{
			name:  "set then set if present of an absent key",
			in:    `{}`,
			edits: []Edit{Set("a", One), SetIfPresent("a", True)},
			want:  `{}`,
		},
		// Bytes that must survive untouched.
		{
			name: "numbers, unicode and escapes of other members survive byte for byte",
			in: `{"seed":98765432109876543210,"t":1e400,"u":-0.0E+00,"s":"héllo \ud83d\ude00 😀 \u2028",` +
				`"n":[1.5e-400,18446744073709551616],"stream":true}`,
			edits: []Edit{Set("stream", False)},
			want: `{"seed":98765432109876543210,"t":1e400,"u":-0.0E+00,"s":"héllo \ud83d\ude00 😀 \u2028",` +
				`"n":[1.5e-400,18446744073709551616],"stream":false}`,
		},
		{
			name: "whitespace and newlines around untouched members survive",
			in: "\n{\n\t\"model\" : \"m\" ,\r\n\t\"stream\": true,\n\t\"stream_options\": {\"include_usage\": true},\n" +
				"\t\"messages\" :\n\t[ {\"role\": \"user\"} ]\n}\n",
			edits: []Edit{Set("stream", False), Delete("stream_options"), Set("max_tokens", One)},
			want: "\n{\n\t\"model\" : \"m\" ,\r\n\t\"stream\": false,\n" +
				"\t\"messages\" :\n\t[ {\"role\": \"user\"} ],\"max_tokens\":1\n}\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := mustParse(t, tt.in)
			got := o.Splice(tt.edits...).Bytes()
			if string(got) != tt.want {
				t.Fatalf("Splice =\n%q\nwant\n%q", got, tt.want)
			}
			if !json.Valid(got) {
				t.Fatalf("Splice output is not valid JSON: %q", got)
			}
			if string(o.Bytes()) != tt.in {
				t.Fatalf("Splice changed the input to %q", o.Bytes())
			}
			if again := o.Splice(tt.edits...).Bytes(); string(again) != tt.want {
				t.Fatalf("second Splice = %q, want the same output as the first", again)
			}
		})
	}
}

func TestSpliceWithoutChangeReturnsTheSameSlice(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		edits []Edit
	}{
		{name: "no edits", in: `{"a":1}`},
		{name: "delete an absent key", in: `{"a":1}`, edits: []Edit{Delete("b")}},
		{name: "set if present of an absent key", in: `{"a":1}`, edits: []Edit{SetIfPresent("b", One)}},
		{name: "scrub a body that has nothing to scrub", in: `{"model":"m"}`,
			edits: []Edit{Delete("kv_transfer_params"), Delete("bootstrap_room"), SetIfPresent("max_completion_tokens", One)}},
		{name: "delete from an empty object", in: `{}`, edits: []Edit{Delete("a")}},
		{name: "nested key of that name", in: `{"a":{"b":1}}`, edits: []Edit{Delete("b")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := []byte(tt.in)
			o, err := Parse(in)
			if err != nil {
				t.Fatal(err)
			}
			got := o.Splice(tt.edits...).Bytes()
			if len(got) != len(in) || &got[0] != &in[0] {
				t.Fatalf("Splice = %q, a copy; want the input slice itself", got)
			}
		})
	}
}

func TestQuoteAlwaysGivesValidJSON(t *testing.T) {
	tests := []struct {
		in, want string
	}{
		{"10.0.4.21", `"10.0.4.21"`},
		{"[fd00::1]", `"[fd00::1]"`},
		{"", `""`},
		{`a"b\c`, `"a\"b\\c"`},
		{"\n\r\t", `"\n\r\t"`},
		{"\x00\x1f\b\f\v\a", `"\u0000\u001f\u0008\u000c\u000b\u0007"`},
		{"\x7f", "\"\x7f\""},
		{"héllo 😀 \u2028", "\"héllo 😀 \u2028\""},
		{"\U000e0001", "\"\U000e0001\""},
		{"a\xffb\xc3", `"a\ufffdb\ufffd"`},
	}
	for _, tt := range tests {
		got := Quote(tt.in)
		if string(got) != tt.want {
			t.Errorf("Quote(%q) = %s, want %s", tt.in, got, tt.want)
		}
		var back string
		if err := json.Unmarshal(got, &back); err != nil {
			t.Errorf("Quote(%q) = %s: not a JSON string: %v", tt.in, got, err)
		} else if utf8.ValidString(tt.in) && back != tt.in {
			t.Errorf("Quote(%q) decodes to %q", tt.in, back)
		}
	}
}

func TestUint(t *testing.T) {
	for n, want := range map[uint64]string{0: "0", 8998: "8998", 1<<63 - 1: "9223372036854775807", 1<<64 - 1: "18446744073709551615"} {
		if got := Uint(n); string(got) != want {
			t.Errorf("Uint(%d) = %s, want %s", n, got, want)
		}
	}
}
