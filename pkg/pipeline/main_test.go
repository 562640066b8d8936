package pipeline

import (
	"testing"

	"go.uber.org/goleak"
)

// No prefill leg, background or not, may outlive the tests that started it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
