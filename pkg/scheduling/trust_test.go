package scheduling

import (
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// TestDecodeAnswersThatBelieTheEstimateEndTheTrust: three decode-only
// answers in a row that held less than half the assumed tokens stop the
// cache rule on that endpoint for distrustFor; one that held enough resets
// the count. Answers without the count say 0 only once the endpoint has
// stated it.
func TestDecodeAnswersThatBelieTheEstimateEndTheTrust(t *testing.T) {
	type report struct {
		assumed, held int
		absent        bool // the answer's usage has no details: held 0
	}
	miss, hit, absent := report{400, 0, false}, report{400, 384, false}, report{400, 0, true}
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
		{name: "half is enough", reports: []report{{400, 200, false}, {400, 200, false}, {400, 200, false}}, want: true},
		{name: "a hit between resets the count", reports: []report{miss, miss, hit, miss, miss}, want: true},
		{name: "nothing assumed tells nothing", reports: []report{{0, 0, false}, {0, 0, false}, {0, 0, false}}, want: true},
		{name: "an engine that never states the count", reports: []report{absent, absent, absent, absent}, want: true},
		{name: "once stated, an absent count is none", reports: []report{hit, absent, absent, absent}, want: false},
		{name: "stated by a miss", reports: []report{absent, miss, absent, absent}, want: false},
		{name: "trusted again after a while", reports: []report{miss, miss, miss}, after: distrustFor, want: true},
		{name: "not before", reports: []report{miss, miss, miss}, after: distrustFor - time.Second, want: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, policy(config.PolicyPrefixAffinity), "10.0.0.1:8000")
			e := p.Endpoints()[0]
			for _, r := range tt.reports {
				e.ReportCached(r.assumed, r.held, !r.absent)
			}
			clock.Advance(tt.after)
			if got := e.CacheTrusted(); got != tt.want {
				t.Fatalf("CacheTrusted() = %v, want %v", got, tt.want)
			}
		})
	}
}
