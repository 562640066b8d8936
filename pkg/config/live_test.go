package config

import (
	"cmp"
	"fmt"
	"reflect"
	"slices"
	"testing"
)

// reloadPools is the pools block of the configs below, unless a case gives its own.
const reloadPools = `pools:
  prefill: {endpoints: ["10.0.0.1:8000"], bootstrap_port: 8998}
  decode: {endpoints: ["10.0.0.2:8000"], kubernetes: {selector: "role=decode", port: 8000}}
`

func mustParse(t *testing.T, yaml string) *Config {
	t.Helper()
	c, err := Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Every changed key is either applied by a reload or named as waiting for a
// restart: the keys of the list (connector, bootstrap_port, limits,
// prefill.*, envoy.*, tracing) and those the response, Kubernetes and
// pass-through work added.
func TestRestartPendingNamesTheKeysAReloadDoesNotApply(t *testing.T) {
	tests := []struct {
		name      string
		connector string // default kv-nixl
		pools     string // default reloadPools
		more      string // other top-level keys
		want      []string
	}{
		{name: "nothing changed"},
		{name: "pools, policies, health, scrapes, DNS and pd.* apply live",
			pools: `pools:
  prefill: {endpoints: ["10.0.0.9:8000"], bootstrap_port: 8998, policy: round-robin, health: {consecutive_failures: 5}, prefix: {key_blocks: 4}}
  decode: {endpoints: ["10.0.0.8:8000"], kubernetes: {selector: "role=decode", port: 8000}, metrics: {interval: 2s}, dns: "d.example:8000", dns_interval: 3s, fallbacks: 1}
`,
			more: `pd: {mode: always, chars_per_token: 3}`},
		{name: "admission.* applies live", more: `admission: {objectives: {chat: 10}, saturated_queue: 3, hold: 5s, retry_after: 5s}`},
		{name: "connector", connector: "kv-shared-storage", want: []string{"connector"}},
		{name: "bootstrap port", pools: `pools: {prefill: {endpoints: ["10.0.0.1:8000"], bootstrap_port: 9000}, decode: {endpoints: ["10.0.0.2:8000"], kubernetes: {selector: "role=decode", port: 8000}}}`,
			want: []string{"pools.prefill.bootstrap_port"}},
		{name: "a pool's Kubernetes selector", pools: `pools: {prefill: {endpoints: ["10.0.0.1:8000"]}, decode: {endpoints: ["10.0.0.2:8000"], kubernetes: {selector: "role=other", port: 8000}}}`,
			want: []string{"pools.decode.kubernetes.selector"}},
		{name: "Kubernetes discovery added to a pool", pools: `pools: {prefill: {endpoints: ["10.0.0.1:8000"], kubernetes: {selector: "role=prefill", port: 8000}}, decode: {endpoints: ["10.0.0.2:8000"], kubernetes: {selector: "role=decode", port: 8000}}}`,
			want: []string{"pools.prefill.kubernetes"}},
		// Discovery starts and stops with the process: the pool keeps its other sources until then.
		{name: "a pool moved from static endpoints to Kubernetes", pools: `pools: {prefill: {kubernetes: {selector: "role=prefill", port: 8000}}, decode: {endpoints: ["10.0.0.2:8000"], kubernetes: {selector: "role=decode", port: 8000}}}`,
			want: []string{"pools.prefill.endpoints", "pools.prefill.kubernetes"}},
		{name: "a pool moved from Kubernetes to DNS", pools: `pools: {prefill: {endpoints: ["10.0.0.1:8000"]}, decode: {dns: "d.example:8000"}}`,
			want: []string{"pools.decode.dns", "pools.decode.dns_interval", "pools.decode.endpoints", "pools.decode.kubernetes"}},
		{name: "the decode pool's TLS", pools: `pools: {prefill: {endpoints: ["10.0.0.1:8000"]}, decode: {endpoints: ["10.0.0.2:8000"], kubernetes: {selector: "role=decode", port: 8000}, tls: {enabled: true}}}`,
			want: []string{"pools.decode.tls.enabled"}},
		// prefill.max_background defaults to limits.max_concurrent_streams and follows it.
		{name: "limits", more: `limits: {max_concurrent_streams: 10, max_body_bytes: 1048576, body_timeout: 5s, max_buffered_bytes: 104857600}`,
			want: []string{"limits.body_timeout", "limits.max_body_bytes", "limits.max_buffered_bytes", "limits.max_concurrent_streams", "prefill.max_background"}},
		// The defaults that follow prefill.timeout change with it.
		{name: "prefill.timeout", more: `prefill: {timeout: 10s}`, want: []string{"envoy.override_message_timeout", "prefill.attempt_timeout", "prefill.timeout"}},
		{name: "prefill legs", more: `prefill: {on_failure: fail, http2: true, max_idle_conns_per_endpoint: 8, max_conns_per_endpoint: 16, max_background: 4, attempts: 3, tls: {enabled: true}}`,
			want: []string{"prefill.attempts", "prefill.http2", "prefill.max_background", "prefill.max_conns_per_endpoint", "prefill.max_idle_conns_per_endpoint", "prefill.on_failure", "prefill.tls.enabled"}},
		{name: "envoy", more: `envoy: {override_after: 1s}`, want: []string{"envoy.override_after"}},
		{name: "tracing", more: `tracing: {otlp_endpoint: "http://collector:4317", sample_ratio: 0.5}`, want: []string{"tracing.otlp_endpoint", "tracing.sample_ratio"}},
		{name: "the pass-through list", more: `routes: {passthrough: ["GET /v1/models"]}`, want: []string{"routes.passthrough"}},
		{name: "the APIs paired", more: `routes: {messages_decode_only: true, responses_decode_only: true}`,
			want: []string{"routes.messages_decode_only", "routes.responses_decode_only"}},
		{name: "built-in tools paired, under another connector", connector: "kv-shared-storage", more: `routes: {pair_builtin_tools: true}`,
			want: []string{"connector", "routes.pair_builtin_tools"}},
		{name: "the response path", more: `response: {rewrite_usage: true, max_body_bytes: 1024}`, want: []string{"response.max_body_bytes", "response.rewrite_usage"}},
	}
	file := func(connector, pools, more string) string {
		return "connector: " + cmp.Or(connector, "kv-nixl") + "\n" + cmp.Or(pools, reloadPools) + "\n" + more + "\n"
	}
	started := mustParse(t, file("", "", ""))
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			next := mustParse(t, file(tt.connector, tt.pools, tt.more))
			if got := restartPending(next.inForce(started, started), next); !slices.Equal(got, tt.want) {
				t.Errorf("restart-only keys = %q, want %q", got, tt.want)
			}
		})
	}
}

