package scheduling

import (
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// TestDecodeAnswersThatBelieTheEstimateEndTheTrust: three decode-only
// answers in a row that held less than half the assumed tokens stop the
// cache rule on that endpoint for distrustFor; one that held enough resets
// the count.
func TestDecodeAnswersThatBelieTheEstimateEndTheTrust(t *testing.T) {
	type report struct{ assumed, held int }
	miss, hit := report{400, 0}, report{400, 384}
	tests := []struct {
		name    string
		reports []report
		after   time.Duration // clock advance after the reports
		want    bool
	}{
		{name: "no answers yet", want: true},
		{name: "answers that held it", reports: []report{hit, hit, hit}, want: true},
		{name: "two misses", reports: []report{miss, miss}, want: true},
		{name: "three misses", reports: []report{miss, miss, miss}, want: false},
		{name: "half is enough", reports: []report{{400, 200}, {400, 200}, {400, 200}}, want: true},
		{name: "a hit between resets the count", reports: []report{miss, miss, hit, miss, miss}, want: true},
		{name: "nothing assumed tells nothing", reports: []report{{0, 0}, {0, 0}, {0, 0}}, want: true},
		{name: "trusted again after a while", reports: []report{miss, miss, miss}, after: distrustFor, want: true},
		{name: "not before", reports: []report{miss, miss, miss}, after: distrustFor - time.Second, want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, policy(config.PolicyPrefixAffinity), "10.0.0.1:8000")
			e := p.Endpoints()[0]
			for _, r := range tt.reports {
				e.ReportCached(r.assumed, r.held)
			}
			clock.Advance(tt.after)
			if got := e.CacheTrusted(); got != tt.want {
				t.Fatalf("CacheTrusted() = %v, want %v", got, tt.want)
			}
		})
	}
}
