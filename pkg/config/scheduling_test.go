package config

import (
	"errors"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// schedulingFile is how the lead embeds the new types: inline in Pool and
// Prefill, pd at the top.
type schedulingFile struct {
	Pools struct {
		Prefill struct {
			Endpoints []string `json:"endpoints"`
			PoolScheduling
		} `json:"prefill"`
		Decode struct {
			Endpoints []string `json:"endpoints"`
			PoolScheduling
		} `json:"decode"`
	} `json:"pools"`
	Prefill struct {
		Timeout Duration `json:"timeout"`
		PrefillAttempts
	} `json:"prefill"`
	PD PD `json:"pd"`
}

func parseScheduling(t *testing.T, doc string) (*schedulingFile, error) {
	t.Helper()
	var f schedulingFile
	if err := yaml.UnmarshalStrict([]byte(doc), &f); err != nil {
		t.Fatalf("unmarshal: %v", err)
	}
	f.Pools.Prefill.SetDefaults()
	f.Pools.Decode.SetDefaults()
	if f.Prefill.Timeout == 0 {
		f.Prefill.Timeout = Duration(30 * time.Second)
	}
	f.Prefill.PrefillAttempts.SetDefaults(f.Prefill.Timeout)
	f.PD.SetDefaults()
	return &f, errors.Join(
		f.Pools.Prefill.Validate("pools.prefill"),
		f.Pools.Decode.Validate("pools.decode"),
		f.Prefill.PrefillAttempts.Validate("prefill", f.Prefill.Timeout),
		f.PD.Validate("pd"),
	)
}

func TestSchedulingDefaults(t *testing.T) {
	f, err := parseScheduling(t, `pools: {decode: {endpoints: ["10.0.0.2:8000"]}}`)
	if err != nil {
		t.Fatal(err)
	}
	d := f.Pools.Decode.PoolScheduling
	want := PoolScheduling{
		Policy: PolicyLeastLoad,
		Prefix: PrefixAffinity{BlockChars: 256, KeyBlocks: 64, MaxBlocks: 65536, LoadFactor: 2, LoadSlack: 8, QueueSlack: 1, Spread: 4},
		Health: EngineHealth{ConsecutiveFailures: 3, BaseEjection: Duration(time.Second), MaxEjection: Duration(30 * time.Second),
			CheckPath: "/health", CheckTimeout: Duration(5 * time.Second), UnhealthyThreshold: 3, HealthyThreshold: 1},
		Metrics: EngineMetrics{Path: "/metrics"},
	}
	if d != want {
		t.Errorf("pool defaults = %+v\nwant %+v", d, want)
	}
	if f.PD != (PD{Mode: PDAuto, CharsPerToken: 4, SGLangParallelSampling: ParallelSamplingRefuse, MaxUncachedRatio: 1}) {
		t.Errorf("pd defaults = %+v", f.PD)
	}
	if f.Prefill.Attempts != 2 || f.Prefill.AttemptTimeout != f.Prefill.Timeout {
		t.Errorf("prefill defaults = %+v", f.Prefill)
	}
}

func TestSchedulingDerivedDefaults(t *testing.T) {
	f, err := parseScheduling(t, `
pools:
  decode:
    dns: decode.default.svc:8000
    health: {check_interval: 500ms} # a check may outlast the interval: SGLang's /health takes a second
    metrics: {interval: 2s}
prefill: {timeout: 10s}`)
	if err != nil {
		t.Fatal(err)
	}
	d := f.Pools.Decode
	if d.DNSInterval.D() != 10*time.Second || d.Health.CheckTimeout.D() != 5*time.Second ||
		d.Metrics.Timeout.D() != time.Second || d.Metrics.StaleAfter.D() != 6*time.Second || f.Prefill.AttemptTimeout.D() != 10*time.Second {
		t.Errorf("derived defaults: dns_interval %s, check_timeout %s, metrics timeout %s, stale_after %s, attempt_timeout %s",
			d.DNSInterval.D(), d.Health.CheckTimeout.D(), d.Metrics.Timeout.D(), d.Metrics.StaleAfter.D(), f.Prefill.AttemptTimeout.D())
	}
}

func TestSchedulingValidationNamesTheKey(t *testing.T) {
	tests := []struct {
		name, yaml, wantKey string
	}{
		{"unknown policy", `pools: {decode: {policy: fastest}}`, "pools.decode.policy"},
		{"tiny block", `pools: {decode: {prefix: {block_chars: 4}}}`, "pools.decode.prefix.block_chars"},
		{"negative max_blocks", `pools: {prefill: {prefix: {max_blocks: -1}}}`, "pools.prefill.prefix.max_blocks"},
		{"key over 4096 blocks", `pools: {prefill: {prefix: {key_blocks: 5000}}}`, "pools.prefill.prefix.key_blocks"},
		{"load factor below 1", `pools: {decode: {prefix: {load_factor: 0.5}}}`, "pools.decode.prefix.load_factor"},
		{"negative slack", `pools: {decode: {prefix: {load_slack: -1}}}`, "pools.decode.prefix.load_slack"},
		{"negative queue slack", `pools: {decode: {prefix: {queue_slack: -1}}}`, "pools.decode.prefix.queue_slack"},
		{"negative spread", `pools: {decode: {prefix: {spread: -2}}}`, "pools.decode.prefix.spread"},
		{"negative failures", `pools: {decode: {health: {consecutive_failures: -1}}}`, "pools.decode.health.consecutive_failures"},
		{"max below base", `pools: {decode: {health: {base_ejection: 10s, max_ejection: 5s}}}`, "pools.decode.health.max_ejection"},
		{"negative check interval", `pools: {decode: {health: {check_interval: -1s}}}`, "pools.decode.health.check_interval"},
		{"relative check path", `pools: {decode: {health: {check_path: health}}}`, "pools.decode.health.check_path"},
		{"stale before the next scrape", `pools: {decode: {metrics: {interval: 2s, stale_after: 1s}}}`, "pools.decode.metrics.stale_after"},
		{"relative metrics path", `pools: {decode: {metrics: {path: metrics}}}`, "pools.decode.metrics.path"},
		{"dns without port", `pools: {decode: {dns: decode.svc}}`, "pools.decode.dns"},
		{"dns with a bad port", `pools: {decode: {dns: "decode.svc:http"}}`, "pools.decode.dns"},
		{"negative dns interval", `pools: {decode: {dns: "decode.svc:8000", dns_interval: -1s}}`, "pools.decode.dns_interval"},
		{"too many fallbacks", `pools: {decode: {fallbacks: 9}}`, "pools.decode.fallbacks"},
		{"unknown mode", `pd: {mode: sometimes}`, "pd.mode"},
		{"negative threshold", `pd: {min_prompt_tokens: -5}`, "pd.min_prompt_tokens"},
		{"negative uncached bound", `pd: {min_uncached_tokens: -1}`, "pd.min_uncached_tokens"},
		{"ratio above one", `pd: {max_uncached_ratio: 1.5}`, "pd.max_uncached_ratio"},
		{"negative busy line", `pd: {load: {prefill_queue: -1}}`, "pd.load"},
		{"decode_queue alone", `pd: {load: {decode_queue: 2}}`, "pd.load.decode_queue"},
		{"negative ratio", `pd: {chars_per_token: -4}`, "pd.chars_per_token"},
		{"negative attempts", `prefill: {attempts: -1}`, "prefill.attempts"},
		{"attempt longer than the whole", `prefill: {timeout: 10s, attempt_timeout: 20s}`, "prefill.attempt_timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseScheduling(t, tt.yaml)
			if err == nil || !strings.Contains(err.Error(), tt.wantKey+":") {
				t.Errorf("error = %v, want one naming %q", err, tt.wantKey)
			}
		})
	}
}

