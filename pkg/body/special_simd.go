//go:build goexperiment.simd && amd64

package body

import (
	"math/bits"
	"simd/archsimd"
)

var avx2 = archsimd.X86.AVX2()

// nextSpecial finds the end of a string's plain text, as nextSpecialSWAR
// does, 32 bytes at a time with AVX2. Read as signed, the bytes below 0x20
// are both the control bytes and the non-ASCII ones (0x80 and up are
// negative): one compare finds them all.
func nextSpecial(b []byte, i int) int {
	if !avx2 {
		return nextSpecialSWAR(b, i)
	}
	quote, backslash := archsimd.BroadcastInt8x32('"'), archsimd.BroadcastInt8x32('\\')
	space := archsimd.BroadcastInt8x32(0x20)
	for ; i+32 <= len(b); i += 32 {
		v := archsimd.LoadUint8x32Slice(b[i : i+32]).AsInt8x32()
		m := v.Equal(quote).Or(v.Equal(backslash)).Or(space.Greater(v)).ToBits()
		if m != 0 {
			return i + bits.TrailingZeros32(m)
		}
	}
	return nextSpecialSWAR(b, i)
}
