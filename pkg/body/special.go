//go:build !(goexperiment.simd && amd64)

package body

// Built with GOEXPERIMENT=simd on amd64, the body scanner uses AVX2
// (special_simd.go, utf8_simd.go); this is the portable build.

// utf8Vectorized is false: strings stop at each non-ASCII character, whose
// UTF-8 the scanner checks as it goes.
const utf8Vectorized = false

// specials finds the next block that holds a byte ending a string's plain
// text; see specialsSWAR.
func specials(b []byte, i int) (base int, mask uint64, n int) { return specialsSWAR(b, i) }

// utf8Stream has nothing to do in the portable build.
type utf8Stream struct{}

func (*utf8Stream) feed([]byte, bool) bool { return true }
