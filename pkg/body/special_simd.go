//go:build goexperiment.simd && amd64

package body

import (
	"math/bits"
	"simd/archsimd"
)

// minVector is how much plain text is looked at 8 bytes at a time before AVX2
// is worth setting up.
const minVector = 16

var (
	avx2 = archsimd.X86.AVX2()
	// utf8Vectorized: with AVX2 the body's UTF-8 is checked apart, 32 bytes at
	// a time (utf8Stream), and strings do not stop at non-ASCII characters.
	utf8Vectorized     = avx2
	vQuote, vBackslash = archsimd.BroadcastUint8x32('"'), archsimd.BroadcastUint8x32('\\')
	vControl           = archsimd.BroadcastUint8x32(0x1F)
)

// nextSpecial finds the end of a string's plain text, as nextSpecialSWAR
// does: quotes, backslashes and control bytes. Most strings in a body are
// short (keys, roles, numbers as text), so it first looks at 16 bytes 8 at a
// time, and only a longer plain run goes to AVX2, 32 bytes at a time.
func nextSpecial(b []byte, i int) int {
	if !avx2 || len(b)-i < 32+minVector {
		return nextSpecialSWAR(b, i)
	}
	if j := nextSpecialSWAR(b[:i+minVector], i); j < i+minVector {
		return j
	}
	for i += minVector; i+32 <= len(b); i += 32 {
		v := archsimd.LoadUint8x32Slice(b[i : i+32])
		m := v.Equal(vQuote).Or(v.Equal(vBackslash)).Or(v.Min(vControl).Equal(v)).ToBits()
		if m != 0 {
			return i + bits.TrailingZeros32(m)
		}
	}
	return nextSpecialSWAR(b, i)
}

// utf8Stream checks a body's UTF-8 as it arrives, 32 bytes at a time.
type utf8Stream struct {
	blocks utf8Blocks
	done   int // bytes checked so far
}

// feed checks what is new in b, the body so far (a whole one when final), and
// reports whether it is still valid UTF-8.
func (s *utf8Stream) feed(b []byte, final bool) bool {
	if !avx2 {
		return true // the scanner checks each non-ASCII character itself
	}
	for ; s.done+32 <= len(b); s.done += 32 {
		s.blocks.block(archsimd.LoadUint8x32Slice(b[s.done : s.done+32]))
	}
	if final && s.done < len(b) {
		s.blocks.block(archsimd.LoadUint8x32SlicePart(b[s.done:])) // padded with ASCII zeros
		s.done = len(b)
	}
	return s.blocks.valid(final)
}
