//go:build race

package scheduling

// The race detector makes the simulations some eight times slower and finds
// nothing in them (each runs on one goroutine): make test runs them without
// it.
func init() { raceDetector = true }
