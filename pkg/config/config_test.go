package config

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	defaults "github.com/pd-extproc/pd-extproc/config"
	"github.com/pd-extproc/pd-extproc/pkg/api"
)

func TestEmbeddedDefaultIsValid(t *testing.T) {
	c, err := Unconfigured(defaults.DefaultYAML)
	if err != nil {
		t.Fatal(err)
	}
	if c.Limits.MaxBodyBytes != 32<<20 || c.Prefill.Timeout.D() != 30*time.Second {
		t.Errorf("unexpected default config: %+v", c)
	}
	// It names no engine: a binary run without --config must not route to
	// whatever listens on its own loopback.
	if c.Pools.Prefill.Configured() || c.Pools.Decode.Configured() {
		t.Errorf("the embedded default names engines: prefill %+v, decode %+v", c.Pools.Prefill, c.Pools.Decode)
	}
	// Every value it writes is the default a file gets without the key.
	bare, err := Parse([]byte("connector: " + c.Connector))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []*Pool{&c.Pools.Prefill, &c.Pools.Decode} {
		p.Endpoints = nil // "endpoints: []" in the file, absent in an empty one
	}
	got, _ := json.Marshal(c)
	want, _ := json.Marshal(bare)
	if string(got) != string(want) {
		t.Errorf("the embedded default differs from the defaults of an empty file:\n%s\n%s", got, want)
	}
}

// A file must name its connector: a wrong one fails quietly (kv-shared-storage in front of NIXL
// engines recomputes every prompt on both), so none is assumed. The embedded default is the one
// config without it, and it routes nothing.
func TestConnectorIsRequired(t *testing.T) {
	tests := []struct {
		name, yaml string
		parse      func([]byte) (*Config, error)
		want       []string // in the error; none: accepted
	}{
		{"a file without it", `pools: {decode: {endpoints: ["10.0.0.2:8000"]}}`, Parse, []string{"connector: not set", "kv-nixl", "kv-shared-storage", "kv-sglang"}},
		{"an empty file", ``, Parse, []string{"connector: not set"}},
		{"an empty value", `connector: ""`, Parse, []string{"connector: not set"}},
		{"a file with it", `connector: kv-nixl`, Parse, nil},
		{"the embedded default", string(defaults.DefaultYAML), Unconfigured, nil},
		{"a default that names a connector", `connector: kv-nixl`, Unconfigured, []string{"names a connector or engines"}},
		{"a default that names engines", `pools: {decode: {endpoints: ["10.0.0.2:8000"]}}`, Unconfigured, []string{"names a connector or engines"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.parse([]byte(tt.yaml))
			if len(tt.want) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			for _, w := range tt.want {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("error %v; want one naming %q", err, w)
				}
			}
		})
	}
}

