//go:build goexperiment.simd && amd64

package body

import (
	"math/rand/v2"
	"testing"
	"unicode/utf8"
)

// TestValidUTF8AgreesWithTheStandardLibrary puts every one- to three-byte
// sequence, and four-byte ones with edge values, at each offset around a block
// boundary, and checks random mixtures: the vector check must accept exactly
// what utf8.Valid accepts.
func TestValidUTF8AgreesWithTheStandardLibrary(t *testing.T) {
	if !avx2 {
		t.Skip("no AVX2: the scanner checks UTF-8 itself")
	}
	validUTF8 := func(b []byte) bool {
		var s utf8Stream
		return s.feed(b, true)
	}
	buf := make([]byte, 70)
	check := func(seq []byte) {
		for _, at := range []int{0, 29, 30, 31, 63} { // inside a block, across the boundary, at the end
			if at+len(seq) > len(buf) {
				continue
			}
			for i := range buf {
				buf[i] = 'a'
			}
			copy(buf[at:], seq)
			for _, n := range []int{len(buf), at + len(seq)} { // followed by ASCII, or ending the body
				if got, want := validUTF8(buf[:n]), utf8.Valid(buf[:n]); got != want {
					t.Fatalf("validUTF8(% x at %d of %d bytes) = %v, want %v", seq, at, n, got, want)
				}
			}
		}
	}
	conts := []byte{0x7F, 0x80, 0xBF, 0xC0} // around the continuation range
	edges := []byte{0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF}
	for b0 := 0x80; b0 <= 0xFF; b0++ {
		check([]byte{byte(b0)})
		for b1 := 0; b1 <= 0xFF; b1++ {
			check([]byte{byte(b0), byte(b1)})
		}
		for _, b1 := range edges { // the second byte decides every error but a missing continuation
			for _, b2 := range conts {
				check([]byte{byte(b0), b1, b2})
				if b0 >= 0xF0 {
					for _, b3 := range conts {
						check([]byte{byte(b0), b1, b2, b3})
					}
				}
			}
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []string{"a", "\"", "é", "東", "😀", "\x80", "\xc3", "\xe6\x9d", "\xf0\x9f\x98", "\xed\xa0\x80", "\xc0\xaf", "\xf4\x90\x80\x80"}
	for range 20000 {
		var b []byte
		for range rng.IntN(60) {
			b = append(b, alphabet[rng.IntN(len(alphabet))]...)
		}
		if got, want := validUTF8(b), utf8.Valid(b); got != want {
			t.Fatalf("validUTF8(% x) = %v, want %v", b, got, want)
		}
	}
}
