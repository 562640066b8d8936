package metrics

import (
	"regexp"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/version"
)

// sample returns the value of one series (a histogram's sample count), and
// false when the series does not exist.
func sample(t *testing.T, m *Metrics, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	return m.Sample(name, labels)
}

func TestNilMetricsRecordNothing(t *testing.T) {
	var m *Metrics // what a pipeline or handler built without metrics holds
	m.StreamOpened()
	m.StreamClosed()
	m.ObserveRequest(Request{API: api.NameChat, Mode: ModePD, Reason: ReasonLongPrompt, Outcome: OutcomeRouted})
	m.RequestBody(10)
	m.PrefillAttempt(time.Second, FailureTimeout)
	m.UsageRewrite(UsageRewritten)
	m.KVParamsSuspect()
}

func TestPrefillAttemptOutcomes(t *testing.T) {
	tests := []struct {
		failure     Failure
		wantOutcome string
	}{
		{0, PrefillOK},
		{FailureStatus5xx, PrefillFailed},
		{FailureConnect, PrefillFailed},
		{FailureCancelled, PrefillCancelled},
		{FailureNoParams, PrefillFailed},
	}
	for _, tt := range tests {
		t.Run(tt.wantOutcome+"/"+tt.failure.String(), func(t *testing.T) {
			m := New("kv-nixl")
			m.PrefillAttempt(time.Second, tt.failure)
			for _, outcome := range prefillStates {
				want := 0.0
				if outcome == tt.wantOutcome {
					want = 1
				}
				if got, _ := sample(t, m, "pd_extproc_prefill_duration_seconds", map[string]string{"outcome": outcome}); got != want {
					t.Errorf("prefill_duration_seconds{outcome=%q} count = %v, want %v", outcome, got, want)
				}
			}
			for _, reason := range failureLabels[1:] {
				want := 0.0
				if reason == tt.failure.String() {
					want = 1
				}
				if got, _ := sample(t, m, "pd_extproc_prefill_failures_total", map[string]string{"reason": reason}); got != want {
					t.Errorf("prefill_failures_total{reason=%q} = %v, want %v", reason, got, want)
				}
			}
			if got, _ := sample(t, m, "pd_extproc_kv_params_missing_total", nil); got != map[bool]float64{true: 1}[tt.failure == FailureNoParams] {
				t.Errorf("kv_params_missing_total = %v, want 1 for %s alone", got, FailureNoParams)
			}
		})
	}
}

func TestSeriesExistBeforeTheFirstEvent(t *testing.T) {
	m := New("kv-sglang")
	tests := []struct {
		name   string
		labels map[string]string
	}{
		{"pd_extproc_requests_total", map[string]string{"api": api.NameChat, "mode": ModePD.String(), "connector": "kv-sglang", "outcome": OutcomeRouted}},
		{"pd_extproc_requests_total", map[string]string{"api": api.Other, "mode": ModeNone.String(), "connector": "kv-sglang", "outcome": Outcome4xx}},
		{"pd_extproc_pd_decisions_total", map[string]string{"reason": ReasonPrefillFailed.String()}},
		{"pd_extproc_prefill_failures_total", map[string]string{"reason": FailureTimeout.String()}},
		{"pd_extproc_request_processing_seconds", map[string]string{"mode": ModeDecodeOnly.String()}},
		{"pd_extproc_held_seconds", map[string]string{"pool": "decode", "outcome": HeldRefused}},
		{"pd_extproc_kv_params_missing_total", nil},
		{"pd_extproc_streams_in_flight", nil},
		{"pd_extproc_usage_rewrites_total", map[string]string{"outcome": UsagePrefillMissing}},
		{"pd_extproc_kv_params_suspect_total", nil},
	}
	for _, tt := range tests {
		if v, ok := sample(t, m, tt.name, tt.labels); !ok || v != 0 {
			t.Errorf("%s%v = %v, %v; want an existing zero series", tt.name, tt.labels, v, ok)
		}
	}
	if _, ok := sample(t, m, "pd_extproc_requests_total", map[string]string{"api": api.NameChat, "mode": ModeNone.String(), "connector": "kv-sglang", "outcome": OutcomeRouted}); ok {
		t.Error("requests_total{mode=none,outcome=routed} exists: a routed request always has a mode")
	}
}

