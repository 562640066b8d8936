package envoyemu

import (
	"testing"

	"go.uber.org/goleak"
)

// Every exchange, stream and upstream goroutine must be gone once the
// proxies of a test are closed.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
