//go:build !(goexperiment.simd && amd64)

package body

// nextSpecial finds the end of a string's plain text; see nextSpecialSWAR.
// Built with GOEXPERIMENT=simd on amd64 it uses AVX2 (special_simd.go).
func nextSpecial(b []byte, i int) int { return nextSpecialSWAR(b, i) }