func TestDefaultsFillMissingKeys(t *testing.T) {
	c, err := Parse([]byte(`{connector: kv-nixl, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Pools.Prefill.BootstrapPort != 8998 || c.Prefill.OnFailure != "decode-only" ||
		c.Limits.MaxBodyBytes != 32<<20 || c.Envoy.OverrideMessageTimeout.D() != 60*time.Second ||
		c.Response.RewriteUsage || c.Response.MaxBodyBytes != 4<<20 || c.Pools.Decode.TLS.Enabled ||
		c.Admission.Hold.D() != 30*time.Second || c.Admission.MaxHeld != 512 {
		t.Errorf("defaults not applied: %+v", c)
	}
}

// A P/D deployment's decode pool without KV events tolerates a longer engine
// queue before it passes an endpoint over; with events, an aggregated one
// (pd.mode never) and the prefill pool keep the usual bound, and a value set
// is kept.
func TestDecodeQueueSlackDefault(t *testing.T) {
	tests := []struct {
		name, yaml              string
		wantDecode, wantPrefill float64
		wantEstimate            float64 // the decode pool's without a trusted view of KV events (0: wantDecode)
	}{
		{"P/D", `{connector: kv-nixl, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, DefaultDecodeQueueSlack, DefaultQueueSlack, DefaultDecodeQueueSlack},
		{"aggregated", `{connector: kv-nixl, pd: {mode: never}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, DefaultQueueSlack, DefaultQueueSlack, 0},
		{"P/D with KV events", `{connector: kv-nixl, pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557}}}}`, DefaultQueueSlack, DefaultQueueSlack, DefaultDecodeQueueSlack},
		{"set", `{connector: kv-nixl, pools: {decode: {endpoints: ["10.0.0.2:8000"], prefix: {queue_slack: 2}}}}`, 2, DefaultQueueSlack, 0},
		{"set, with KV events", `{connector: kv-nixl, pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, prefix: {queue_slack: 2}, kv_events: {connect_port: 5557}}}}`, 2, DefaultQueueSlack, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.yaml))
			if err != nil {
				t.Fatal(err)
			}
			if got := c.Pools.Decode.Prefix.QueueSlack; got != tt.wantDecode {
				t.Errorf("pools.decode.prefix.queue_slack = %g, want %g", got, tt.wantDecode)
			}
			if got := c.Pools.Prefill.Prefix.QueueSlack; got != tt.wantPrefill {
				t.Errorf("pools.prefill.prefix.queue_slack = %g, want %g", got, tt.wantPrefill)
			}
			if got := c.Pools.Decode.Prefix.EstimateQueueSlack; got != tt.wantEstimate {
				t.Errorf("the decode pool's queue slack without a trusted view = %g, want %g", got, tt.wantEstimate)
			}
		})
	}
}

// A data-parallel engine publishes rank r's events on connect_port + r and
// replays them on replay_port + r: the two ranges may touch, not overlap
// (TestInvalidConfigNamesTheKey has the overlaps).
func TestKVEventPortsApartForTheRanks(t *testing.T) {
	for _, kv := range []string{
		`{connect_port: 5557, replay_port: 5558}`,
		`{connect_port: 5557, replay_port: 5559, data_parallel_size: 2}`,
		`{connect_port: 5557, replay_port: 5657, data_parallel_size: 8}`,
		`{connect_port: 5561, replay_port: 5557, data_parallel_size: 4}`,
		`{bind: "tcp://0.0.0.0:5557", replay_port: 5558}`,                  // the engines' own ports are theirs to set
		`{connect_port: 65535, replay_port: 65533, data_parallel_size: 1}`, // the last port there is
		`{connect_port: 65534, replay_port: 65530, data_parallel_size: 2}`,
	} {
		t.Run(kv, func(t *testing.T) {
			yaml := `{connector: kv-nixl, pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: ` + kv + `}}}`
			if _, err := Parse([]byte(yaml)); err != nil {
				t.Errorf("Parse() = %v, want the ports accepted", err)
			}
		})
	}
}

func TestPassthroughDefaultsAndReplacement(t *testing.T) {
	tests := []struct {
		name, yaml string
		want       []string
	}{
		{"left out: the defaults", ``, api.DefaultPassthrough},
		{"a list replaces them whole", `routes: {passthrough: ["GET /v1/models", "POST /v1/embeddings/*"]}`, []string{"GET /v1/models", "POST /v1/embeddings/*"}},
		{"an empty list lets nothing through", `routes: {passthrough: []}`, []string{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.yaml + "\nconnector: kv-nixl\npools: {decode: {endpoints: [\"10.0.0.2:8000\"]}}"))
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(c.Routes.Passthrough, tt.want) || c.Routes.Passthrough == nil {
				t.Errorf("routes.passthrough = %q, want %q", c.Routes.Passthrough, tt.want)
			}
		})
	}
}

func TestInvalidConfigNamesTheKey(t *testing.T) {
	tests := []struct {
		name, yaml, wantKey string
	}{
		{"unknown connector", `{connector: kv-lmcache, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "connector"},
		{"host name endpoint", `pools: {decode: {endpoints: ["decode:8000"]}}`, "pools.decode.endpoints[0]"},
		{"endpoint without port", `pools: {prefill: {endpoints: ["10.0.0.1"]}, decode: {endpoints: ["10.0.0.2:8000"]}}`, "pools.prefill.endpoints[0]"},
		{"duplicate endpoint", `pools: {decode: {endpoints: ["10.0.0.2:8000", "10.0.0.2:8000"]}}`, "pools.decode.endpoints[1]"},
		{"one engine in two spellings", `pools: {decode: {endpoints: ["[FD00:0::1]:8000", "[fd00::1]:8000"]}}`, `pools.decode.endpoints[1]: "[fd00::1]:8000" is listed twice`},
		{"an IPv4 engine, once IPv4-mapped", `pools: {decode: {endpoints: ["10.0.0.2:8000", "[::ffff:10.0.0.2]:8000"]}}`, "pools.decode.endpoints[1]"},
		{"an IPv6 zone", `pools: {decode: {endpoints: ["[fe80::1%eth0]:8000"]}}`, `pools.decode.endpoints[0]: "[fe80::1%eth0]:8000" names a zone`},
		{"the unspecified IPv4 address", `pools: {decode: {endpoints: ["10.0.0.2:8000", "10.0.0.3:8000", "0.0.0.0:8000"]}}`,
			`pools.decode.endpoints[2]: "0.0.0.0:8000" is the unspecified address, a listener's wildcard: it names no engine`},
		{"the unspecified IPv6 address", `pools: {prefill: {endpoints: ["[::]:8000"]}, decode: {endpoints: ["10.0.0.2:8000"]}}`,
			`pools.prefill.endpoints[0]: "[::]:8000" is the unspecified address`},
		{"the unspecified address, IPv4-mapped", `pools: {decode: {endpoints: ["[::ffff:0.0.0.0]:8000"]}}`, `pools.decode.endpoints[0]: "[::ffff:0.0.0.0]:8000" is the unspecified address`},
		{"a multicast group", `pools: {decode: {endpoints: ["239.1.2.3:8000"]}}`, `pools.decode.endpoints[0]: "239.1.2.3:8000" is a multicast address: TCP connects to one host`},
		{"an IPv6 multicast group", `pools: {decode: {endpoints: ["[ff02::1]:8000"]}}`, `pools.decode.endpoints[0]: "[ff02::1]:8000" is a multicast address`},
		{"the broadcast address", `pools: {decode: {endpoints: ["255.255.255.255:8000"]}}`, `pools.decode.endpoints[0]: "255.255.255.255:8000" is the broadcast address: TCP connects to one host`},
		{"an endpoint on port 0", `pools: {decode: {endpoints: ["10.0.0.2:8000", "10.0.0.3:0"]}}`, `pools.decode.endpoints[1]: "10.0.0.3:0" has no port`},
		{"bad on_failure", `{prefill: {on_failure: retry}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "prefill.on_failure"},
		{"a duration as a number", `{prefill: {timeout: 30}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, `config: prefill.timeout: cannot take 30 (want a duration such as "30s")`},
		{"a duration in a unit Go lacks", `{pools: {decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 1sec}}}}`, `config: pools.decode.metrics.interval: cannot take "1sec" (want a duration such as "30s": unknown unit`},
		{"a pod port that is no port", `{pools: {decode: {kubernetes: {selector: {app: d}, port: 80.5}}}}`, `config: pools.decode.kubernetes.port: cannot take 80.5 (want a port number or a container port name)`},
		{"a number as a string", `{limits: {max_body_bytes: "32Mi"}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, `config: limits.max_body_bytes: cannot take string as int64`},
		{"misspelt key", `{pool: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, `unknown field "pool"`},
		{"a key in another case", `pools: {decode: {endpoints: ["10.0.0.2:8000"], Policy: round-robin}}`, `unknown field "pools.decode.Policy"`},
		{"a key twice, in two cases", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, Policy: round-robin}}`, `unknown field "pools.decode.Policy"`},
		{"prefill fallbacks", `pools: {prefill: {fallbacks: 1}, decode: {endpoints: ["10.0.0.2:8000"]}}`, "pools.prefill.fallbacks"},
		{"bootstrap port out of range", `pools: {prefill: {bootstrap_port: 70000}, decode: {endpoints: ["10.0.0.2:8000"]}}`, "pools.prefill.bootstrap_port"},
		{"kv-sglang cannot go decode-only", `{connector: kv-sglang, pd: {min_prompt_tokens: 10}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "pd.mode, pd.min_prompt_tokens"},
		{"kv-sglang has no cache rule", `{connector: kv-sglang, pd: {min_uncached_tokens: 64}, pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity}}}`,
			"pd.min_uncached_tokens"},
		{"kv-sglang has no load arm", `{connector: kv-sglang, pd: {load: {prefill_queue: 4}}, pools: {prefill: {metrics: {interval: 1s}}, decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 1s}}}}`,
			"pd.load"},
		{"the cache rule without prefix-affinity", `{pd: {min_uncached_tokens: 64}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "need pools.decode.policy: prefix-affinity"},
		{"a ratio without prefix-affinity", `{pd: {max_uncached_ratio: 0.5}, pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: round-robin}}}`, "need pools.decode.policy: prefix-affinity"},
		{"the load arm without scrapes", `{pd: {load: {prefill_queue: 4}}, pools: {prefill: {metrics: {interval: 1s}}, decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"pd.load: needs both pools to scrape"},
		{"negative body limit", `{limits: {max_body_bytes: -1}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "limits.max_body_bytes"},
		{"buffered bytes below one body", `{limits: {max_body_bytes: 1000, max_buffered_bytes: 999}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"limits.max_buffered_bytes"},
		{"negative body timeout", `{limits: {body_timeout: -1s}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "limits.body_timeout: must not be negative"},
		{"negative override", `{envoy: {override_after: -1s}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "envoy.override_after, envoy.override_message_timeout: must not be negative"},
		{"negative background cap", `{prefill: {max_background: -1}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "prefill.max_background"},
		{"negative connection cap", `{prefill: {max_conns_per_endpoint: -1}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "prefill.max_conns_per_endpoint"},
		{"pass-through entry without a method", `{routes: {passthrough: ["/v1/embeddings"]}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"routes.passthrough[0]"},
		{"pass-through path with a dot segment", `{routes: {passthrough: ["GET /v1/models", "GET /v1/../flush_cache"]}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"routes.passthrough[1]"},
		{"pass-through wildcard over everything", `{routes: {passthrough: ["POST /*"]}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"routes.passthrough[0]"},
		{"pass-through of a built-in API", `{routes: {passthrough: ["POST /v1/chat/completions"]}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"routes.passthrough[0]"},
		{"pass-through entry twice", `{routes: {passthrough: ["GET /health", "GET /health"]}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"routes.passthrough[1]"},
		{"unknown parallel sampling", `{connector: kv-sglang, pd: {sglang_parallel_sampling: lists}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"pd.sglang_parallel_sampling"},
		{"parallel sampling rooms were removed", `{connector: kv-sglang, pd: {sglang_parallel_sampling: rooms}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"pd.sglang_parallel_sampling: rooms was removed: SGLang's tokenizer manager gives every sample"},
		{"prefill CA without TLS", `{prefill: {tls: {ca_file: /ca.pem}}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "prefill.tls: ca_file and server_name need prefill.tls.enabled"},
		{"decode server name without TLS", `pools: {decode: {endpoints: ["10.0.0.2:8000"], tls: {server_name: engine}}}`, "pools.decode.tls: ca_file and server_name need pools.decode.tls.enabled"},
		{"the prefill pool's TLS is prefill.tls", `pools: {prefill: {tls: {enabled: true}}, decode: {endpoints: ["10.0.0.2:8000"]}}`, "pools.prefill.tls"},
		{"shedding without the decode pool's scrapes", `{admission: {objectives: {batch: -1}}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`,
			"admission.objectives: a negative priority sheds by the engines' scraped queues and KV use: set pools.decode.metrics.interval"},
		{"shedding without the prefill pool's scrapes", `{admission: {objectives: {batch: -1}}, pools: {prefill: {endpoints: ["10.0.0.1:8000"]}, decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 1s}}}}`,
			"set pools.prefill.metrics.interval"},
		{"a shed request's Retry-After below a second", `{admission: {retry_after: 500ms}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "admission.retry_after: 500ms is below 1s"},
		{"a KV line above 1", `{admission: {saturated_kv_cache: 1.5}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "admission.saturated_kv_cache: 1.5 is not in (0, 1]"},
		{"a negative bound on the held", `{admission: {max_held: -1}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "admission.max_held: must not be negative"},
		{"a negative hold", `{admission: {hold: -1s}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "admission.hold: -1s is not between 0s and 1h"},
		{"a hold past Envoy's bound", `{admission: {hold: 2h}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "admission.hold: 2h0m0s is not between 0s and 1h"},
		{"the prefill pool's key is prefill.api_key_file", `pools: {prefill: {api_key_file: /k}, decode: {endpoints: ["10.0.0.2:8000"]}}`, "pools.prefill.api_key_file"},
		{"negative response bound", `{response: {max_body_bytes: -1}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, "response.max_body_bytes"},
		{"misspelt response key", `{response: {rewrite_usages: true}, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`, `unknown field "response.rewrite_usages"`},
		{"KV events without prefix-affinity", `pools: {decode: {endpoints: ["10.0.0.2:8000"], kv_events: {connect_port: 5557}}}`,
			"pools.decode.kv_events: needs policy prefix-affinity"},
		{"KV events in two modes", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, bind: "tcp://0.0.0.0:5557"}}}`,
			"pools.decode.kv_events: connect_port and bind are two modes"},
		{"KV events bound to no address", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {bind: "0.0.0.0:5557"}}}`,
			"pools.decode.kv_events.bind"},
		{"KV events bound to port 0", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {bind: "tcp://0.0.0.0:0"}}}`,
			`pools.decode.kv_events.bind: "tcp://0.0.0.0:0" has port 0: the system would pick a port no engine can know`},
		{"KV events bound to a multicast group", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {bind: "tcp://239.1.2.3:5557"}}}`,
			`pools.decode.kv_events.bind: "tcp://239.1.2.3:5557" is a multicast address: a TCP listener binds one host's address`},
		{"KV events bound to the broadcast address", `pools: {prefill: {endpoints: ["10.0.0.1:8000"], policy: prefix-affinity, kv_events: {bind: "tcp://255.255.255.255:5557"}}, decode: {endpoints: ["10.0.0.2:8000"]}}`,
			`pools.prefill.kv_events.bind: "tcp://255.255.255.255:5557" is the broadcast address: a TCP listener binds one host's address`},
		{"a data-parallel engine publishing to a bound address", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {bind: "tcp://0.0.0.0:5557", data_parallel_size: 2}}}`,
			"pools.decode.kv_events.data_parallel_size: 2 with bind"},
		{"a replay port alone", `pools: {prefill: {kv_events: {replay_port: 5558}}, decode: {endpoints: ["10.0.0.2:8000"]}}`,
			"pools.prefill.kv_events: set without connect_port or bind"},
		{"event settings without a mode", `pools: {decode: {endpoints: ["10.0.0.2:8000"], kv_events: {data_parallel_size: 999, stale_after: -1s}}}`,
			"pools.decode.kv_events: set without connect_port or bind"},
		{"a port whose last rank passes 65535", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 65535, data_parallel_size: 2}}}`,
			"pools.decode.kv_events.connect_port: 65535 is not a port"},
		{"KV event and replay ports the ranks share", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, replay_port: 5558, data_parallel_size: 2}}}`,
			"pools.decode.kv_events.replay_port: 5558 to 5559, the ranks' replay ports, overlap their event ports 5557 to 5558"},
		{"a replay port below the ranks' event ports", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5560, replay_port: 5557, data_parallel_size: 4}}}`,
			"pools.decode.kv_events.replay_port"},
		{"KV events on a port out of range", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 70000}}}`,
			"pools.decode.kv_events.connect_port"},
		{"a KV event index smaller in all than per endpoint", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, max_blocks: 10, max_blocks_per_endpoint: 20}}}`,
			"pools.decode.kv_events.max_blocks"},
		{"a KV event frame bound below a batch", `pools: {decode: {endpoints: ["10.0.0.2:8000"], policy: prefix-affinity, kv_events: {connect_port: 5557, max_message_bytes: 100}}}`,
			"pools.decode.kv_events.max_message_bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.yaml))
			if err == nil || !strings.Contains(err.Error(), tt.wantKey) {
				t.Errorf("Parse() error = %v, want one naming %q", err, tt.wantKey)
			}
		})
	}
}

