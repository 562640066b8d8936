//go:build goexperiment.simd && amd64

package body

import "simd/archsimd"

// utf8Blocks validates UTF-8 32 bytes at a time, after Keiser and Lemire,
// "Validating UTF-8 in less than one instruction per byte" (2021): three
// table lookups on the nibbles of each byte and of the byte before it find
// every error two bytes can show, and the bytes two and three back find a
// missing or extra continuation. What a block leaves unfinished is carried
// into the next, so a body can be checked as it arrives.
type utf8Blocks struct {
	prev       archsimd.Uint8x32 // the previous block
	incomplete archsimd.Uint8x32 // non-zero where the previous block ended inside a sequence
	errs       archsimd.Uint8x32 // non-zero once an error was seen
}

// The error classes of two consecutive bytes, as bits.
const (
	tooShort   = 1 << 0 // 11______ 0_______, 11______ 11______
	tooLong    = 1 << 1 // 0_______ 10______
	overlong3  = 1 << 2 // 11100000 100_____
	tooLarge   = 1 << 3 // 11110100 1001____, 11110100 101_____, 11110101+ 10______
	surrogate  = 1 << 4 // 11101101 101_____
	overlong2  = 1 << 5 // 1100000_ 10______
	tooLarge1k = 1 << 6 // 11110101+ 1000____
	overlong4  = 1 << 6 // 11110000 1000____
	twoConts   = 1 << 7 // 10______ 10______
	carry      = tooShort | tooLong | twoConts
)

// table repeats a 16-entry lookup table in both lanes, as PermuteOrZeroGrouped reads it.
func table(t [16]uint8) archsimd.Uint8x32 {
	var b [32]uint8
	copy(b[:16], t[:])
	copy(b[16:], t[:])
	return archsimd.LoadUint8x32(&b)
}

var (
	byte1High = table([16]uint8{
		tooLong, tooLong, tooLong, tooLong, tooLong, tooLong, tooLong, tooLong, // 0_______ (ASCII)
		twoConts, twoConts, twoConts, twoConts, // 10______
		tooShort | overlong2,             // 1100____
		tooShort,                         // 1101____
		tooShort | overlong3 | surrogate, // 1110____
		tooShort | tooLarge | tooLarge1k | overlong4, // 1111____
	})
	byte1Low = table([16]uint8{
		carry | overlong3 | overlong2 | overlong4, // ____0000
		carry | overlong2,                         // ____0001
		carry, carry,                              // ____001_
		carry | tooLarge,                                             // ____0100
		carry | tooLarge | tooLarge1k,                                // ____0101
		carry | tooLarge | tooLarge1k, carry | tooLarge | tooLarge1k, // ____011_
		carry | tooLarge | tooLarge1k, carry | tooLarge | tooLarge1k, // ____1___
		carry | tooLarge | tooLarge1k, carry | tooLarge | tooLarge1k,
		carry | tooLarge | tooLarge1k,
		carry | tooLarge | tooLarge1k | surrogate, // ____1101
		carry | tooLarge | tooLarge1k, carry | tooLarge | tooLarge1k,
	})
	byte2High = table([16]uint8{
		tooShort, tooShort, tooShort, tooShort, tooShort, tooShort, tooShort, tooShort, // 0_______
		tooLong | overlong2 | twoConts | overlong3 | tooLarge1k | overlong4, // 1000____
		tooLong | overlong2 | twoConts | overlong3 | tooLarge,               // 1001____
		tooLong | overlong2 | twoConts | surrogate | tooLarge,               // 101_____
		tooLong | overlong2 | twoConts | surrogate | tooLarge,
		tooShort, tooShort, tooShort, tooShort, // 11______
	})
	nibble = archsimd.BroadcastUint8x32(0x0F)
	fours  = archsimd.BroadcastUint32x8(4)
	bit7   = archsimd.BroadcastUint8x32(0x80)
	third  = archsimd.BroadcastUint8x32(0xE0 - 0x80) // a byte two back at or above 0xE0 leaves 0x80 or more
	fourth = archsimd.BroadcastUint8x32(0xF0 - 0x80) // a byte three back at or above 0xF0 leaves 0x80 or more
	// unfinished is exceeded only by a lead byte too close to the end of a block.
	unfinished = func() archsimd.Uint8x32 {
		var b [32]uint8
		for i := range b {
			b[i] = 0xFF
		}
		b[29], b[30], b[31] = 0xF0-1, 0xE0-1, 0xC0-1
		return archsimd.LoadUint8x32(&b)
	}()
)

// before returns in with each byte replaced by the one n bytes earlier in the
// stream, the first n coming from the end of prev.
func before(in, prev archsimd.Uint8x32, n uint8) archsimd.Uint8x32 {
	// [prev's high half, in's low half], then per 16-byte lane: the lane of in
	// shifted right over its predecessor by 16-n bytes.
	straddle := prev.Select128FromPair(1, 2, in)
	switch n {
	case 1:
		return in.ConcatShiftBytesRightGrouped(16-1, straddle)
	case 2:
		return in.ConcatShiftBytesRightGrouped(16-2, straddle)
	}
	return in.ConcatShiftBytesRightGrouped(16-3, straddle)
}

// highNibbles returns each byte's top four bits. The shift is per 32-bit lane
// by a vector of 4s (VPSRLVD): ShiftAllRight's count goes through a non-VEX
// MOVQ, and mixing that with AVX2 costs more than the whole check.
func highNibbles(v archsimd.Uint8x32) archsimd.Int8x32 {
	return v.AsUint32x8().ShiftRight(fours).AsUint8x32().And(nibble).AsInt8x32()
}

// block checks the next 32 bytes of the stream.
func (u *utf8Blocks) block(in archsimd.Uint8x32) {
	if in.And(bit7).IsZero() { // ASCII: only a sequence left open before it can be wrong
		u.errs = u.errs.Or(u.incomplete)
		u.prev, u.incomplete = in, archsimd.Uint8x32{}
		return
	}
	prev1 := before(in, u.prev, 1)
	special := byte1High.PermuteOrZeroGrouped(highNibbles(prev1)).
		And(byte1Low.PermuteOrZeroGrouped(prev1.And(nibble).AsInt8x32())).
		And(byte2High.PermuteOrZeroGrouped(highNibbles(in)))
	mustContinue := before(in, u.prev, 2).SubSaturated(third).Or(before(in, u.prev, 3).SubSaturated(fourth)).And(bit7)
	u.errs = u.errs.Or(mustContinue.Xor(special))
	u.prev, u.incomplete = in, in.SubSaturated(unfinished)
}

// valid reports whether the stream so far has no error; complete also
// requires that it does not end inside a sequence.
func (u *utf8Blocks) valid(complete bool) bool {
	if complete {
		return u.errs.Or(u.incomplete).IsZero()
	}
	return u.errs.IsZero()
}
