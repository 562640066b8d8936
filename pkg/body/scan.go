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

// scanner validates a JSON document in one pass and, on the way, records the
// members of a top-level object. It replaces json.Valid + utf8.Valid + a second
// indexing pass: validation dominated the cost of a large body, and almost all
// of a prompt is string bytes, which are checked a block at a time (specials).
//
// It can also run on a body that is still arriving (final false): it stops
// where the bytes run out with errMore, at the start of the unfinished token
// or, inside a string, at the last whole character, and the next run goes on
// from there over a longer b.
type scanner struct {
	b       []byte
	final   bool // b is the whole document
	i       int
	state   uint8
	strFrom int    // inside a string that ran out: where to go on; 0 when not in one
	stack   []byte // open containers, '{' or '['
	members []member
	cur     member // the top-level member being read; start -1 when none
	open    int    // offset of the top-level '{' + 1, or -1 when the top level is not an object
}

// What the scanner expects at s.i.
const (
	stValue  uint8 = iota // a value
	stAfter               // the end of a value: ',' or the end of its container
	stKey                 // a member's key
	stColon               // the ':' after a key
	stOpened              // the first member or element of a container, or its end
	stDone                // nothing but trailing space
)

// resume is where the next run starts reading.
func (s *scanner) resume() int {
	if s.strFrom > 0 {
		return s.strFrom
	}
	return s.i
}

// errMore says the bytes ran out before the end of a document that is not final.
var errMore = errors.New("the body is incomplete")

type syntaxError struct {
	msg string
	off int
}

func (e *syntaxError) Error() string { return fmt.Sprintf("%s at offset %d", e.msg, e.off) }

func (s *scanner) fail(msg string) error { return &syntaxError{msg, s.i} }

// short is the answer when the bytes end inside a token: wait for more, or,
// when they are all there, the document is cut short.
func (s *scanner) short() error {
	if !s.final {
		return errMore
	}
	s.i = len(s.b)
	return s.fail("unexpected end of JSON")
}

// space skips whitespace and reports whether a byte follows.
func (s *scanner) space() bool {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return true
		}
	}
	return false
}

func newScanner() scanner {
	return scanner{members: make([]member, 0, 16), cur: member{start: -1}, open: -1}
}

// run scans s.b from where the last run stopped: nil when the document is
// complete and valid, errMore when it may go on, else the first error.
func (s *scanner) run() error {
	for {
		var err error
		switch s.state {
		case stValue:
			err = s.value()
		case stAfter:
			err = s.after()
		case stKey:
			err = s.key()
		case stColon:
			err = s.colon()
		case stOpened:
			err = s.opened()
		case stDone:
			switch {
			case s.space():
				return s.fail("data after the JSON value")
			case s.final:
				return nil
			}
			return errMore
		}
		if err != nil {
			return err
		}
	}
}

