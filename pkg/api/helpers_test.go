package api

import (
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// parsed is a test table's request body, parsed; one that does not parse
// fails the test.
func parsed(t *testing.T, raw string) *body.Object {
	t.Helper()
	o, err := body.Parse([]byte(raw))
	if err != nil {
		t.Fatalf("body.Parse(%s): %v", raw, err)
	}
	return o
}
