package body

import (
	"fmt"
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

// TestSpecialsMarkEveryByteThatEndsPlainText puts two byte values at every
// pair of positions of plain text long enough for two vector blocks and a
// tail, and walks it block by block from several offsets: specials (AVX2 when
// built with GOEXPERIMENT=simd) and specialsSWAR must both mark every quote,
// backslash, control byte and (unless UTF-8 is checked apart) non-ASCII byte,
// mark nothing before the first of them, and nothing past the bytes they cover.
func TestSpecialsMarkEveryByteThatEndsPlainText(t *testing.T) {
	special := func(c byte) bool { return c == '"' || c == '\\' || c < 0x20 || c >= utf8.RuneSelf && !utf8Vectorized }
	for name, f := range map[string]func([]byte, int) (int, uint64, int){"specials": specials, "specialsSWAR": specialsSWAR} {
		buf := make([]byte, 75)
		check := func(what string) {
			for _, from := range []int{0, 1, 31, 32, 40} {
				first := true // no special byte seen yet
				for i := from; i < len(buf); {
					base, mask, n := f(buf, i)
					if base < i || n < 1 || n > 32 || base+n > len(buf) || mask>>n != 0 || mask == 0 && base+n != len(buf) {
						t.Fatalf("%s(%s, %d) = %d, %b, %d: outside the bytes", name, what, i, base, mask, n)
					}
					for k := i; k < base+n; k++ {
						switch marked := k >= base && mask>>(k-base)&1 == 1; {
						case special(buf[k]) && !marked:
							t.Fatalf("%s(%s, %d) misses %#02x at %d", name, what, i, buf[k], k)
						case !special(buf[k]) && marked && first:
							t.Fatalf("%s(%s, %d) marks plain %#02x at %d", name, what, i, buf[k], k)
						}
						first = first && !special(buf[k])
					}
					i = base + n
				}
			}
		}
		for v := range 256 {
			for p := range buf {
				fill(buf, 'a')
				buf[p] = byte(v)
				check(fmt.Sprintf("%#02x at %d", v, p))
			}
		}
		for _, v := range []byte{'"', '\\', 0, 0x1f, 0x80, 0xff, '#', ']', 'a'} {
			for p := range buf {
				for q := p + 1; q < len(buf); q++ {
					fill(buf, 'a')
					buf[p], buf[q] = '\\', v
					check(fmt.Sprintf("backslash at %d, %#02x at %d", p, v, q))
				}
			}
		}
	}
}

func fill(b []byte, c byte) {
	for i := range b {
		b[i] = c
	}
}
