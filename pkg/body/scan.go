package body

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"unicode/utf8"
)

// maxDepth matches encoding/json's nesting limit, so a body is accepted here
// exactly when json.Valid and utf8.Valid both accept it (fuzzed in FuzzParse).
const maxDepth = 10000

// scanner validates a whole JSON document in one pass and, on the way, records
// the members of a top-level object. It replaces json.Valid + utf8.Valid + a
// second indexing pass: validation dominated the cost of a large body, and
// almost all of a prompt is string bytes, which are checked 8 at a time.
type scanner struct {
	b       []byte
	i       int
	stack   []byte // open containers, '{' or '['
	members []member
	open    int // offset of the top-level '{' + 1, or -1 when the top level is not an object
}

type syntaxError struct {
	msg string
	off int
}

func (e *syntaxError) Error() string { return fmt.Sprintf("%s at offset %d", e.msg, e.off) }

func (s *scanner) fail(msg string) error { return &syntaxError{msg, s.i} }

func (s *scanner) space() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// scan validates s.b. Top-level members are recorded only when the document is an object.
func (s *scanner) scan() error {
	s.open = -1
	s.space()
	if s.i < len(s.b) && s.b[s.i] == '{' {
		s.open = s.i + 1
	}
	cur := member{start: -1} // the top-level member being read
	for {
		// A value starts at s.i.
		if s.i >= len(s.b) {
			return s.fail("unexpected end of JSON")
		}
		switch c := s.b[s.i]; c {
		case '{', '[':
			if len(s.stack) >= maxDepth {
				return s.fail("JSON nested too deeply")
			}
			s.stack = append(s.stack, c)
			s.i++
			s.space()
			if s.i < len(s.b) && s.b[s.i] == c+2 { // '}' is '{'+2, ']' is '['+2
				s.i++
				s.stack = s.stack[:len(s.stack)-1]
				break
			}
			if c == '{' {
				if err := s.key(&cur); err != nil {
					return err
				}
			}
			continue
		case '"':
			if err := s.str(); err != nil {
				return err
			}
		case 't':
			if err := s.literal("true"); err != nil {
				return err
			}
		case 'f':
			if err := s.literal("false"); err != nil {
				return err
			}
		case 'n':
			if err := s.literal("null"); err != nil {
				return err
			}
		default:
			if err := s.number(); err != nil {
				return err
			}
		}
		// A value ended at s.i: close containers, or move to the next element.
		for {
			if len(s.stack) == 1 && s.open >= 0 && cur.start >= 0 {
				cur.valEnd = s.i
				s.members = append(s.members, cur)
				cur.start = -1
			}
			s.space()
			if len(s.stack) == 0 {
				if s.i != len(s.b) {
					return s.fail("data after the JSON value")
				}
				return nil
			}
			if s.i >= len(s.b) {
				return s.fail("unexpected end of JSON")
			}
			top := s.stack[len(s.stack)-1]
			if s.b[s.i] == top+2 {
				s.i++
				s.stack = s.stack[:len(s.stack)-1]
				continue
			}
			if s.b[s.i] != ',' {
				return s.fail("expected ',' or the end of a container")
			}
			s.i++
			s.space()
			if top == '{' {
				if err := s.key(&cur); err != nil {
					return err
				}
			}
			break
		}
	}
}

// key reads `"name" :` and leaves s.i on the value; at the top level it starts
// recording a member.
func (s *scanner) key(cur *member) error {
	if s.i >= len(s.b) || s.b[s.i] != '"' {
		return s.fail("expected a string key")
	}
	start := s.i
	if err := s.str(); err != nil {
		return err
	}
	keyEnd := s.i
	s.space()
	if s.i >= len(s.b) || s.b[s.i] != ':' {
		return s.fail("expected ':' after a key")
	}
	s.i++
	s.space()
	if len(s.stack) == 1 && s.open >= 0 {
		name, err := decodeKey(s.b[start:keyEnd])
		if err != nil {
			return err
		}
		*cur = member{name: name, start: start, valStart: s.i}
	}
	return nil
}

const (
	ones  = 0x0101010101010101
	highs = 0x8080808080808080
)

// plain reports whether none of the 8 bytes in w needs a closer look inside a
// string: no control character, quote or backslash. Bytes of multi-byte UTF-8
// sequences are plain: the whole body's UTF-8 was checked before the scan.
func plain(w uint64) bool {
	control := (w - ones*0x20) & ^w & highs
	quote := w ^ (ones * '"')
	backslash := w ^ (ones * '\\')
	special := (quote - ones) & ^quote & highs
	special |= (backslash - ones) & ^backslash & highs
	return (control|special)&^(w&highs) == 0
}

