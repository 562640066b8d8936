package config

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestOperatorValues walks the values an operator may write for the
// documented keys (README "Configuration", docs/scheduling.md
// "Configuration reference"): each is refused with an error that names its
// key, or applied as the tables document it.
func TestOperatorValues(t *testing.T) {
	const decode = `pools: {decode: {endpoints: ["10.0.0.2:8000"]}}`
	const affinity = `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity}}`
	const scraped = `pools: {prefill: {metrics: {interval: 1s}}, decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 1s}}}`
	tests := []struct {
		name, yaml string
		wantErr    string             // in the error; "" when accepted
		check      func(*Config) bool // the applied value, when accepted
	}{
		// 0 for a key whose 0 is the default, and for one whose 0 is off.
		{"prefill.timeout 0s is the default", "prefill: {timeout: 0s}\n" + decode, "", func(c *Config) bool { return c.Prefill.Timeout.D() == 30*time.Second }},
		{"limits.max_concurrent_streams 0 is the default", "limits: {max_concurrent_streams: 0}\n" + decode, "", func(c *Config) bool { return c.Limits.MaxConcurrentStreams == 1024 }},
		{"pd.max_uncached_ratio 0 is the default", "pd: {max_uncached_ratio: 0}\n" + decode, "", func(c *Config) bool { return c.PD.MaxUncachedRatio == 1 }},
		{"pd.min_uncached_tokens 0 is off", "pd: {min_uncached_tokens: 0}\n" + affinity, "", func(c *Config) bool { return c.PD.UncachedTokens(c.Pools.Decode.Policy) == 0 }},
		{"pd.load.decode_queue 0 is the default", "pd: {load: {prefill_queue: 2, decode_queue: 0}}\n" + scraped, "", func(c *Config) bool { return c.PD.Load.DecodeQueue == 1 }},
		{"tracing.sample_ratio 0 records none", "tracing: {sample_ratio: 0}\n" + decode, "", func(c *Config) bool { return *c.Tracing.SampleRatio == 0 }},
		{"admission.hold 0s refuses at once", "admission: {hold: 0s}\n" + decode, "", func(c *Config) bool { return *c.Admission.Hold == 0 }},
		{"metrics.interval 0s is off", `pools: {decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 0s}}}`, "", func(c *Config) bool { return c.Pools.Decode.Metrics.Interval == 0 }},
		{"health.check_interval 0s is off", `pools: {decode: {endpoints: ["10.0.0.2:8000"], health: {check_interval: 0s}}}`, "", func(c *Config) bool { return c.Pools.Decode.Health.CheckInterval == 0 }},
		{"kv_events.resync 0s is the default", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, resync: 0s}}}`, "",
			func(c *Config) bool { return c.Pools.Decode.KVEvents.Resync.D() == 5*time.Minute }},
		{"kv_events.replay_timeout 0s is the default", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, replay_timeout: 0s}}}`, "",
			func(c *Config) bool { return c.Pools.Decode.KVEvents.ReplayTimeout.D() == 2*time.Second }},
		{"pools.prefill.bootstrap_port 0 is the default", `pools: {prefill: {bootstrap_port: 0}, decode: {endpoints: ["10.0.0.2:8000"]}}`, "", func(c *Config) bool { return c.Pools.Prefill.BootstrapPort == 8998 }},
		{"pools.decode.fallbacks 0 sends one", `pools: {decode: {endpoints: ["10.0.0.2:8000"], fallbacks: 0}}`, "", func(c *Config) bool { return c.Pools.Decode.Fallbacks == 0 }},
		// Negative values.
		{"negative prefill.timeout", "prefill: {timeout: -1s}\n" + decode, "prefill.timeout", nil},
		{"negative prefill.attempt_timeout", "prefill: {attempt_timeout: -1s}\n" + decode, "prefill.attempt_timeout", nil},
		{"negative prefill.attempts", "prefill: {attempts: -1}\n" + decode, "prefill.attempts", nil},
		{"negative prefill.max_idle_conns_per_endpoint", "prefill: {max_idle_conns_per_endpoint: -1}\n" + decode, "prefill.max_idle_conns_per_endpoint", nil},
		{"negative limits.max_concurrent_streams", "limits: {max_concurrent_streams: -1}\n" + decode, "limits.max_concurrent_streams", nil},
		{"negative limits.max_buffered_bytes", "limits: {max_buffered_bytes: -1}\n" + decode, "limits.max_buffered_bytes", nil},
		{"negative limits.retry_after", "limits: {retry_after: -1s}\n" + decode, "limits.retry_after", nil},
		{"negative envoy.override_message_timeout", "envoy: {override_message_timeout: -1s}\n" + decode, "envoy.override_message_timeout", nil},
		{"negative health.consecutive_failures", `pools: {decode: {endpoints: ["10.0.0.2:8000"], health: {consecutive_failures: -1}}}`, "pools.decode.health.consecutive_failures", nil},
		{"negative health.base_ejection", `pools: {decode: {endpoints: ["10.0.0.2:8000"], health: {base_ejection: -1s}}}`, "pools.decode.health.base_ejection", nil},
		{"negative health.check_interval", `pools: {decode: {endpoints: ["10.0.0.2:8000"], health: {check_interval: -1s}}}`, "pools.decode.health.check_interval", nil},
		{"negative health.check_timeout", `pools: {decode: {endpoints: ["10.0.0.2:8000"], health: {check_timeout: -1s}}}`, "pools.decode.health.check_timeout", nil},
		{"negative metrics.interval", `pools: {decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: -1s}}}`, "pools.decode.metrics.interval", nil},
		{"negative metrics.timeout", `pools: {decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 1s, timeout: -1s}}}`, "pools.decode.metrics.timeout", nil},
		{"negative dns_interval", `pools: {decode: {dns: "decode:8000", dns_interval: -1s}}`, "pools.decode.dns_interval", nil},
		{"negative kv_events.stale_after", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, stale_after: -1s}}}`,
			"pools.decode.kv_events.stale_after", nil},
		{"negative kv_events.replay_timeout", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, replay_timeout: -1s}}}`,
			"pools.decode.kv_events.replay_timeout: must be positive", nil},
		{"negative kv_events.tokenize.timeout", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, tokenize: {timeout: -1s}}}}`,
			"pools.decode.kv_events.tokenize.timeout", nil},
		{"negative tracing.sample_ratio", "tracing: {sample_ratio: -0.1}\n" + decode, "tracing.sample_ratio", nil},
		{"negative admission.saturated_queue", "admission: {saturated_queue: -1}\n" + decode, "admission.saturated_queue", nil},
		{"negative admission.saturated_kv_cache", "admission: {saturated_kv_cache: -0.5}\n" + decode, "admission.saturated_kv_cache", nil},
		{"negative pd.min_prompt_tokens", "pd: {min_prompt_tokens: -1}\n" + decode, "pd.min_prompt_tokens", nil},
		{"negative pd.max_uncached_ratio", "pd: {max_uncached_ratio: -0.5}\n" + affinity, "pd.max_uncached_ratio", nil},
		{"negative pd.load.prefill_queue", "pd: {load: {prefill_queue: -1}}\n" + scraped, "pd.load", nil},
		{"negative prefix.load_slack", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {load_slack: -1}}}`, "pools.decode.prefix.load_slack", nil},
		{"negative prefix.spread", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {spread: -1}}}`, "pools.decode.prefix.spread", nil},
		// Past a documented maximum.
		{"a percentage for tracing.sample_ratio", "tracing: {sample_ratio: 50}\n" + decode, "tracing.sample_ratio", nil},
		{"a percentage for pd.max_uncached_ratio", "pd: {max_uncached_ratio: 70}\n" + affinity, "pd.max_uncached_ratio", nil},
		{"a percentage for admission.saturated_kv_cache", "admission: {saturated_kv_cache: 80}\n" + decode, "admission.saturated_kv_cache", nil},
		{"prefill.attempts above 10", "prefill: {attempts: 11}\n" + decode, "prefill.attempts", nil},
		{"pools.decode.fallbacks above 8", `pools: {decode: {endpoints: ["10.0.0.2:8000"], fallbacks: 9}}`, "pools.decode.fallbacks", nil},
		{"pd.chars_per_token above 100", "pd: {chars_per_token: 101}\n" + decode, "pd.chars_per_token", nil},
		{"prefix.block_chars above 65536", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {block_chars: 65537}}}`, "pools.decode.prefix.block_chars", nil},
		{"prefix.key_blocks above 4096", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {key_blocks: 4097}}}`, "pools.decode.prefix.key_blocks", nil},
		{"prefix.max_blocks above 16,777,216", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {max_blocks: 16777217}}}`, "pools.decode.prefix.max_blocks", nil},
		{"kv_events.data_parallel_size above 256", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, data_parallel_size: 257}}}`,
			"pools.decode.kv_events.data_parallel_size", nil},
		{"envoy.override_message_timeout above 1h", "envoy: {override_message_timeout: 61m}\n" + decode, "envoy.override_message_timeout", nil},
		{"admission.hold above 1h", "admission: {hold: 61m}\n" + decode, "admission.hold", nil},
		{"limits.max_body_bytes above 2 GiB less 2 MiB", "limits: {max_body_bytes: 2145386497}\n" + decode, "limits.max_body_bytes", nil},
		{"response.max_body_bytes above 1 GiB", "response: {max_body_bytes: 1073741825}\n" + decode, "response.max_body_bytes", nil},
		{"a bootstrap port above 65535", `pools: {prefill: {bootstrap_port: 65536}, decode: {endpoints: ["10.0.0.2:8000"]}}`, "pools.prefill.bootstrap_port", nil},
		{"a duration past Go's", "prefill: {timeout: 3000000h}\n" + decode, "prefill.timeout", nil},
		// Numbers that are no number.
		{"NaN tracing.sample_ratio", "tracing: {sample_ratio: .nan}\n" + decode, "tracing.sample_ratio", nil},
		{"NaN pd.max_uncached_ratio", "pd: {max_uncached_ratio: .nan}\n" + affinity, "pd.max_uncached_ratio", nil},
		{"NaN pd.chars_per_token", "pd: {chars_per_token: .nan}\n" + decode, "pd.chars_per_token", nil},
		{"NaN admission.saturated_kv_cache", "admission: {saturated_kv_cache: .nan}\n" + decode, "admission.saturated_kv_cache", nil},
		{"NaN admission.saturated_queue", "admission: {saturated_queue: .nan}\n" + decode, "admission.saturated_queue", nil},
		{"NaN prefix.load_factor", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {load_factor: .nan}}}`, "pools.decode.prefix.load_factor", nil},
		{"NaN prefix.load_slack", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {load_slack: .nan}}}`, "pools.decode.prefix.load_slack", nil},
		{"NaN prefix.queue_slack", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {queue_slack: .nan}}}`, "pools.decode.prefix.queue_slack", nil},
		{"NaN prefix.spread", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {spread: .nan}}}`, "pools.decode.prefix.spread", nil},
		{"NaN pd.load.prefill_queue", "pd: {load: {prefill_queue: .nan}}\n" + scraped, "pd.load", nil},
		{"NaN pd.load.decode_queue", "pd: {load: {prefill_queue: 2, decode_queue: .nan}}\n" + scraped, "pd.load", nil},
		{"infinite prefix.spread", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {spread: .inf}}}`, "pools.decode.prefix.spread", nil},
		{"infinite prefix.load_factor", `pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {load_factor: .inf}}}`, "pools.decode.prefix.load_factor", nil},
		// How values are written.
		{"a duration as a plain number", "limits: {body_timeout: 60}\n" + decode, "limits.body_timeout", nil},
		{"a count as a quoted number", `prefill: {attempts: "3"}` + "\n" + decode, "prefill.attempts", nil},
		{"a ratio as a quoted number", `tracing: {sample_ratio: "0.5"}` + "\n" + decode, "tracing.sample_ratio", nil},
		{"a fractional count", "prefill: {attempts: 2.5}\n" + decode, "prefill.attempts", nil},
		{"a YAML 1.1 boolean: on", "prefill: {http2: on}\n" + decode, "", func(c *Config) bool { return c.Prefill.HTTP2 }},
		{"a YAML 1.1 boolean: yes", "response: {rewrite_usage: yes}\n" + decode, "", func(c *Config) bool { return c.Response.RewriteUsage }},
		{"a YAML 1.1 boolean for a string key", "pd: {mode: off}\n" + decode, "pd.mode", nil},
		{"a boolean as a string", `response: {rewrite_usage: "true"}` + "\n" + decode, "response.rewrite_usage", nil},
		{"a misspelt top-level key", "prefil: {timeout: 10s}\n" + decode, `"prefil"`, nil},
		{"a misspelt nested key", "prefill: {timout: 10s}\n" + decode, `prefill.timout`, nil},
		{"a key twice", "prefill: {timeout: 10s}\nprefill: {timeout: 20s}\n" + decode, "prefill", nil},
		{"a nested key twice", "prefill: {timeout: 10s, timeout: 20s}\n" + decode, "timeout", nil},
		{"a prefill key under the decode pool", `pools: {decode: {endpoints: ["10.0.0.2:8000"], attempts: 3}}`, "pools.decode.attempts", nil},
		{"a pool that is not one", `pools: {decode: {endpoints: ["10.0.0.2:8000"]}, encode: {endpoints: ["10.0.0.3:8000"]}}`, "pools.encode", nil},
		// Conflicting keys.
		{"prefill.attempt_timeout above prefill.timeout", "prefill: {timeout: 10s, attempt_timeout: 20s}\n" + decode, "prefill.attempt_timeout", nil},
		{"limits.max_buffered_bytes below limits.max_body_bytes", "limits: {max_body_bytes: 2048, max_buffered_bytes: 1024}\n" + decode, "limits.max_buffered_bytes", nil},
		{"health.max_ejection below base_ejection", `pools: {decode: {endpoints: ["10.0.0.2:8000"], health: {base_ejection: 10s, max_ejection: 5s}}}`, "pools.decode.health.max_ejection", nil},
		{"metrics.stale_after below interval", `pools: {decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 1s, stale_after: 500ms}}}`, "pools.decode.metrics.stale_after", nil},
		{"pd.load.decode_queue without prefill_queue", "pd: {load: {decode_queue: 2}}\n" + scraped, "pd.load.decode_queue", nil},
		{"admission without metrics.interval", "admission: {objectives: {batch: -1}}\n" + decode, "pools.decode.metrics.interval", nil},
		{"an objective name with white space", `admission: {objectives: {"batch ": -1}}` + "\n" + `pools: {decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 250ms}}}`, "admission.objectives", nil},
		{"an empty objective name", `admission: {objectives: {"": -1}}` + "\n" + `pools: {decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 250ms}}}`, "admission.objectives", nil},
		// Endpoints.
		{"a duplicate endpoint", `pools: {decode: {endpoints: ["10.0.0.2:8000", "10.0.0.2:8000"]}}`, "pools.decode.endpoints[1]", nil},
		{"a host name", `pools: {decode: {endpoints: ["localhost:8000"]}}`, "pools.decode.endpoints[0]", nil},
		{"IPv6 with brackets", `pools: {decode: {endpoints: ["[fd00::2]:8000"]}}`, "", func(c *Config) bool { return c.Pools.Decode.Endpoints[0] == "[fd00::2]:8000" }},
		{"IPv6 without brackets", `pools: {decode: {endpoints: ["fd00::2:8000"]}}`, "pools.decode.endpoints[0]", nil},
		{"port 0", `pools: {decode: {endpoints: ["10.0.0.2:0"]}}`, "pools.decode.endpoints[0]", nil},
		{"port 65536", `pools: {decode: {endpoints: ["10.0.0.2:65536"]}}`, "pools.decode.endpoints[0]", nil},
		{"an empty endpoint", `pools: {decode: {endpoints: [""]}}`, "pools.decode.endpoints[0]", nil},
		{"dns without a port", `pools: {decode: {dns: "decode"}}`, "pools.decode.dns", nil},
		{"dns port 0", `pools: {decode: {dns: "decode:0"}}`, "pools.decode.dns", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte("connector: kv-nixl\n" + tt.yaml))
			switch {
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("Parse() = %v; want an error naming %q", err, tt.wantErr)
			case tt.wantErr == "" && err != nil:
				t.Errorf("Parse() = %v; want it accepted", err)
			case tt.wantErr == "" && !tt.check(c):
				t.Errorf("accepted, but not applied as documented: %+v", c)
			}
		})
	}
}