// value reads the value at s.i, or opens its container.
func (s *scanner) value() error {
	if !s.space() {
		return s.short()
	}
	if len(s.stack) == 1 && s.cur.start >= 0 {
		s.cur.valStart = s.i
	}
	switch c := s.b[s.i]; c {
	case '{', '[':
		if len(s.stack) >= maxDepth {
			return s.fail("JSON nested too deeply")
		}
		if len(s.stack) == 0 && c == '{' {
			s.open = s.i + 1
		}
		s.stack = append(s.stack, c)
		s.i++
		s.state = stOpened
		return nil
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
	s.state = stAfter
	return nil
}

// after closes containers or moves to the next element once a value ended at s.i.
func (s *scanner) after() error {
	if len(s.stack) == 1 && s.cur.start >= 0 {
		s.cur.valEnd = s.i
		s.members = append(s.members, s.cur)
		s.cur.start = -1
	}
	if len(s.stack) == 0 {
		s.state = stDone
		return nil
	}
	if !s.space() {
		return s.short()
	}
	top := s.stack[len(s.stack)-1]
	switch s.b[s.i] {
	case top + 2:
		s.i++
		s.stack = s.stack[:len(s.stack)-1]
		return nil
	case ',':
		s.i++
		s.state = stValue
		if top == '{' {
			s.state = stKey
		}
		return nil
	}
	return s.fail("expected ',' or the end of a container")
}

// key reads a member's key; at the top level it starts recording a member.
func (s *scanner) key() error {
	if !s.space() {
		return s.short()
	}
	if s.b[s.i] != '"' {
		return s.fail("expected a string key")
	}
	start := s.i // str leaves s.i on the opening quote until the string ends
	if err := s.str(); err != nil {
		return err
	}
	if len(s.stack) == 1 && s.open >= 0 {
		name, err := decodeString(s.b[start:s.i])
		if err != nil {
			return fmt.Errorf("request body has an invalid key: %w", err)
		}
		s.cur = member{name: name, start: start}
	}
	s.state = stColon
	return nil
}

// opened reads what follows '{' or '[': the container's end, or its first
// member or element.
func (s *scanner) opened() error {
	if !s.space() {
		return s.short()
	}
	top := s.stack[len(s.stack)-1]
	switch {
	case s.b[s.i] == top+2: // '}' is '{'+2, ']' is '['+2
		s.i++
		s.stack = s.stack[:len(s.stack)-1]
		s.state = stAfter
	case top == '{':
		s.state = stKey
	default:
		s.state = stValue
	}
	return nil
}

func (s *scanner) colon() error {
	if !s.space() {
		return s.short()
	}
	if s.b[s.i] != ':' {
		return s.fail("expected ':' after a key")
	}
	s.i++
	s.state = stValue
	return nil
}

// str checks the string starting at s.i (a '"') and moves past it. It reads
// the string a block at a time (specials): plain text costs nothing beyond
// the block, and each quote, escape, control byte and non-ASCII character
// found is taken from the block's mask, each non-ASCII character checked once
// as UTF-8 without decoding it. When the bytes run out in a body still
// arriving, s.i stays on the opening quote and s.strFrom keeps the place to
// go on from.
func (s *scanner) str() error {
	b := s.b
	i := s.strFrom
	if i == 0 {
		i = s.i + 1
	}
	s.strFrom = 0
	for i < len(b) {
		base, mask, n := specials(b, i)
		next := base // the first byte the specials handled so far leave
		for ; mask != 0; mask &= ^uint64(0) << (next - base) {
			j := base + bits.TrailingZeros64(mask)
			mask &= mask - 1
			switch c := b[j]; {
			case c == '"':
				s.i = j + 1
				return nil
			case c == '\\':
				if j+1 >= len(b) {
					return s.cut(j, "unterminated escape")
				}
				switch b[j+1] {
				case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
					next = j + 2
				case 'u':
					if j+6 > len(b) {
						return s.cut(j, "invalid \\u escape")
					}
					if !hex4(b[j+2 : j+6]) {
						s.i = j
						return s.fail("invalid \\u escape")
					}
					next = j + 6
				default:
					s.i = j
					return s.fail("invalid escape")
				}
			case c < 0x20:
				s.i = j
				return s.fail("control character in a string")
			case c >= utf8.RuneSelf && !utf8Vectorized:
				for next = j; next < len(b) && b[next] >= utf8.RuneSelf; { // a run of non-ASCII characters
					size := utf8Seq(b, next)
					switch {
					case size == 0 && !s.final && len(b)-next < utf8.UTFMax:
						s.strFrom = next // perhaps only cut short: go on from here
						return errMore
					case size == 0:
						s.i = next
						return errNotUTF8
					}
					next += size
				}
			}
			// Anything else is plain text a mask may also mark (specialsSWAR).
		}
		i = max(base+n, next)
	}
	return s.cut(i, "unterminated string")
}

// cut answers a string that runs past the bytes at b[at]: in a body still
// arriving, go on from there next time; in a whole body, fail with msg.
func (s *scanner) cut(at int, msg string) error {
	if !s.final {
		s.strFrom = at
		return errMore
	}
	s.i = at
	return s.fail(msg)
}

const (
	ones  = 0x0101010101010101
	highs = 0x8080808080808080
)

// specialsSWAR finds the first 8 bytes from b[i] (fewer at the end of b) that
// hold a byte ending a string's plain text: a quote, backslash, control byte
// or, unless utf8Vectorized, non-ASCII byte. It returns where they start, a
// mask with bit k set when byte k is such a byte, and how many bytes it
// covers; past plain text to the end of b, the mask is 0 and base+n is len(b).
// The borrows of its subtractions may also mark plain bytes after the first
// special one, which str looks at and passes over.
func specialsSWAR(b []byte, i int) (base int, mask uint64, n int) {
	high := uint64(highs)
	if utf8Vectorized {
		high = 0 // the whole body's UTF-8 is checked apart (utf8Stream)
	}
	for ; i+8 <= len(b); i += 8 {
		if w := swarSpecial(binary.LittleEndian.Uint64(b[i:]), high); w != 0 {
			return i, byteBits(w), 8
		}
	}
	var tail [8]byte // padded with zeros, which the mask drops
	n = copy(tail[:], b[i:])
	return i, byteBits(swarSpecial(binary.LittleEndian.Uint64(tail[:]), high)) & (1<<n - 1), n
}

// swarSpecial sets bit 7 of each byte of w that is a quote, a backslash, a
// control byte or, when high is highs, non-ASCII.
func swarSpecial(w, high uint64) uint64 {
	quote, backslash := w^(ones*'"'), w^(ones*'\\')
	return ((w-ones*0x20)&^w | w&high | (quote-ones)&^quote | (backslash-ones)&^backslash) & highs
}

// byteBits packs bit 7 of byte k into bit k.
func byteBits(w uint64) uint64 { return (w >> 7) * 0x0102040810204080 >> 56 }

// utf8Seq returns the length of the well-formed UTF-8 sequence that starts at
// b[i] (a byte >= 0x80), or 0 when there is none: the checks of utf8.Valid
// (no overlong forms, no surrogates, nothing above U+10FFFF) without decoding.
func utf8Seq(b []byte, i int) int {
	c := b[i]
	var n int // the sequence's length, from its lead byte
	switch {
	case c < 0xC2:
		return 0
	case c < 0xE0:
		n = 2
	case c < 0xF0:
		n = 3
	case c < 0xF5:
		n = 4
	default:
		return 0
	}
	if i+n > len(b) {
		return 0
	}
	// The second byte's range: narrower after four lead bytes.
	lo, hi := byte(0x80), byte(0xBF)
	switch c {
	case 0xE0:
		lo = 0xA0 // else overlong
	case 0xED:
		hi = 0x9F // else a surrogate
	case 0xF0:
		lo = 0x90 // else overlong
	case 0xF4:
		hi = 0x8F // else above U+10FFFF
	}
	if b[i+1] < lo || b[i+1] > hi || n > 2 && b[i+2]&0xC0 != 0x80 || n > 3 && b[i+3]&0xC0 != 0x80 {
		return 0
	}
	return n
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
	n := min(len(word), len(s.b)-s.i)
	if string(s.b[s.i:s.i+n]) != word[:n] {
		return s.fail("invalid literal")
	}
	if n < len(word) {
		return s.short()
	}
	s.i += len(word)
	return nil
}

// number checks -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? at s.i. In a body
// still arriving, a number that reaches the last byte may go on.
func (s *scanner) number() error {
	b := s.b
	i := s.i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i >= len(b):
		return s.short()
	case b[i] == '0':
		i++
	case '1' <= b[i] && b[i] <= '9':
		i = digits(b, i)
	default:
		return s.fail("invalid character looking for a value")
	}
	var err error
	if i < len(b) && b[i] == '.' {
		if i, err = s.someDigits(i + 1); err != nil {
			return err
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i, err = s.someDigits(i); err != nil {
			return err
		}
	}
	if i >= len(b) && !s.final {
		return errMore
	}
	s.i = i
	return nil
}

// someDigits reads the one or more digits a fraction or an exponent needs at b[i].
func (s *scanner) someDigits(i int) (int, error) {
	switch {
	case i >= len(s.b):
		return i, s.short()
	case s.b[i] < '0' || s.b[i] > '9':
		s.i = i
		return i, s.fail("invalid number")
	}
	return digits(s.b, i), nil
}

func digits(b []byte, i int) int {
	for i < len(b) && '0' <= b[i] && b[i] <= '9' {
		i++
	}
	return i
}