// str checks the string starting at s.i (a '"') and moves past it. Its text is
// read 8 bytes at a time while they hold no quote, backslash or control byte,
// and each non-ASCII character is decoded once, which checks its UTF-8: every
// byte of the string is looked at once.
func (s *scanner) str() error {
	b := s.b
	i := s.i + 1
	for {
		for i+8 <= len(b) {
			w := binary.LittleEndian.Uint64(b[i:])
			if !plain(w) {
				break
			}
			high := w & highs
			if high == 0 {
				i += 8
				continue
			}
			i += bits.TrailingZeros64(high) / 8
			for i < len(b) && b[i] >= utf8.RuneSelf { // a run of non-ASCII characters
				size := utf8Seq(b, i)
				if size == 0 {
					s.i = i
					return errNotUTF8
				}
				i += size
			}
		}
		if i >= len(b) {
			s.i = i
			return s.fail("unterminated string")
		}
		switch c := b[i]; {
		case c == '"':
			s.i = i + 1
			return nil
		case c == '\\':
			if i+1 >= len(b) {
				s.i = i
				return s.fail("unterminated escape")
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) || !hex4(b[i+2:i+6]) {
					s.i = i
					return s.fail("invalid \\u escape")
				}
				i += 6
			default:
				s.i = i
				return s.fail("invalid escape")
			}
		case c < 0x20:
			s.i = i
			return s.fail("control character in a string")
		case c < utf8.RuneSelf:
			i++
		default:
			size := utf8Seq(b, i)
			if size == 0 {
				s.i = i
				return errNotUTF8
			}
			i += size
		}
	}
}

// utf8Seq returns the length of the well-formed UTF-8 sequence that starts at
// b[i] (a byte >= 0x80), or 0 when there is none: the checks of utf8.Valid
// (no overlong forms, no surrogates, nothing above U+10FFFF) without decoding.
func utf8Seq(b []byte, i int) int {
	c := b[i]
	cont := func(j int) bool { return j < len(b) && b[j]&0xC0 == 0x80 }
	second := func(lo, hi byte) bool { return i+1 < len(b) && lo <= b[i+1] && b[i+1] <= hi }
	switch {
	case c < 0xC2:
		return 0
	case c < 0xE0:
		if cont(i + 1) {
			return 2
		}
	case c < 0xF0:
		lo, hi := byte(0x80), byte(0xBF)
		switch c {
		case 0xE0:
			lo = 0xA0 // else overlong
		case 0xED:
			hi = 0x9F // else a surrogate
		}
		if second(lo, hi) && cont(i+2) {
			return 3
		}
	case c < 0xF5:
		lo, hi := byte(0x80), byte(0xBF)
		switch c {
		case 0xF0:
			lo = 0x90 // else overlong
		case 0xF4:
			hi = 0x8F // else above U+10FFFF
		}
		if second(lo, hi) && cont(i+2) && cont(i+3) {
			return 4
		}
	}
	return 0
}

// errNotUTF8 is returned for a string that is not valid UTF-8. Outside strings
// every valid JSON byte is ASCII, so the strings are all there is to check.
var errNotUTF8 = errors.New("request body is not valid UTF-8")

func hex4(b []byte) bool {
	for _, c := range b {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

func (s *scanner) literal(word string) error {
	if len(s.b)-s.i < len(word) || string(s.b[s.i:s.i+len(word)]) != word {
		return s.fail("invalid literal")
	}
	s.i += len(word)
	return nil
}

// number checks -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? at s.i.
func (s *scanner) number() error {
	b := s.b
	i := s.i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && '1' <= b[i] && b[i] <= '9':
		i = digits(b, i)
	default:
		return s.fail("invalid character looking for a value")
	}
	if i < len(b) && b[i] == '.' {
		if i+1 >= len(b) || b[i+1] < '0' || b[i+1] > '9' {
			s.i = i
			return s.fail("invalid number")
		}
		i = digits(b, i+1)
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			s.i = i
			return s.fail("invalid number")
		}
		i = digits(b, i)
	}
	s.i = i
	return nil
}

func digits(b []byte, i int) int {
	for i < len(b) && '0' <= b[i] && b[i] <= '9' {
		i++
	}
	return i
}
