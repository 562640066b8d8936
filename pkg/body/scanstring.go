package body

import (
	"encoding/binary"
	"errors"
	"math/bits"
	"unicode/utf8"
)

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
