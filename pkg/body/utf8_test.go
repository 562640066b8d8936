package body

import (
	"testing"
	"unicode/utf8"
)

// TestUTF8SeqAgreesWithTheStandardDecoder checks utf8Seq against utf8.DecodeRune
// for every lead byte and every two following bytes, with the edge values of a
// fourth: the scanner's UTF-8 check must accept exactly what utf8.Valid does.
func TestUTF8SeqAgreesWithTheStandardDecoder(t *testing.T) {
	seq := make([]byte, 4)
	for b0 := 0x80; b0 <= 0xFF; b0++ {
		for b1 := 0; b1 <= 0xFF; b1++ {
			for b2 := 0; b2 <= 0xFF; b2++ {
				fourths := []byte{0x80} // only a 4-byte lead reads the fourth byte
				if b0 >= 0xF0 {
					fourths = []byte{0x00, 0x7F, 0x80, 0x9F, 0xBF, 0xC0}
				}
				for _, b3 := range fourths {
					seq[0], seq[1], seq[2], seq[3] = byte(b0), byte(b1), byte(b2), b3
					r, size := utf8.DecodeRune(seq)
					want := size
					if r == utf8.RuneError && size == 1 {
						want = 0
					}
					if got := utf8Seq(seq, 0); got != want {
						t.Fatalf("utf8Seq(% x) = %d, want %d", seq, got, want)
					}
				}
			}
		}
	}
	// Truncated sequences at the end of the body.
	for _, tail := range [][]byte{{0xC3}, {0xE3, 0x81}, {0xF0, 0x9F, 0x98}} {
		if got := utf8Seq(tail, 0); got != 0 {
			t.Errorf("utf8Seq(% x) = %d for a truncated sequence, want 0", tail, got)
		}
	}
}

// TestNextSpecialFindsEveryByteThatEndsPlainText puts each of the 256 byte
// values at each position of plain text long enough for two vector blocks and
// a tail, and starts the search at several offsets: nextSpecial (AVX2 when
// built with GOEXPERIMENT=simd) and nextSpecialSWAR must both stop exactly at
// quotes, backslashes, control bytes and (unless UTF-8 is checked apart)
// non-ASCII bytes, and nowhere else.
func TestNextSpecialFindsEveryByteThatEndsPlainText(t *testing.T) {
	special := func(c byte) bool { return c == '"' || c == '\\' || c < 0x20 || c >= utf8.RuneSelf && !utf8Vectorized }
	buf := make([]byte, 75)
	for v := 0; v < 256; v++ {
		for p := range buf {
			for i := range buf {
				buf[i] = 'a'
			}
			buf[p] = byte(v)
			for _, from := range []int{0, 1, 31, 32, 40} {
				want := len(buf)
				if special(byte(v)) && p >= from {
					want = p
				}
				if got := nextSpecial(buf, from); got != want {
					t.Fatalf("nextSpecial with %#02x at %d, from %d = %d, want %d", v, p, from, got, want)
				}
				if got := nextSpecialSWAR(buf, from); got != want {
					t.Fatalf("nextSpecialSWAR with %#02x at %d, from %d = %d, want %d", v, p, from, got, want)
				}
			}
		}
	}
}