func TestEndpointGaugesReadTheSourceAtEachScrape(t *testing.T) {
	m := New("kv-nixl")
	state := []EndpointState{{Pool: "decode", Endpoint: "10.0.0.2:8000", InFlight: 3, Healthy: true}}
	m.WatchEndpoints(func() []EndpointState { return state })
	steps := []struct {
		set                  EndpointState
		wantInflight, wantUp float64
	}{
		{EndpointState{Pool: "decode", Endpoint: "10.0.0.2:8000", InFlight: 3, Healthy: true}, 3, 1},
		{EndpointState{Pool: "decode", Endpoint: "10.0.0.2:8000", InFlight: 0, Healthy: false}, 0, 0},
	}
	for _, s := range steps {
		state = []EndpointState{s.set}
		labels := map[string]string{"pool": "decode", "endpoint": "10.0.0.2:8000"}
		if got, _ := sample(t, m, "pd_extproc_endpoint_inflight", labels); got != s.wantInflight {
			t.Errorf("endpoint_inflight = %v, want %v", got, s.wantInflight)
		}
		if got, _ := sample(t, m, "pd_extproc_endpoint_healthy", labels); got != s.wantUp {
			t.Errorf("endpoint_healthy = %v, want %v", got, s.wantUp)
		}
	}
}

// The labels are the metrics' contract with dashboards and alerts: every
// value has one, none is empty or shared, and the zero values have none.
func TestReasonAndFailureLabels(t *testing.T) {
	for name, labels := range map[string][]string{"reasons": reasonLabels[:], "failures": failureLabels[:]} {
		seen := map[string]bool{}
		for i, l := range labels[1:] {
			if l == "" || seen[l] {
				t.Errorf("%s[%d] = %q: empty or repeated", name, i+1, l)
			}
			seen[l] = true
		}
	}
	if Reason(0).String() != "" || Failure(0).String() != "" || Reason(200).String() != "" {
		t.Error("the zero value, or one past the last, has a label")
	}
	if ReasonNGT1.String() != "n_gt_1" || FailureTooLarge.String() != "answer_too_large" || len(Reasons()) != 21 {
		t.Errorf("labels moved: %q, %q, %d reasons", ReasonNGT1, FailureTooLarge, len(Reasons()))
	}
}

// The build a replica runs is one series, whatever else is recorded.
func TestBuildInfo(t *testing.T) {
	b := version.Get()
	m := New("kv-nixl")
	got, ok := sample(t, m, "pd_extproc_build_info", map[string]string{"version": b.Version, "revision": b.Revision, "goversion": b.GoVersion})
	if !ok || got != 1 {
		t.Errorf("pd_extproc_build_info{version=%q, revision=%q, goversion=%q} = %v (%v), want 1", b.Version, b.Revision, b.GoVersion, got, ok)
	}
}

// A HELP text that lists a label's values, which is what /metrics tells an
// operator of them, lists every one.
func TestHelpListsEveryLabelValue(t *testing.T) {
	m := New("kv-nixl")
	m.WatchDiscovery([]string{"decode"}, func() []DiscoveryState { return nil })
	m.Limits(1, 1, 1)
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	help := map[string]string{}
	for _, f := range families {
		help[f.GetName()] = f.GetHelp()
	}
	tests := []struct {
		metric string
		values []string
	}{
		{"pd_extproc_requests_total", outcomes},
		{"pd_extproc_prefill_duration_seconds", prefillStates},
		{"pd_extproc_prefill_failures_total", failureLabels[1:]},
		{"pd_extproc_pd_decisions_total", Reasons()},
		{"pd_extproc_limit_refusals_total", limitNames},
		{"pd_extproc_limit_configured", []string{LimitStreams, LimitBuffered, LimitBackground}},
		{"pd_extproc_held_seconds", heldOutcomes},
		{"pd_extproc_config_reloads_total", []string{ReloadApplied, ReloadRejected}},
		{"pd_extproc_discovery_errors_total", discoveryReasons},
		{"pd_extproc_tokenize_seconds", []string{"ok", "failed"}},
	}
	for _, tt := range tests {
		h, ok := help[tt.metric]
		if !ok {
			t.Errorf("%s is not registered", tt.metric)
			continue
		}
		for _, v := range tt.values {
			if !regexp.MustCompile(`\b` + regexp.QuoteMeta(v) + `\b`).MatchString(h) {
				t.Errorf("%s's HELP does not name the value %s: %q", tt.metric, v, h)
			}
		}
	}
}
