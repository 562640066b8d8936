package body

import (
	"reflect"
	"testing"
)

func TestSpliceKeepsTheClientsBytesInPlace(t *testing.T) {
	in := []byte(`{"model":"m","kv_transfer_params":{},"stream":true,"n":1}`)
	o, err := Parse(in)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		edits []Edit
		want  []string
	}{
		{"nothing to change is the body itself", []Edit{Delete("x")}, []string{string(in)}},
		{"a deletion leaves two runs", []Edit{Delete("kv_transfer_params")},
			[]string{`{"model":"m"`, `,"stream":true,"n":1}`}},
		{"a set in place puts the value between runs", []Edit{Set("stream", False)},
			[]string{`{"model":"m","kv_transfer_params":{},"stream":`, `false`, `,"n":1}`}},
		{"an appended member is its key, then its value", []Edit{Set("max_tokens", One)},
			[]string{`{"model":"m","kv_transfer_params":{},"stream":true,"n":1`, `,"max_tokens":`, `1`, `}`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := o.Splice(tt.edits...)
			got := make([]string, len(s))
			for i, p := range s {
				got[i] = string(p)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("pieces = %q, want %q", got, tt.want)
			}
			if &s[0][0] != &in[0] {
				t.Fatalf("the first piece is a copy of the body, not the body")
			}
			if s.Len() != len(s.Bytes()) {
				t.Fatalf("Len = %d, but Bytes has %d", s.Len(), len(s.Bytes()))
			}
		})
	}
}

func TestChunksCopyOnlyWhatSpansPieces(t *testing.T) {
	big := []byte("0123456789")
	tests := []struct {
		name    string
		pieces  Spliced
		max     int
		want    []string
		aliased []bool // the chunk is a piece's own bytes
	}{
		{"an empty body is one empty chunk", Spliced{}, 4, []string{""}, []bool{false}},
		{"one piece is cut in place", Spliced{big}, 4, []string{"0123", "4567", "89"}, []bool{true, true, true}},
		{"a chunk that spans pieces is copied", Spliced{big[:6], []byte("ab"), big[6:]}, 4,
			[]string{"0123", "45ab", "6789"}, []bool{true, false, true}},
		{"small pieces fill one chunk", Spliced{[]byte("a"), []byte("b"), []byte("c")}, 4,
			[]string{"abc"}, []bool{false}},
		{"chunks are full but the last", Spliced{big[:3], big[3:]}, 4, []string{"0123", "4567", "89"},
			[]bool{false, true, true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			chunks := tt.pieces.Chunks(tt.max)
			got := make([]string, len(chunks))
			for i, c := range chunks {
				got[i] = string(c)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("Chunks(%d) = %q, want %q", tt.max, got, tt.want)
			}
			for i, c := range chunks {
				if aliased := len(c) > 0 && aliases(tt.pieces, c); aliased != tt.aliased[i] {
					t.Errorf("chunk %d %q: aliased %v, want %v", i, c, aliased, tt.aliased[i])
				}
			}
		})
	}
}

// aliases reports whether c starts inside one of the pieces' memory.
func aliases(s Spliced, c []byte) bool {
	for _, p := range s {
		for i := range p {
			if &p[i] == &c[0] {
				return true
			}
		}
	}
	return false
}
