// Package body reads the few fields routing needs from an OpenAI-style JSON
// request body and applies edits by splicing bytes, so that everything a client
// sent and we do not edit reaches the engine byte for byte (big integers, key
// order, whitespace, unknown fields). The body is never decoded into a map; an
// edit inside a nested object (nested.go) re-splices only that object.
package body

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"math"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
)

// Object is a validated JSON object whose top-level members are located by offset.
// It does not copy the body; the caller must not modify it while the Object is used.
type Object struct {
	raw     []byte
	members []member
	names   []string // the keys with escapes, decoded
	open    int      // offset just after '{'
	close   int      // offset of the final '}'
}

// member is 16 bytes, its key read from the body: a body of tiny members
// ({"":0,"":0,...}) is indexed in about three times its size.
type member struct {
	start    uint32 // offset of the key's opening quote
	valStart uint32
	valEnd   uint32
	name     uint32 // 1 + the index in names of a key with escapes, or 0
}

// is reports whether m's key is key, decoded, so that "kv\u005ftransfer_params"
// matches like Python's json does. A key without escapes is its bytes: when
// they start with key and a quote follows, that quote ends the key (a quote,
// backslash or control byte in key would end it sooner).
func (o *Object) is(m member, key string) bool {
	if m.name > 0 {
		return o.names[m.name-1] == key
	}
	end := int(m.start) + 1 + len(key)
	return end < int(m.valStart) && o.raw[end] == '"' && string(o.raw[m.start+1:end]) == key
}

// ErrNotObject is returned for valid JSON whose top level is not an object.
var ErrNotObject = errors.New("request body must be a JSON object")

var errTooLarge = errors.New("request body is 4 GiB or more")

// Parse validates b once (JSON syntax, UTF-8, nesting depth) and indexes its members.
func Parse(b []byte) (*Object, error) {
	if i := skipSpace(b, 0); i < len(b) && b[i] != '{' && json.Valid(b) {
		return nil, ErrNotObject // read at once: a list's millions of numbers
	}
	var sc Scanner
	return sc.Object(b)
}

// Scanner validates a body while its chunks arrive, so that when the last one
// comes only the tail is left to scan. The zero Scanner is ready; Scan it the
// body so far as it grows, then call Object with the whole body. Each Scan
// goes on where the previous one stopped (inside a string, at its last whole
// character; else at the start of the unfinished token) and waits for at
// least as many new bytes as it would look at again, so a body costs at most
// about three scans whatever its chunks, and one and a bit in practice.
type Scanner struct {
	s       scanner
	utf8    utf8Stream
	started bool
	err     error // the first error: the body is invalid whatever follows
	scanned int   // bytes seen so far, those looked at twice counted twice (for tests)
}

// minScanStep is the least new data worth a Scan: below it the bookkeeping
// would cost more than the scan it saves.
const minScanStep = 16 << 10

// Scan validates what is new in sofar, the body received so far; each call's
// sofar must begin with the previous one's bytes.
func (sc *Scanner) Scan(sofar []byte) {
	if sc.err != nil || len(sofar)-len(sc.s.b) < max(minScanStep, len(sc.s.b)-sc.s.resume()) {
		return
	}
	sc.step(sofar, false)
}

// Object finishes the scan of the whole body b and returns its index.
func (sc *Scanner) Object(b []byte) (*Object, error) {
	if sc.err == nil {
		sc.step(b, true)
	}
	switch {
	case sc.err == errNotUTF8 || sc.err == ErrNotObject || sc.err == errTooLarge:
		return nil, sc.err
	case sc.err != nil:
		return nil, fmt.Errorf("request body is not valid JSON: %w", sc.err)
	}
	close := len(b) - 1
	for b[close] != '}' {
		close--
	}
	return &Object{raw: b, members: sc.s.members, names: sc.s.names, open: sc.s.open, close: close}, nil
}

func (sc *Scanner) step(b []byte, final bool) {
	if !sc.started {
		if !final && len(b) < len(bom) && strings.HasPrefix(bom, string(b)) {
			return // a BOM may be cut
		}
		sc.s, sc.started = newScanner(b), true
	}
	sc.scanned += len(b) - sc.s.resume()
	if uint64(len(b)) > math.MaxUint32 {
		sc.err = errTooLarge // for member's offsets
		return
	}
	if !sc.utf8.feed(b, final) {
		sc.err = errNotUTF8
		return
	}
	sc.s.b, sc.s.final = b, final
	err := sc.s.run()
	switch {
	case err == errMore:
	case err != nil:
		sc.err = err
	case sc.s.open < 0:
		sc.err = ErrNotObject
	}
}

// Bytes returns the body the Object was parsed from.
func (o *Object) Bytes() []byte { return o.raw }

// Raw returns the raw JSON value of key. Like Python's json module, which vLLM and
// SGLang use, the last duplicate wins.
func (o *Object) Raw(key string) ([]byte, bool) {
	for i := len(o.members) - 1; i >= 0; i-- {
		if m := o.members[i]; o.is(m, key) {
			return o.raw[m.valStart:m.valEnd], true
		}
	}
	return nil, false
}

// Has reports whether key is present (with any value, null included).
func (o *Object) Has(key string) bool {
	_, ok := o.Raw(key)
	return ok
}

// String returns key's value when it is a JSON string.
func (o *Object) String(key string) (string, bool) {
	raw, ok := o.Raw(key)
	if !ok || raw[0] != '"' {
		return "", false
	}
	s, err := decodeString(raw)
	return s, err == nil
}

// Int returns key's value when it is a JSON integer that fits in an int64.
func (o *Object) Int(key string) (int64, bool) {
	raw, ok := o.Raw(key)
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil {
		return 0, false // not the clamped value ParseInt returns on overflow
	}
	return n, true
}