// A key whose 0 is taken for its default says so in every configuration
// table that lists it: an operator writing 0 may mean "none" or "off". The
// keys are found, not listed: each number or duration of the config set to
// 0 in a file that turns its section on, parsed as the key left out.
func TestZeroIsTheDefaultWhereTheTablesSay(t *testing.T) {
	const base = `{"connector": "kv-nixl", "pools": {
  "prefill": {"endpoints": ["10.0.0.1:8000"], "policy": "prefix-affinity", "kv_events": {"connect_port": 5557},
    "metrics": {"interval": "1s"}, "health": {"check_interval": "1s"}},
  "decode": {"endpoints": ["10.0.0.2:8000"], "policy": "prefix-affinity", "kv_events": {"connect_port": 5557},
    "metrics": {"interval": "1s"}, "health": {"check_interval": "1s"}}}}`
	left := asTree(mustParse(t, base))
	var rows []string
	for _, doc := range []string{"../../README.md", "../../docs/scheduling.md"} {
		text, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		rows = append(rows, slices.Collect(strings.Lines(string(text)))...)
	}
	found, unsaid := 0, map[string]bool{} // the rows, each once for both pools
	for key, zero := range numericKeys(reflect.TypeFor[Config](), "") {
		file := map[string]any{}
		if err := json.Unmarshal([]byte(base), &file); err != nil {
			t.Fatal(err)
		}
		setAt(file, strings.Split(key, "."), zero)
		js, _ := json.Marshal(file)
		c, err := Parse(js)
		if err != nil || !reflect.DeepEqual(asTree(c), left) || valueAt(left, key) == nil {
			continue // 0 refused, taken as 0, or the default itself
		}
		found++
		doc := strings.NewReplacer("pools.prefill.", "pools.<pool>.", "pools.decode.", "pools.<pool>.").Replace(key)
		for _, row := range rows {
			if strings.HasPrefix(row, "| `"+doc+"` |") && !strings.Contains(row, "0 means the default") {
				unsaid[fmt.Sprintf("%s takes 0 for its default, %v, and its table row does not say so: %.120s", doc, valueAt(left, key), row)] = true
			}
		}
	}
	for _, msg := range slices.Sorted(maps.Keys(unsaid)) {
		t.Error(msg)
	}
	if found < 10 {
		t.Errorf("found %d keys whose 0 is their default: the config's shape changed?", found)
	}
}

