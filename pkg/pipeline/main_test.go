package pipeline_test

import (
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"

	"go.uber.org/goleak"
)

// No prefill leg, background or not, may outlive the tests that started it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newNIXL returns a kv-nixl pipeline with one prefill endpoint and the given
// prefill settings (a YAML flow mapping); background legs and idle connections end with the test.
func newNIXL(t *testing.T, prefill, settings string) *pipeline.Pipeline {
	t.Helper()
	return newPipelineFor(t, "kv-nixl", prefill, "prefill: "+settings)
}
