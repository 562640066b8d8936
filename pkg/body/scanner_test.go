package body

import (
	"bytes"
	"runtime"
	"strings"
	"testing"
)

// TestScannerWorkStaysLinear feeds bodies whose tokens span many chunks (one
// long string, number, run of whitespace or key) in tiny and in Envoy-sized
// chunks. A Scanner that rescanned an unfinished token from its start on every
// chunk would be quadratic: a client sending 1-byte chunks could make extproc
// scan terabytes. Each must cost at most about three scans of the body, a chat
// (many strings, none huge) about one, and give Parse's answer.
func TestScannerWorkStaysLinear(t *testing.T) {
	const n = 1 << 20
	long := func(s string) string { return strings.Repeat(s, n/len(s)) }
	turn := `{"role":"user","content":"` + strings.Repeat(`hello \"wörld\" \n `, 150) + `"},`
	chat := `{"model":"m","messages":[` + strings.Repeat(turn, n/len(turn)) + `{"role":"user","content":"end"}],"max_tokens":5}`
	bodies := []struct {
		name  string
		body  string
		scans int // the bound, in scans of the body
	}{
		{"a long chat", chat, 1},
		{"one long string", `{"model":"m","prompt":"` + long("caf\u00e9 \\n \\u00e9 ") + `"}`, 3},
		{"one long number", `{"model":"m","seed":1` + long("0") + `}`, 3},
		{"a long run of whitespace", `{"model":"m",` + long(" ") + `"prompt":"x"}`, 3},
		{"a long key", `{"model":"m","` + long("k") + `":1}`, 3},
		{"whitespace inside an empty container", `{"model":"m","a":[` + long("\n") + `]}`, 3},
	}
	for _, tt := range bodies {
		for _, chunk := range []int{1, 7, 64 << 10} {
			b := []byte(tt.body)
			var sc Scanner
			for at := chunk; at < len(b); at += chunk {
				sc.Scan(b[:at])
			}
			o, err := sc.Object(b)
			if err != nil {
				t.Fatalf("%s in %d-byte chunks: %v", tt.name, chunk, err)
			}
			if want, _ := Parse(b); len(o.members) != len(want.members) || !bytes.Equal(o.Splice(Delete("model")).Bytes(), want.Splice(Delete("model")).Bytes()) {
				t.Errorf("%s in %d-byte chunks: members differ from Parse's", tt.name, chunk)
			}
			if limit := tt.scans*len(b) + minScanStep; sc.scanned > limit {
				t.Errorf("%s in %d-byte chunks: %d bytes scanned for a %d-byte body, want at most %d",
					tt.name, chunk, sc.scanned, len(b), limit)
			}
		}
	}
}

// TestIndexStaysSmall parses bodies of nothing but tiny top-level members,
// the most an index can cost per byte: every member is indexed (an edit drops
// each duplicate). A 32 MiB body once took 1.5 GB to index, 600 MB of it held
// with the Object.
func TestIndexStaysSmall(t *testing.T) {
	const n = 1 << 20
	for _, member := range []string{`"":0,`, `"ab":1,`, `"\u0061":1,`} {
		b := []byte("{" + strings.Repeat(member, n/len(member)) + `"":0}`)
		var before, after, held runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		o, err := Parse(b)
		runtime.ReadMemStats(&after)
		runtime.GC()
		runtime.ReadMemStats(&held)
		if err != nil {
			t.Fatal(err)
		}
		if got := after.TotalAlloc - before.TotalAlloc; got > 20*uint64(len(b)) {
			t.Errorf("%d members of %s: Parse allocated %d bytes for a %d-byte body, want at most 20 times it", len(o.members), member, got, len(b))
		}
		if got := held.HeapAlloc - before.HeapAlloc; got > 6*uint64(len(b)) {
			t.Errorf("%d members of %s: the Object holds %d bytes for a %d-byte body, want at most 6 times it", len(o.members), member, got, len(b))
		}
		runtime.KeepAlive(o)
	}
}