// numericKeys are the dotted keys of t's numbers and durations, each with
// its 0 as a file writes it.
func numericKeys(t reflect.Type, prefix string) map[string]any {
	out := map[string]any{}
	for _, f := range reflect.VisibleFields(t) {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		switch {
		case name == "" || name == "-":
		case ft == reflect.TypeFor[Duration]():
			out[prefix+name] = "0s"
		case ft.Kind() == reflect.Struct:
			maps.Copy(out, numericKeys(ft, prefix+name+"."))
		case ft.Kind() >= reflect.Int && ft.Kind() <= reflect.Float64:
			out[prefix+name] = 0
		}
	}
	return out
}

// setAt sets the key at path of a file's tree, making the sections it needs.
func setAt(tree map[string]any, path []string, v any) {
	for _, p := range path[:len(path)-1] {
		next, ok := tree[p].(map[string]any)
		if !ok {
			next = map[string]any{}
			tree[p] = next
		}
		tree = next
	}
	tree[path[len(path)-1]] = v
}

// valueAt is the value of key in tree (asTree), nil when left out or 0.
func valueAt(tree any, key string) any {
	for p := range strings.SplitSeq(key, ".") {
		m, _ := tree.(map[string]any)
		tree = m[p]
	}
	if tree == 0.0 || tree == "0s" {
		return nil
	}
	return tree
}
