package body

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
)

// The seed corpora in testdata/fuzz hold realistic chat and completions bodies;
// the f.Add seeds below are the edge shapes. Plain `go test` runs both.

func FuzzParse(f *testing.F) {
	for _, s := range []string{
		`{}`, ` { } `, `[]`, `"x"`, `1`, `null`, ``, `{`, `{"a":1,}`, `{"a":1}{}`,
		`{"a":"\"}","b":[{"c":"\\"}]}`, `{"kv\u005ftransfer_params":1,"kv_transfer_params":2}`,
		`{"\ud800":1,"\udc00":2}`, "{\"a\":\"\xff\"}", `{"n":98765432109876543210,"t":1e400}`, "\ufeff{}", "\ufeff\ufeff{}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		o, err := Parse(b)
		doc := bytes.TrimPrefix(b, []byte(bom)) // what Python's json.loads reads
		if want := utf8.Valid(doc) && json.Valid(doc); !want {
			if err == nil {
				t.Fatalf("Parse accepted %q, which is not valid UTF-8 JSON", b)
			}
			return
		}
		if isObject := bytes.TrimLeft(doc, " \t\r\n")[0] == '{'; !isObject {
			if !errors.Is(err, ErrNotObject) {
				t.Fatalf("Parse(%q) error = %v, want ErrNotObject", b, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("Parse rejected the valid object %q: %v", b, err)
		}
		if got := o.Splice().Bytes(); len(got) != len(b) || (len(b) > 0 && &got[0] != &b[0]) {
			t.Fatalf("Splice() copied the body")
		}

		// Every key reads the value encoding/json keeps: the last duplicate, as in Python.
		var want map[string]json.RawMessage
		if err := json.Unmarshal(doc, &want); err != nil {
			t.Fatalf("encoding/json rejected what Parse accepted: %v", err)
		}
		names := make(map[string]bool)
		prevEnd := uint32(o.open)
		for _, m := range o.members {
			name := o.key(m)
			names[name] = true
			if m.start < prevEnd || m.valStart > m.valEnd || b[m.start] != '"' {
				t.Fatalf("member %q is located at %d..%d..%d, after %d", name, m.start, m.valStart, m.valEnd, prevEnd)
			}
			if !json.Valid(b[m.valStart:m.valEnd]) {
				t.Fatalf("member %q has value %q, not a JSON value", name, b[m.valStart:m.valEnd])
			}
			if !o.is(m, name) {
				t.Fatalf("member %q is not itself", name)
			}
			prevEnd = m.valEnd
		}
		if len(names) != len(want) {
			t.Fatalf("Parse found %d distinct keys, encoding/json %d", len(names), len(want))
		}
		for k, v := range want {
			raw, ok := o.Raw(k)
			if !ok || !bytes.Equal(raw, v) {
				t.Fatalf("Raw(%q) = %q, %v; want %q", k, raw, ok, v)
			}
			var s string
			sErr := json.Unmarshal(v, &s)
			if got, ok := o.String(k); ok != (sErr == nil && v[0] == '"') || got != s {
				t.Fatalf("String(%q) = %q, %v; encoding/json gives %q, %v", k, got, ok, s, sErr)
			}
		}
	})
}

// FuzzScanInChunks feeds a body to a Scanner in pieces, cut where cuts says
// (each byte a piece length), and checks the result is Parse's: the same
// verdict and the same members at the same offsets. The pieces bypass Scan's
// minimum step, so every cut lands wherever the fuzzer puts it: inside a
// string, an escape, a UTF-8 sequence, a number, a literal or whitespace.
func FuzzScanInChunks(f *testing.F) {
	for _, s := range []struct{ body, cuts string }{
		{`{"model":"m","messages":[{"role":"user","content":"h\u00e9llo \"x\" café 東京"}],"max_tokens":512,"t":1.5e-3,"s":true,"n":null}`, "\x01\x03\x05\x02\x07"},
		{`{"a":98765432109876543210,"b":-0.5E+2,"c":[true,false,null],"d":{}}`, "\x04\x01\x01\x01\x02\x03"},
		{"\n{ \"a\" :\t[ ] , \"b\" : { } }\n", "\x01"},
		{"{\"a\":\"\xe6\x9d\xb1\xf0\x9f\x98\x80\"}", "\x06\x01\x01\x01\x01"},
		{`{"a":1}x`, "\x07"},
		{`{"a":tru}`, "\x06\x01"},
		{`{"a":"\u12"}`, "\x08\x01"},
		{"{\"a\":\"\xff\"}", "\x06"},
		{`[1,2]`, "\x02"},
		{"\ufeff{\"a\":1}", "\x01\x01\x02"},
	} {
		f.Add([]byte(s.body), []byte(s.cuts))
	}
	f.Fuzz(func(t *testing.T, b, cuts []byte) {
		want, wantErr := Parse(b)
		var sc Scanner
		at := 0
		for _, c := range cuts {
			if at += int(c); at >= len(b) {
				break
			}
			sc.step(b[:at], false)
		}
		got, err := sc.Object(b)
		if (err == nil) != (wantErr == nil) {
			t.Fatalf("in pieces %v: error %v; at once: %v", cuts, err, wantErr)
		}
		if err != nil {
			return
		}
		if !reflect.DeepEqual(got.members, want.members) || got.open != want.open || got.close != want.close {
			t.Fatalf("in pieces %v:\n%+v\nat once:\n%+v", cuts, got.members, want.members)
		}
	})
}

// FuzzApply checks Splice against a model: decode the input the way Python's
// json does (last duplicate wins), apply the edits to the decoded map by the
// rules of nested.go, and compare with the decoded output. Every member no
// edit names must also keep its exact bytes.
//
// script holds one edit per line, "op\tkey\tvalue": op s (Set), i (SetIfPresent)
// or d (Delete); dots in key name nested objects ("a.b.c" is c inside a.b). A
// value that is not UTF-8 JSON is quoted, which exercises Quote.
func FuzzApply(f *testing.F) {
	for _, s := range []struct{ body, script string }{
		{`{}`, "s\tmax_tokens\t1"},
		{`{"a":1,"a":2,"b":3,"a":4}`, "s\ta\ttrue"},
		{`{"a":1,"a":2,"b":3,"a":4}`, "d\ta"},
		{`{"a":1,"b":2}`, "d\ta\nd\tb\ns\tc\t\"x\""},
		{`{"a":1}`, "s\ta\t1\nd\ta\ns\ta\tnull\ni\ta\t2"},
		{`{"a":1}`, "i\tb\t1\nd\tc"},
		{`{"\u0061":1}`, "s\ta\t[1, {\"b\": 98765432109876543210}]"},
		{"\n{\n \"a\" : 1 ,\n \"b\" : 2\n}\n", "s\tb\tfalse\ns\tc\t1e400"},
		{`{"a":1}`, "s\tk\x01\x7f\"\\\tnot json \x00\xff"},
		// Nested: create, rewrite, delete, through duplicates and non-objects.
		{`{"token_ids":[1,2],"sampling_params":{"max_tokens":64,"min_tokens":8}}`,
			"d\tsampling_params.extra_args.kv_transfer_params\ns\tsampling_params.max_tokens\t1\nd\tsampling_params.min_tokens\n" +
				"s\tsampling_params.extra_args.kv_transfer_params\t{\"do_remote_decode\":true}"},
		{`{"p":{"x":{"k":1},"x":{"k":2}},"p":{"x":{"k":3,"k":4}}}`, "d\tp.x.k"},
		{`{"p":null,"q":"s","r":[{}]}`, "s\tp.a\t1\ns\tq.b.c\t2\nd\tr.c\ni\tp.z\t3"},
		{`{"p":{"a":1}}`, "s\tp.b\t2\nd\tp\ns\tp.c\t3"},
		{`{"p":{"a":1}}`, "s\tp\t{\"z\":0}\ni\tp.z\t9\ni\tp.a\t8"},
		{`{"p":{}}`, "d\tp.a\ni\tp.b.c\t1"},
		{`{"":{"":1},"a":0}`, "s\t.\t2\nd\ta."},
	} {
		f.Add([]byte(s.body), s.script)
	}
	f.Fuzz(func(t *testing.T, b []byte, script string) {
		o, err := Parse(b)
		if err != nil {
			return
		}
		edits := parseScript(script)
		orig := bytes.Clone(b)

		out := o.Splice(edits...).Bytes()

		if !bytes.Equal(b, orig) {
			t.Fatalf("Splice changed its input")
		}
		checkChunks(t, o.Splice(edits...), out)
		if !utf8.Valid(out) || !json.Valid(out) {
			t.Fatalf("Splice(%s) = %q: not valid UTF-8 JSON", describe(edits), out)
		}
		after, err := Parse(out)
		if err != nil {
			t.Fatalf("Parse(Splice output %q): %v", out, err)
		}

		want := enginetest.Decode(t, b).(map[string]any)
		changes := applyModel(t, want, edits)
		if got := enginetest.Decode(t, out); !reflect.DeepEqual(got, want) {
			t.Fatalf("Splice(%s) on %q\n = %q\ndecodes to %v\nwant %v", describe(edits), b, out, got, want)
		}
		if !changes && (len(out) != len(b) || &out[0] != &b[0]) {
			t.Fatalf("Splice(%s) changed nothing but copied the body", describe(edits))
		}

		// Untouched members: same bytes, same order. Members an edit names
		// at the top level: at most once.
		edited, whole := map[string]bool{}, map[string]bool{}
		for _, e := range edits {
			if len(e.Path) == 0 {
				edited[e.Key], whole[e.Key] = true, true
			} else {
				edited[e.Path[0]] = true
			}
		}
		untouched := func(x *Object) (kept [][]byte) {
			for _, m := range x.members {
				if !edited[x.key(m)] {
					kept = append(kept, x.raw[m.start:m.valEnd])
				}
			}
			return kept
		}
		if before, got := untouched(o), untouched(after); !reflect.DeepEqual(before, got) {
			t.Fatalf("untouched members changed:\n%q\nbecame\n%q", before, got)
		}
		count := make(map[string]int)
		for _, m := range after.members {
			if name := after.key(m); whole[name] {
				if count[name]++; count[name] > 1 {
					t.Fatalf("edited key %q appears twice in %q", name, out)
				}
			}
		}
	})
}

// key is m's key, decoded.
func (o *Object) key(m member) string {
	return DecodeString(o.raw[m.start:valueEnd(o.raw, int(m.start))])
}

// applyModel applies edits to the decoded body m by the rules of nested.go
// and reports whether any of them changes the body (a set that applies, or a
// delete of something present).
func applyModel(t *testing.T, m map[string]any, edits []Edit) (changes bool) {
	t.Helper()
	// The last edit of each member, in first-mention order, outer ones first.
	var order []string
	last := map[string]Edit{}
	for _, e := range edits {
		id := strings.Join(append(slices.Clone(e.Path), e.Key), "\x00")
		if _, ok := last[id]; !ok {
			order = append(order, id)
		}
		last[id] = e
	}
	slices.SortStableFunc(order, func(a, b string) int { return len(last[a].Path) - len(last[b].Path) })
	for _, id := range order {
		e := last[id]
		set := len(e.Value) > 0 && !e.IfPresent
		cur, ok := m, true
		for _, seg := range e.Path {
			next, isObject := cur[seg].(map[string]any)
			if !isObject {
				if !set {
					ok = false
					break
				}
				next = map[string]any{}
				cur[seg] = next
			}
			cur = next
		}
		if !ok {
			continue
		}
		_, present := cur[e.Key]
		switch {
		case len(e.Value) == 0:
			changes = changes || present
			delete(cur, e.Key)
		case e.IfPresent && !present:
		default:
			changes = true
			cur[e.Key] = enginetest.Decode(t, e.Value)
		}
	}
	return changes
}

// checkChunks: the pieces are never empty, and cut into chunks of any size
// they give out, in full chunks but the last.
func checkChunks(t *testing.T, s Spliced, out []byte) {
	for i, p := range s {
		if len(p) == 0 {
			t.Fatalf("piece %d of %q is empty", i, out)
		}
	}
	for _, max := range []int{1, 3, 64} {
		chunks := s.Chunks(max)
		for i, c := range chunks[:len(chunks)-1] {
			if len(c) != max {
				t.Fatalf("Chunks(%d) of %q: chunk %d has %d bytes", max, out, i, len(c))
			}
		}
		if got := bytes.Join(chunks, nil); !bytes.Equal(got, out) {
			t.Fatalf("Chunks(%d) = %q, want the pieces of %q", max, chunks, out)
		}
	}
}

func parseScript(script string) []Edit {
	var edits []Edit
	for line := range strings.SplitSeq(script, "\n") {
		op, rest, _ := strings.Cut(line, "\t")
		name, value, _ := strings.Cut(rest, "\t")
		if !utf8.ValidString(name) {
			continue // keys are ours; Quote's replacement of invalid bytes is tested on values
		}
		path := strings.Split(name, ".")
		key, path := path[len(path)-1], path[:len(path)-1]
		raw := []byte(value)
		if !json.Valid(raw) || !utf8.Valid(raw) { // values are trusted to be JSON, as P's params are once parsed
			raw = Quote(value)
		}
		var e Edit
		switch op {
		case "s":
			e = Set(key, raw)
		case "i":
			e = SetIfPresent(key, raw)
		case "d":
			e = Delete(key)
		default:
			continue
		}
		if len(path) > 0 {
			e = e.In(path...)
		}
		edits = append(edits, e)
	}
	return edits
}

// describe renders edits the way a test failure should show them.
func describe(edits []Edit) string {
	parts := make([]string, len(edits))
	for i, e := range edits {
		switch {
		case len(e.Value) == 0:
			parts[i] = fmt.Sprintf("Delete(%q)", e.Key)
		case e.IfPresent:
			parts[i] = fmt.Sprintf("SetIfPresent(%q, %s)", e.Key, e.Value)
		default:
			parts[i] = fmt.Sprintf("Set(%q, %s)", e.Key, e.Value)
		}
		if len(e.Path) > 0 {
			parts[i] += fmt.Sprintf(".In(%q)", e.Path)
		}
	}
	return strings.Join(parts, ", ")
}

// DecodeString reads every string member of a body Parse accepts as
// encoding/json does: escapes, surrogate pairs, lone surrogates (U+FFFD).
func FuzzDecodeStringAsEncodingJSON(f *testing.F) {
	for _, s := range []string{`"a"`, `"a\nb"`, `"\ud83d\ude00"`, `"\ud83d"`, `"\ud83dx"`, `"\ud83d\u0041"`, `"\udc00\ud800"`,
		`"\u00e9\/\\\""`, `"é\t"`, `"\b\f\r\u0000\u001F"`, `"\uD83D\uDE00"`} {
		f.Add([]byte(`{"k":` + s + `}`))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		o, err := Parse(b)
		if err != nil {
			return
		}
		for _, m := range o.members {
			raw := o.raw[m.valStart:m.valEnd]
			if raw[0] != '"' {
				continue
			}
			var want string
			if err := json.Unmarshal(raw, &want); err != nil {
				t.Fatalf("encoding/json refuses %q, which Parse accepted: %v", raw, err)
			}
			if got := DecodeString(raw); got != want {
				t.Fatalf("DecodeString(%q) = %q, want %q", raw, got, want)
			}
		}
	})
}
