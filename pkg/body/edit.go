package body

import (
	"strconv"
	"unicode/utf8"
)

// Edit changes one member: of the body itself, or, with Path, of an object
// nested in it (see In). Value is raw JSON; a nil (or empty) Value deletes
// every occurrence of Key. A set replaces the first occurrence in place and
// drops the duplicates (an engine would otherwise read the last one), or
// appends the member when Key is absent — unless IfPresent, which only
// rewrites a key the client sent.
type Edit struct {
	Key       string
	Value     []byte
	IfPresent bool
	// Path names the objects Key is in, outermost first; empty for a
	// member of the body itself.
	Path []string
}

// Set returns an Edit that sets key to the raw JSON value.
func Set(key string, value []byte) Edit { return Edit{Key: key, Value: value} }

// SetIfPresent returns an Edit that rewrites key only when the body has it.
func SetIfPresent(key string, value []byte) Edit {
	return Edit{Key: key, Value: value, IfPresent: true}
}

// Delete returns an Edit that removes every occurrence of key.
func Delete(key string) Edit { return Edit{Key: key} }

// Common raw values.
var (
	True  = []byte("true")
	False = []byte("false")
	One   = []byte("1")
)

// Uint returns n as a raw JSON integer.
func Uint(n uint64) []byte { return strconv.AppendUint(nil, n, 10) }

// Quote returns s as a raw JSON string. Unlike strconv.Quote it only uses escapes
// JSON has (no \x, \v or \U), so any s, even one that is not UTF-8, gives valid
// JSON; invalid bytes become U+FFFD as with encoding/json.
func Quote(s string) []byte { return appendQuote(make([]byte, 0, len(s)+2), s) }

func appendQuote(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0 // s[start:i] still to be copied
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			i++
			continue
		}
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r != utf8.RuneError || size != 1 {
				i += size
				continue
			}
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i++
			start = i
			continue
		}
		dst = append(dst, s[start:i]...)
		switch c {
		case '"', '\\':
			dst = append(dst, '\\', c)
		case '\n':
			dst = append(dst, '\\', 'n')
		case '\r':
			dst = append(dst, '\\', 'r')
		case '\t':
			dst = append(dst, '\\', 't')
		default:
			dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		}
		i++
		start = i
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}

// Splice returns the body with the edits applied, as runs of the client's
// bytes with the edited values between them: nothing is copied but the
// nested objects an edit reaches into. When several edits name the same
// member the last one wins. Every byte outside the edited members is kept,
// including the separators and whitespace around the members that stay. The
// Object itself is not changed.
func (o *Object) Splice(edits ...Edit) Spliced {
	if o.reachesIn(edits) {
		edits = o.flatten(edits)
	}
	// The last edit of each key, in first-mention order (for deterministic
	// appends). Edits are a handful: a slice searched in order beats a map,
	// and it stays on the stack.
	var few [16]finalEdit
	final := few[:0]
	for _, e := range edits {
		if len(e.Path) > 0 {
			continue // reaches into nothing there: changes nothing (reachesIn)
		}
		if k := find(final, e.Key); k >= 0 {
			final[k].Edit = e
		} else {
			final = append(final, finalEdit{Edit: e})
		}
	}
	if !o.touches(final) {
		return Spliced{o.raw} // nothing to change
	}

	s := splicer{raw: o.raw, out: make(Spliced, 0, 2*len(final)+3), rawEnd: -1}
	wrote := false // a member has been written, so the next one needs a separator
	if len(o.members) == 0 {
		s.keep(0, uint32(o.close))
	} else {
		s.keep(0, o.members[0].start)
	}
	for i, m := range o.members {
		k := o.find(final, m)
		if k >= 0 && (len(final[k].Value) == 0 || final[k].placed) {
			continue // deleted, or a duplicate of a key already set
		}
		if wrote {
			s.keep(o.members[i-1].valEnd, m.start)
		}
		if k < 0 {
			s.keep(m.start, m.valEnd)
		} else {
			s.keep(m.start, m.valStart)
			s.add(final[k].Value)
			final[k].placed = true
		}
		wrote = true
	}
	for _, e := range final {
		if len(e.Value) == 0 || e.IfPresent || e.placed {
			continue
		}
		key := make([]byte, 0, len(e.Key)+4)
		if wrote {
			key = append(key, ',')
		}
		s.add(append(appendQuote(key, e.Key), ':'))
		s.add(e.Value)
		wrote = true
	}
	if len(o.members) == 0 {
		s.keep(uint32(o.close), uint32(len(o.raw)))
	} else {
		s.keep(o.members[len(o.members)-1].valEnd, uint32(len(o.raw)))
	}
	return s.out
}

// splicer builds a Spliced body, merging adjacent runs of the client's bytes.
type splicer struct {
	raw    []byte
	out    Spliced
	rawEnd int // where the last piece ends in raw; -1 when it is not raw
}

// keep adds raw[i:j], at offsets as members hold them.
func (s *splicer) keep(i32, j32 uint32) {
	i, j := int(i32), int(j32)
	switch {
	case i == j:
	case i == s.rawEnd:
		s.out[len(s.out)-1] = s.raw[i-len(s.out[len(s.out)-1]) : j]
		s.rawEnd = j
	default:
		s.out = append(s.out, s.raw[i:j])
		s.rawEnd = j
	}
}

// add adds bytes that are not the client's.
func (s *splicer) add(b []byte) {
	s.out = append(s.out, b)
	s.rawEnd = -1
}

// finalEdit is the edit in force for a key, and whether it has been written.
type finalEdit struct {
	Edit
	placed bool
}

func find(final []finalEdit, key string) int {
	for k := range final {
		if final[k].Key == key {
			return k
		}
	}
	return -1
}

// find is the edit in force for m's key, or -1.
func (o *Object) find(final []finalEdit, m member) int {
	for k := range final {
		if o.is(m, final[k].Key) {
			return k
		}
	}
	return -1
}

// touches reports whether applying the edits in force may change a byte:
// false when they only delete or rewrite keys the body does not have.
func (o *Object) touches(final []finalEdit) bool {
	for _, e := range final {
		if (len(e.Value) > 0 && !e.IfPresent) || o.Has(e.Key) {
			return true
		}
	}
	return false
}