// limits.max_body_bytes is at most what one gRPC message carries (a BUFFERED
// body comes whole in one): above, every request would fail at the gRPC
// layer, or the limit would overflow.
func TestMaxBodyBytesFitsAGRPCMessage(t *testing.T) {
	for _, tt := range []struct {
		value string
		ok    bool
	}{{"33554432", true}, {"2145386496", true}, {"2145386497", false}, {"8589934592", false}, {"9223372036854775807", false}} {
		_, err := Parse([]byte("connector: kv-nixl\nlimits: {max_body_bytes: " + tt.value + ", max_buffered_bytes: 9223372036854775807}\n"))
		if (err == nil) != tt.ok || !tt.ok && !strings.Contains(err.Error(), "limits.max_body_bytes") {
			t.Errorf("max_body_bytes %s: error %v, want ok %v", tt.value, err, tt.ok)
		}
	}
}

// Envoy bounds max_message_timeout at one hour: an override above it would
// be ignored, and the derived default stays within it.
func TestOverrideMessageTimeoutWithinEnvoysBound(t *testing.T) {
	for _, tt := range []struct {
		yaml string
		want time.Duration // 0: refused
	}{
		{"prefill: {timeout: 30s}", time.Minute},
		{"prefill: {timeout: 3590s}", time.Hour},
		{"prefill: {timeout: 2h}", time.Hour},
		{"envoy: {override_message_timeout: 1h}", time.Hour},
		{"envoy: {override_message_timeout: 61m}", 0},
		// A request that may be shed is held first (admission.hold), within the same timer.
		{"admission: {objectives: {batch: -1}}", 90 * time.Second},
		{"admission: {objectives: {batch: -1}, hold: 0s}", time.Minute},
		{"admission: {objectives: {batch: 1}, hold: 10m}", time.Minute},
	} {
		c, err := Parse([]byte("connector: kv-nixl\n" + tt.yaml + "\n"))
		switch {
		case tt.want == 0 && (err == nil || !strings.Contains(err.Error(), "envoy.override_message_timeout")):
			t.Errorf("%s: error %v, want it refused", tt.yaml, err)
		case tt.want != 0 && (err != nil || c.Envoy.OverrideMessageTimeout.D() != tt.want):
			t.Errorf("%s: override %v, error %v; want %v", tt.yaml, c.Envoy.OverrideMessageTimeout, err, tt.want)
		}
	}
}