func TestSchedulingKeysAreStrict(t *testing.T) {
	var f schedulingFile
	err := yaml.UnmarshalStrict([]byte(`pools: {decode: {prefix: {block_size: 128}}}`), &f)
	if err == nil || !strings.Contains(err.Error(), "block_size") {
		t.Fatalf("a misspelt scheduling key was accepted: %v", err)
	}
}

func TestSetDefaultsIsIdempotent(t *testing.T) {
	s := PoolScheduling{Metrics: EngineMetrics{Interval: Duration(time.Second)}, DNS: "a:1"}
	s.SetDefaults()
	again := s
	again.SetDefaults()
	if again != s {
		t.Fatalf("SetDefaults twice = %+v, once = %+v", again, s)
	}
}

// An interval of checks, scrapes or lookups set below 10 ms is refused: at a
// microsecond it spun a fifth of a CPU and never succeeded. 0 stays "off".
func TestIntervalsHaveAFloor(t *testing.T) {
	for _, tt := range []struct {
		pool, want string // want "": accepted
	}{
		{"health: {check_interval: 10ms}", ""},
		{"health: {check_interval: 0s}", ""},
		{"health: {check_interval: 1us}", "pools.decode.health.check_interval: 1µs is neither 0"},
		{"metrics: {interval: 5ms}", "pools.decode.metrics.interval: 5ms is neither 0"},
		{"dns: decode.svc:8000, dns_interval: 1ms", "pools.decode.dns_interval: 1ms is below 10ms"},
	} {
		_, err := parseScheduling(t, "pools: {decode: {"+tt.pool+"}}")
		if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
			t.Errorf("%s: %v, want %q", tt.pool, err, tt.want)
		}
	}
}
