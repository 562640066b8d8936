package body

import (
	"bytes"
	"errors"
	"fmt"
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
	b        []byte
	final    bool // b is the whole document
	i        int
	state    uint8
	strFrom  int    // inside a string that ran out: where to go on; 0 when not in one
	stack    []byte // open containers, '{' or '['
	members  []member
	names    []string // the decoded keys with escapes
	cur      member   // the top-level member being read, when inMember
	inMember bool
	open     int // offset of the top-level '{' + 1, or -1 when the top level is not an object
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

// bom is the UTF-8 byte order mark. Python's json.loads, given bytes (as
// FastAPI's request.json() gives it the body), skips one at the start
// (detect_encoding picks utf-8-sig, Lib/json/__init__.py), so the engines
// take a body that starts with it; encoding/json does not.
const bom = "\xef\xbb\xbf"

// newScanner is a scanner of b's document, past one leading BOM.
func newScanner(b []byte) scanner {
	if bytes.HasPrefix(b, []byte(bom)) {
		return scanner{open: -1, i: len(bom)}
	}
	return scanner{open: -1}
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
	if len(s.stack) == 1 && s.inMember {
		s.cur.valStart = uint32(s.i)
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
	if len(s.stack) == 1 && s.inMember {
		s.cur.valEnd = uint32(s.i)
		if s.members == nil {
			s.members = make([]member, 0, 16) // a request's top-level keys; none for {}
		}
		s.members = append(s.members, s.cur)
		s.inMember = false
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
		s.cur, s.inMember = member{start: uint32(start)}, true
		if key := s.b[start:s.i]; bytes.IndexByte(key, '\\') >= 0 {
			s.names = append(s.names, DecodeString(key))
			s.cur.name = uint32(len(s.names))
		}
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

// literal reads word (true, false or null) at s.i; in a body still arriving,
// a prefix of it at the end may go on.
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