// A pool whose kubernetes key a reload adds or drops keeps the sources in
// force before it (the last reload's, not the start's) until the restart
// that starts or stops its discovery; a reload back to the key it started
// with applies its sources again.
func TestInForceHoldsAPoolsSourcesAcrossADiscoverySwitch(t *testing.T) {
	const kube = `kubernetes: {selector: role=decode, port: 8000}`
	// The prefill pool's ignored key comes before the decode pool's.
	parse := func(decode string) *Config {
		c, err := Parse([]byte("connector: kv-nixl\npools: {prefill: {endpoints: [\"10.0.0.1:8000\"], health: {check_path: /ready}}, decode: {" + decode + "}}\n"))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	const prefillIgnored = "pools.prefill.health.check_path (needs pools.prefill.health.check_interval)"
	tests := []struct {
		name, started string
		reloads       []string // each file in turn
		endpoints     string   // the decode pool's sources in force after the last
		dns           string
		kubernetes    bool
		dnsIgnored    bool // the decode pool's dns_interval is named ignored
	}{
		{"DNS, another name, then Kubernetes", `dns: "a.example:8000"`, []string{`dns: "b.example:8000"`, kube}, "[]", "b.example:8000", false, false},
		{"static, then Kubernetes and a new list", `endpoints: ["10.0.0.2:8000"]`, []string{kube + `, endpoints: ["10.0.0.3:8000"]`}, "[10.0.0.2:8000]", "", false, false},
		{"Kubernetes, then DNS", kube + `, endpoints: ["10.0.0.2:8000"]`, []string{`dns: "b.example:8000"`}, "[10.0.0.2:8000]", "", true, false},
		{"Kubernetes, static, then Kubernetes again", kube, []string{`endpoints: ["10.0.0.3:8000"]`, kube + `, endpoints: ["10.0.0.4:8000"]`}, "[10.0.0.4:8000]", "", true, false},
		// The running lookups follow the held dns_interval; with no running
		// name, none does.
		{"DNS, then Kubernetes keeping dns_interval", `dns: "a.example:8000", dns_interval: 1h`, []string{kube + ", dns_interval: 1h"}, "[]", "a.example:8000", false, false},
		{"Kubernetes, then DNS keeping dns_interval", kube + ", dns_interval: 1h", []string{`dns: "b.example:8000", dns_interval: 1h`}, "[]", "", true, true},
		{"Kubernetes, then Kubernetes with dns_interval", kube, []string{kube + ", dns_interval: 1h"}, "[]", "", true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			started := parse(tt.started)
			run := started
			for _, f := range tt.reloads {
				run = parse(f).inForce(started, run)
			}
			d := run.Pools.Decode
			if got := fmt.Sprint(d.Endpoints); got != tt.endpoints || d.DNS != tt.dns || (d.Kubernetes != nil) != tt.kubernetes {
				t.Errorf("in force: endpoints %s, dns %q, kubernetes %v; want %s, %q, %v", got, d.DNS, d.Kubernetes != nil, tt.endpoints, tt.dns, tt.kubernetes)
			}
			ignored := []string{prefillIgnored}
			if tt.dnsIgnored {
				ignored = append(ignored, "pools.decode.dns_interval (needs pools.decode.dns)")
			}
			if !slices.Equal(run.Ignored(), ignored) {
				t.Errorf("in force, ignored %q; want %q", run.Ignored(), ignored)
			}
		})
	}
}