// In BUFFERED processing Envoy's message timer runs while the prefill leg
// does (and while a request is held for room), so an override below that
// time lets Envoy give up on a request the prefill would still serve. The
// mode is Envoy's, which the config cannot see (FULL_DUPLEX_STREAMED has no
// message timer): a warning names the keys and their values.
func TestOverrideBelowThePrefillIsNamed(t *testing.T) {
	for _, tt := range []struct {
		yaml, want string // want: the warning; "" for none
	}{
		{"prefill: {timeout: 30s}", ""},
		{"envoy: {override_message_timeout: 30s}", ""},
		{"envoy: {override_message_timeout: 10s}", "envoy.override_message_timeout 10s is below prefill.timeout 30s: in BUFFERED processing " +
			"Envoy answers 504 before the prefill leg may end; raise it (and Envoy's max_message_timeout), or lower prefill.timeout"},
		{"envoy: {override_message_timeout: 45s}\nprefill: {timeout: 1m}", "envoy.override_message_timeout 45s is below prefill.timeout 1m0s: "},
		{"envoy: {override_message_timeout: 45s}\nadmission: {objectives: {batch: -1}}", "envoy.override_message_timeout 45s is below prefill.timeout 30s + admission.hold 30s: "},
		{"envoy: {override_message_timeout: 45s}\nadmission: {objectives: {batch: 1}}", ""}, // nothing is held
		{"prefill: {timeout: 2h}", "envoy.override_message_timeout 1h0m0s is below prefill.timeout 2h0m0s: "},
	} {
		t.Run(tt.yaml, func(t *testing.T) {
			c, err := Parse([]byte("connector: kv-nixl\n" + tt.yaml + "\n" + `pools: {decode: {endpoints: ["10.0.0.2:8000"], metrics: {interval: 250ms}}}`))
			if err != nil {
				t.Fatal(err)
			}
			if got := c.ShortOverride(); tt.want == "" && got != "" || !strings.HasPrefix(got, tt.want) {
				t.Errorf("ShortOverride() = %q, want %q", got, tt.want)
			}
		})
	}
}

