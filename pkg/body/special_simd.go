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
	avx2               = archsimd.X86.AVX2()
	vQuote, vBackslash = archsimd.BroadcastInt8x32('"'), archsimd.BroadcastInt8x32('\\')
	vSpace             = archsimd.BroadcastInt8x32(0x20)
)

// nextSpecial finds the end of a string's plain text, as nextSpecialSWAR
// does. Most strings in a body are short (keys, roles, numbers as text), and
// prompts are dense with escapes and non-ASCII characters, so it first looks
// at 16 bytes 8 at a time, and only a longer plain run goes to AVX2, 32 bytes
// at a time. Read as signed, the bytes below 0x20 are both the control bytes
// and the non-ASCII ones (0x80 and up are negative): one compare finds them all.
func nextSpecial(b []byte, i int) int {
	if !avx2 || len(b)-i < 32+minVector {
		return nextSpecialSWAR(b, i)
	}
	if j := nextSpecialSWAR(b[:i+minVector], i); j < i+minVector {
		return j
	}
	for i += minVector; i+32 <= len(b); i += 32 {
		v := archsimd.LoadUint8x32Slice(b[i : i+32]).AsInt8x32()
		m := v.Equal(vQuote).Or(v.Equal(vBackslash)).Or(vSpace.Greater(v)).ToBits()
		if m != 0 {
			return i + bits.TrailingZeros32(m)
		}
	}
	return nextSpecialSWAR(b, i)
}