// The config in force after a reload is the started one with the file's
// live keys (LiveKeys): every other key the file changes keeps its running
// value there, for the warnings and the next reload to read.
func TestInForceKeepsTheRunningValueOfEachRestartOnlyKey(t *testing.T) {
	const pools = `pools: {prefill: {endpoints: ["10.0.0.1:8000"]}, decode: {endpoints: ["10.0.0.2:8000"]}}`
	const started = "connector: kv-nixl\n" + pools + "\n"
	tests := []struct {
		name, next string
		want       string // the file whose config is in force; "": started
	}{
		// Not max_concurrent_streams: admission.max_held, live, follows it (README).
		{name: "limits", next: started + "limits: {max_body_bytes: 1048576, body_timeout: 5s, retry_after: 2s}\n"},
		{name: "tracing", next: started + "tracing: {otlp_endpoint: \"http://collector:4317\", sample_ratio: 0.5}\n"},
		{name: "routes", next: started + "routes: {passthrough: [\"GET /v1/models\"], messages_decode_only: true, responses_decode_only: true}\n"},
		{name: "response", next: started + "response: {rewrite_usage: true, max_body_bytes: 1024}\n"},
		{name: "a pool's TLS, key and bootstrap port", next: "connector: kv-nixl\npools: {prefill: {endpoints: [\"10.0.0.1:8000\"], bootstrap_port: 9000}, " +
			"decode: {endpoints: [\"10.0.0.2:8000\"], tls: {enabled: true}, api_key_file: /keys/decode}}\n"},
		{name: "prefill and envoy", next: started + "prefill: {timeout: 10s, attempts: 3}\nenvoy: {override_after: 1s}\n"},
		{name: "the connector", next: "connector: kv-shared-storage\n" + pools + "\n"},
		{name: "live keys beside restart-only ones",
			next: "connector: kv-nixl\npools: {prefill: {endpoints: [\"10.0.0.1:8000\"]}, decode: {endpoints: [\"10.0.0.3:8000\"], policy: round-robin}}\n" +
				"limits: {max_body_bytes: 1048576}\npd: {mode: always}\nadmission: {objectives: {chat: 1}}\n",
			want: "connector: kv-nixl\npools: {prefill: {endpoints: [\"10.0.0.1:8000\"]}, decode: {endpoints: [\"10.0.0.3:8000\"], policy: round-robin}}\n" +
				"pd: {mode: always}\nadmission: {objectives: {chat: 1}}\n"},
	}
	parse := func(f string) *Config {
		c, err := Parse([]byte(f))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := parse(started)
			got, want := parse(tt.next).inForce(s, s), parse(cmp.Or(tt.want, started))
			g, w := reflect.ValueOf(*got), reflect.ValueOf(*want)
			for i := range g.NumField() {
				if g.Type().Field(i).IsExported() && !reflect.DeepEqual(g.Field(i).Interface(), w.Field(i).Interface()) {
					t.Errorf("in force, %s = %+v; want %+v", g.Type().Field(i).Name, g.Field(i), w.Field(i))
				}
			}
			if !slices.Equal(got.Ignored(), want.Ignored()) {
				t.Errorf("in force, ignored %q; want %q", got.Ignored(), want.Ignored())
			}
		})
	}
}
