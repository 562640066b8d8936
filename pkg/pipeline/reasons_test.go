package pipeline

import (
	"slices"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// Every reason the pipeline reports must be a pd_decisions_total{reason} series
// that exists from start-up: metrics keeps its own list, being a leaf package.
func TestEveryDecisionReasonIsAMetricLabel(t *testing.T) {
	for _, r := range append(slices.Clone(scheduling.Reasons), metrics.ReasonPrefillFailed, metrics.ReasonNoBody) {
		if !slices.Contains(metrics.Reasons, r) {
			t.Errorf("reason %q is missing from metrics.Reasons", r)
		}
	}
}