// Object returns key's value when it is a JSON object, indexed like the body
// itself (the last duplicate, as everywhere).
func (o *Object) Object(key string) (*Object, bool) {
	raw, ok := o.Raw(key)
	if !ok || raw[0] != '{' {
		return nil, false
	}
	sub, err := Parse(raw)
	return sub, err == nil
}

// Bool returns key's value when it is true or false.
func (o *Object) Bool(key string) (value, ok bool) {
	raw, ok := o.Raw(key)
	switch {
	case !ok:
		return false, false
	case string(raw) == "true":
		return true, true
	case string(raw) == "false":
		return false, true
	}
	return false, false
}

// Items yields the elements of raw, a JSON array as an Object's Raw returns
// it (so already validated), without decoding them or keeping them: nothing
// when raw is not an array. A body's arrays may hold millions of elements.
func Items(raw []byte) iter.Seq[[]byte] {
	return func(yield func([]byte) bool) {
		i := skipSpace(raw, 0)
		if i == len(raw) || raw[i] != '[' {
			return
		}
		for i = skipSpace(raw, i+1); i < len(raw) && raw[i] != ']'; {
			end := valueEnd(raw, i)
			if !yield(raw[i:end]) {
				return
			}
			if i = skipSpace(raw, end); i < len(raw) && raw[i] == ',' {
				i = skipSpace(raw, i+1)
			}
		}
	}
}

// Members yields the members of raw, a JSON object as an Object's Raw
// returns it (so already validated), in order, duplicates included: each key
// as spelt (quotes and escapes included) and its value, without decoding or
// indexing them. Nothing when raw is not an object.
func Members(raw []byte) iter.Seq2[[]byte, []byte] {
	return func(yield func(key, value []byte) bool) {
		i := skipSpace(raw, 0)
		if i == len(raw) || raw[i] != '{' {
			return
		}
		for i = skipSpace(raw, i+1); i < len(raw) && raw[i] == '"'; {
			keyEnd := valueEnd(raw, i)
			start := skipSpace(raw, skipSpace(raw, keyEnd)+1) // past the colon
			end := valueEnd(raw, start)
			if !yield(raw[i:keyEnd], raw[start:end]) {
				return
			}
			if i = skipSpace(raw, end); i < len(raw) && raw[i] == ',' {
				i = skipSpace(raw, i+1)
			}
		}
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// valueEnd returns the end of the valid JSON value that starts at i.
func valueEnd(b []byte, i int) int {
	depth := 0
	for ; i < len(b); i++ {
		switch b[i] {
		case '"':
			i = stringEnd(b, i+1)
			if depth == 0 {
				return min(i+1, len(b))
			}
		case '[', '{':
			depth++
		case ']', '}':
			if depth == 0 {
				return i // a number or literal ended with its array
			}
			if depth--; depth == 0 {
				return i + 1
			}
		case ',', ' ', '\t', '\n', '\r':
			if depth == 0 {
				return i
			}
		}
	}
	return i
}

// stringEnd returns the offset of the quote that ends the string whose
// content starts at i (len(b) when none does): the first quote after i not
// escaped by an odd run of backslashes. Strings are most of a body's bytes,
// and IndexByte reads them many at a time.
func stringEnd(b []byte, i int) int {
	for {
		j := bytes.IndexByte(b[i:], '"')
		if j < 0 {
			return len(b)
		}
		i += j
		k := i - 1
		for b[k] == '\\' { // the string's opening quote ends the run
			k--
		}
		if (i-1-k)%2 == 0 {
			return i
		}
		i++
	}
}

// IsNull reports whether raw is the JSON literal null.
func IsNull(raw []byte) bool { return string(raw) == "null" }

// decodeString decodes a validated JSON string, copying it out of the body.
func decodeString(raw []byte) (string, error) {
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw[1 : len(raw)-1]), nil
	}
	var s string
	err := json.Unmarshal(raw, &s)
	return s, err
}

// DecodeString decodes raw, a JSON string from a validated body (valid
// UTF-8, valid escapes), as encoding/json does, without validating it again.
func DecodeString(raw []byte) string {
	s := raw[1 : len(raw)-1]
	if bytes.IndexByte(s, '\\') < 0 {
		return string(s)
	}
	var out strings.Builder
	out.Grow(len(s))
	for {
		i := bytes.IndexByte(s, '\\')
		if i < 0 {
			out.Write(s)
			return out.String()
		}
		out.Write(s[:i])
		c := s[i+1]
		s = s[i+2:]
		switch c {
		case 'b':
			out.WriteByte('\b')
		case 'f':
			out.WriteByte('\f')
		case 'n':
			out.WriteByte('\n')
		case 'r':
			out.WriteByte('\r')
		case 't':
			out.WriteByte('\t')
		case 'u':
			r := hexRune(s)
			s = s[4:]
			if utf16.IsSurrogate(r) {
				// A pair is one rune; a lone half is U+FFFD, and what follows it is read on its own.
				if len(s) >= 6 && s[0] == '\\' && s[1] == 'u' {
					if dec := utf16.DecodeRune(r, hexRune(s[2:])); dec != unicode.ReplacementChar {
						out.WriteRune(dec)
						s = s[6:]
						continue
					}
				}
				r = unicode.ReplacementChar
			}
			out.WriteRune(r)
		default: // '"', '\\', '/'
			out.WriteByte(c)
		}
	}
}

// hexRune reads the four hex digits that begin b.
func hexRune(b []byte) rune {
	var r rune
	for _, c := range b[:4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		default:
			c -= 'A' - 10
		}
		r = r<<4 | rune(c)
	}
	return r
}
