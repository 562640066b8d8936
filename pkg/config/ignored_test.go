package config

import (
	"slices"
	"testing"
)

// A key that does nothing without the key that turns it on is accepted, so
// that a file that loaded before still does, and named with that switch.
func TestIgnoredKeysNameTheirSwitch(t *testing.T) {
	const admission = "\nadmission: {saturated_queue: 3, saturated_kv_cache: 0.9, hold: 0s, max_held: 10, retry_after: 5s"
	const shedding = "objective of negative priority under admission.objectives)"
	admissionKeys := []string{"admission.saturated_queue (needs an " + shedding, "admission.saturated_kv_cache (needs an " + shedding,
		"admission.hold (needs an " + shedding, "admission.max_held (needs an " + shedding, "admission.retry_after (needs an " + shedding}
	tests := []struct {
		name, pools string
		want        []string
	}{
		{"none", `{decode: {endpoints: ["10.0.0.2:8000"]}}`, nil},
		{"dns_interval without dns", `{decode: {endpoints: ["10.0.0.2:8000"], dns_interval: 5s}}`,
			[]string{"pools.decode.dns_interval (needs pools.decode.dns)"}},
		{"dns_interval with dns", `{decode: {dns: "decode:8000", dns_interval: 5s}}`, nil},
		{"metrics settings without an interval", `{prefill: {endpoints: ["10.0.0.1:8000"], metrics: {path: /m, timeout: 1s, stale_after: 9s}}, decode: {endpoints: ["10.0.0.2:8000"]}}`,
			[]string{"pools.prefill.metrics.path (needs pools.prefill.metrics.interval)", "pools.prefill.metrics.timeout (needs pools.prefill.metrics.interval)",
				"pools.prefill.metrics.stale_after (needs pools.prefill.metrics.interval)"}},
		{"metrics settings with an interval", `{decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 1s, path: /m, timeout: 1s, stale_after: 9s}}}`, nil},
		{"the default path, written", `{decode: {endpoints: ["10.0.0.2:8000"], metrics: {path: /metrics}}}`,
			[]string{"pools.decode.metrics.path (needs pools.decode.metrics.interval)"}},
		{"check settings without an interval", `{decode: {endpoints: ["10.0.0.2:8000"], health: {check_path: /ready, unhealthy_threshold: 2, healthy_threshold: 2}}}`,
			[]string{"pools.decode.health.check_path (needs pools.decode.health.check_interval)", "pools.decode.health.unhealthy_threshold (needs pools.decode.health.check_interval)",
				"pools.decode.health.healthy_threshold (needs pools.decode.health.check_interval)"}},
		{"check settings with an interval", `{decode: {endpoints: ["10.0.0.2:8000"], health: {check_interval: 5s, check_path: /ready, unhealthy_threshold: 2, healthy_threshold: 2}}}`, nil},
		// check_timeout also bounds the model lists and SGLang's server info
		// asked of every engine; passive ejection needs no switch.
		{"keys that act without checks", `{decode: {endpoints: ["10.0.0.2:8000"], health: {check_timeout: 2s, consecutive_failures: 5, base_ejection: 2s}}}`, nil},
		{"both pools", `{prefill: {endpoints: ["10.0.0.1:8000"], dns_interval: 5s}, decode: {endpoints: ["10.0.0.2:8000"], health: {check_path: /ready}}}`,
			[]string{"pools.prefill.dns_interval (needs pools.prefill.dns)", "pools.decode.health.check_path (needs pools.decode.health.check_interval)"}},
		// Every admission key but objectives acts on the requests it may shed alone.
		{"admission settings without objectives", `{decode: {endpoints: ["10.0.0.2:8000"]}}` + admission + "}", admissionKeys},
		{"admission settings without a negative priority", `{decode: {endpoints: ["10.0.0.2:8000"]}}` + admission + ", objectives: {chat: 1, batch: 0}}",
			admissionKeys},
		{"admission settings with a negative priority", `{decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 1s}}}` + admission + ", objectives: {batch: -1}}", nil},
		{"objectives without a negative priority", `{decode: {endpoints: ["10.0.0.2:8000"]}}` + "\nadmission: {objectives: {chat: 1}}", nil},
		{"pool keys first", `{decode: {endpoints: ["10.0.0.2:8000"], dns_interval: 5s}}` + "\nadmission: {hold: 10s}",
			[]string{"pools.decode.dns_interval (needs pools.decode.dns)", "admission.hold (needs an " + shedding}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte("connector: kv-nixl\npools: " + tt.pools + "\n"))
			if err != nil {
				t.Fatal(err)
			}
			if got := c.Ignored(); !slices.Equal(got, tt.want) {
				t.Errorf("Ignored() = %q, want %q", got, tt.want)
			}
		})
	}
}
