//go:build goexperiment.simd && amd64

package body

import (
	"encoding/binary"
	"simd/archsimd"
)

// minVector is how much of a string is looked at 8 bytes at a time before
// AVX2 is worth setting up.
const minVector = 16

var (
	avx2 = archsimd.X86.AVX2()
	// utf8Vectorized: with AVX2 the body's UTF-8 is checked apart, 32 bytes at
	// a time (utf8Stream), and strings do not stop at non-ASCII characters.
	utf8Vectorized     = avx2
	vQuote, vBackslash = archsimd.BroadcastUint8x32('"'), archsimd.BroadcastUint8x32('\\')
	vControl           = archsimd.BroadcastUint8x32(0x1F)
)

// specials finds the first block from b[i] that holds a byte ending a
// string's plain text, as specialsSWAR does. Most strings in a body are short
// (keys, roles, numbers as text), and AVX2 costs more than it saves on them,
// so the first 16 bytes are looked at 8 at a time; from there on, blocks are
// 32 bytes (fewer at the end of b), marked exactly. Without AVX2 it is
// specialsSWAR.
func specials(b []byte, i int) (base int, mask uint64, n int) {
	if !avx2 || len(b)-i < minVector+32 {
		return specialsSWAR(b, i)
	}
	for end := i + minVector; i < end; i += 8 {
		// high 0: with AVX2, UTF-8 is checked apart (utf8Stream).
		if w := swarSpecial(binary.LittleEndian.Uint64(b[i:]), 0); w != 0 {
			return i, byteBits(w), 8
		}
	}
	for ; i+32 <= len(b); i += 32 {
		if m := specialMask(archsimd.LoadUint8x32Slice(b[i : i+32])); m != 0 {
			return i, uint64(m), 32
		}
	}
	n = len(b) - i
	m := specialMask(archsimd.LoadUint8x32SlicePart(b[i:])) // padded with zeros, which the mask drops
	return i, uint64(m) & (1<<n - 1), n
}

// specialMask marks the quotes, backslashes and control bytes of v.
func specialMask(v archsimd.Uint8x32) uint32 {
	return v.Equal(vQuote).Or(v.Equal(vBackslash)).Or(v.Min(vControl).Equal(v)).ToBits()
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
