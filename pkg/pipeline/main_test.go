package pipeline

import (
	"fmt"
	"testing"

	"github.com/go-logr/logr"
	"go.uber.org/goleak"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// No prefill leg, background or not, may outlive the tests that started it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newNIXL returns a kv-nixl pipeline with one prefill endpoint and the given
// prefill settings (a YAML flow mapping); its idle connections close with the test.
func newNIXL(t *testing.T, prefill, settings string) *Pipeline {
	t.Helper()
	cfg, err := config.Parse([]byte(fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: %s`, prefill, settings)))
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(cfg, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.client.CloseIdleConnections)
	return p
}