// vLLM's Responses server runs a generation after each built-in tool call
// with the decode leg's kv_transfer_params again (docs/engines.md, item 8).
// routes.pair_builtin_tools is refused where that second pull goes wrong:
// kv-nixl reads blocks freed since, kv-mooncake waits for a transfer already
// sent. SGLang's Responses requests never go P/D; a store serves every reader.
func TestPairingBuiltinToolsIsRefusedWhereAHandoffServesOnce(t *testing.T) {
	tests := []struct {
		connector string
		wants     []string // what the error says; none: the file loads
	}{
		{"kv-nixl", []string{"routes.pair_builtin_tools", "kv-nixl", "freed", "builtin_tools"}},
		{"kv-mooncake", []string{"routes.pair_builtin_tools", "kv-mooncake", "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "builtin_tools"}},
		{"kv-sglang", nil},
		{"kv-shared-storage", nil},
	}
	for _, tt := range tests {
		t.Run(tt.connector, func(t *testing.T) {
			_, err := Parse([]byte("connector: " + tt.connector + "\n" +
				`pools: {prefill: {endpoints: ["10.0.0.1:8000"]}, decode: {endpoints: ["10.0.0.2:8000"]}}` + "\nroutes: {pair_builtin_tools: true}\n"))
			if tt.wants == nil {
				if err != nil {
					t.Fatalf("Parse() = %v, want the file loaded", err)
				}
				return
			}
			for _, want := range tt.wants {
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Errorf("Parse() error = %v, want one saying %q", err, want)
				}
			}
		})
	}
}
