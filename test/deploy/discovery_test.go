package deploy

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/labels"

	extprocconfig "github.com/pd-extproc/pd-extproc/pkg/config"
)

// The ServiceAccount the chart's Deployment runs as is the one its Roles are bound to, in each
// namespace discovery reads, and the Roles grant exactly what discovery's informers use: list
// and watch on pods, and on InferencePools when asked (nothing reads one object: no get).
func TestDiscoveryRBAC(t *testing.T) {
	pods := map[string]any{"apiGroups": []any{""}, "resources": []any{"pods"}, "verbs": []any{"list", "watch"}}
	pools := map[string]any{"apiGroups": []any{"inference.networking.k8s.io"}, "resources": []any{"inferencepools"}, "verbs": []any{"list", "watch"}}
	tests := []struct {
		example    string
		namespaces []string
		rules      []any
	}{
		{"defaults", []string{"pd-extproc"}, []any{pods}},
		{"everything", []string{"llm", "engines"}, []any{pods, pools}},
	}
	for _, tc := range tests {
		t.Run(tc.example, func(t *testing.T) {
			ex := example(t, tc.example)
			ms := chartManifests(t, tc.example)
			pod := dig(find(t, ms, "Deployment", fullname(ex)), "spec", "template", "spec")
			sa := digString(pod, "serviceAccountName")
			if sa == "" || dig(pod, "automountServiceAccountToken") != true {
				t.Fatalf("the Deployment runs as %q with automountServiceAccountToken %v; discovery needs a token", sa, dig(pod, "automountServiceAccountToken"))
			}
			find(t, ms, "ServiceAccount", sa)
			byNS := func(kind string) map[string]map[string]any {
				out := map[string]map[string]any{}
				for _, m := range ms {
					if m.kind() == kind {
						out[digString(m.doc, "metadata", "namespace")] = m.doc
					}
				}
				return out
			}
			roles, bindings := byNS("Role"), byNS("RoleBinding")
			if len(roles) != len(tc.namespaces) || len(bindings) != len(tc.namespaces) {
				t.Errorf("%d Roles and %d RoleBindings, want one of each in %v", len(roles), len(bindings), tc.namespaces)
			}
			for _, ns := range tc.namespaces {
				if rules := dig(roles[ns], "rules"); !reflect.DeepEqual(rules, tc.rules) {
					t.Errorf("Role in %s: rules = %v, want exactly %v", ns, rules, tc.rules)
				}
				rb := bindings[ns]
				if digString(rb, "roleRef", "kind") != "Role" || digString(rb, "roleRef", "name") != digString(roles[ns], "metadata", "name") {
					t.Errorf("RoleBinding in %s refers to %v", ns, dig(rb, "roleRef"))
				}
				want := []any{map[string]any{"kind": "ServiceAccount", "name": sa, "namespace": ex.Release.Namespace}}
				if subjects := dig(rb, "subjects"); !reflect.DeepEqual(subjects, want) {
					t.Errorf("RoleBinding in %s binds %v, want the Deployment's ServiceAccount", ns, subjects)
				}
			}
		})
	}
}

// The chart's default config discovers the pods of both engine examples: its selectors match
// their pod labels and its named port is a container port of theirs; the InferencePool examples
// select the same pods on the same port.
func TestDiscoveryFindsTheEngineExamples(t *testing.T) {
	ms := loadManifests(t, "config/k8s")
	cfg, err := extprocconfig.Parse([]byte(digString(find(t, chartManifests(t, "defaults"), "ConfigMap", "pd-extproc"), "data", "extproc.yaml")))
	if err != nil {
		t.Fatal(err)
	}
	pools := map[string]*extprocconfig.Kubernetes{"prefill": cfg.Pools.Prefill.Kubernetes, "decode": cfg.Pools.Decode.Kubernetes}
	for _, engine := range []string{"vllm", "sglang"} {
		for role, k := range pools {
			t.Run(engine+"-"+role, func(t *testing.T) {
				if k == nil {
					t.Fatalf("the ConfigMap's %s pool is not discovered from Kubernetes", role)
				}
				tmpl := dig(find(t, ms, "Deployment", engine+"-"+role), "spec", "template")
				podLabels, _ := dig(tmpl, "metadata", "labels").(map[string]any)
				set := labels.Set{}
				for name, v := range podLabels {
					set[name] = fmt.Sprint(v)
				}
				if !k.ParsedSelector().Matches(set) {
					t.Errorf("selector %q does not match the pod labels %v", k.Selector, podLabels)
				}
				ports := map[string]float64{}
				for _, c := range dig(tmpl, "spec", "containers").([]any) {
					for _, p := range dig(c, "ports").([]any) {
						ports[digString(p, "name")], _ = dig(p, "containerPort").(float64)
					}
				}
				if k.Port == nil || k.Port.Name == "" || ports[k.Port.Name] == 0 {
					t.Errorf("port %v is not a named container port of the pods (%v)", k.Port, ports)
				}

				ip := find(t, ms, "InferencePool", engine+"-"+role)
				if sel := dig(ip, "spec", "selector", "matchLabels"); !selects(sel, podLabels) {
					t.Errorf("InferencePool %s-%s selects %v, not the pod labels %v", engine, role, sel, podLabels)
				}
				var target []float64
				for _, p := range dig(ip, "spec", "targetPorts").([]any) {
					target = append(target, dig(p, "number").(float64))
				}
				if !slices.Contains(target, ports[k.Port.Name]) {
					t.Errorf("InferencePool %s-%s targets %v, not the engine's port %v", engine, role, target, ports[k.Port.Name])
				}
			})
		}
	}
}

// envoyTag is the Envoy release the shipped setups run: the one Envoy Gateway v1.9.1 runs.
const envoyTag = "v1.39.1"

// The engine and Envoy images are pinned to a release, not a moving tag.
func TestEngineImagesArePinned(t *testing.T) {
	want := map[string]string{"vllm/vllm-openai": "v0.33.0", "lmsysorg/sglang": "v0.5.23", "envoyproxy/envoy": envoyTag}
	for _, m := range append(loadManifests(t, "config/k8s"), chartManifests(t, "defaults")...) {
		if m.kind() != "Deployment" || m.name() == "pd-extproc" {
			continue
		}
		for _, c := range dig(m.doc, "spec", "template", "spec", "containers").([]any) {
			image := digString(c, "image")
			repo, tag, _ := strings.Cut(image, ":")
			if want[repo] == "" || tag != want[repo] {
				t.Errorf("%s %s: image %q, want %s:%s", m.file, m.name(), image, repo, want[repo])
			}
		}
	}
}

// The chart's pools dial the example engines' KV event and replay ports: each engine publishes
// there (--kv-events-config, with the zmq publisher named: SGLang's older releases default to
// none), names them as container ports, and the engines' NetworkPolicy lets pd-extproc reach
// them. An engine that publishes elsewhere leaves its pool stale for good.
func TestTheChartsPoolsDialTheEnginesKVEvents(t *testing.T) {
	ms := loadManifests(t, "config/k8s")
	cfg, err := extprocconfig.Parse([]byte(digString(find(t, chartManifests(t, "defaults"), "ConfigMap", "pd-extproc"), "data", "extproc.yaml")))
	if err != nil {
		t.Fatal(err)
	}
	pools := map[string]extprocconfig.KVEvents{"prefill": cfg.Pools.Prefill.KVEvents, "decode": cfg.Pools.Decode.KVEvents}
	for _, engine := range []string{"vllm", "sglang"} {
		for role, kv := range pools {
			t.Run(engine+"-"+role, func(t *testing.T) {
				if kv.ConnectPort == 0 || kv.ReplayPort == 0 {
					t.Fatalf("the chart's %s pool follows no events on a port: %+v", role, kv)
				}
				tmpl := dig(find(t, ms, "Deployment", engine+"-"+role), "spec", "template")
				c := dig(tmpl, "spec", "containers").([]any)[0]
				var spec struct {
					Enable         bool   `json:"enable_kv_cache_events"`
					Publisher      string `json:"publisher"`
					Endpoint       string `json:"endpoint"`
					ReplayEndpoint string `json:"replay_endpoint"`
				}
				cmd := append(toStrings(dig(c, "command")), toStrings(dig(c, "args"))...)
				for i, a := range cmd {
					if v, ok := strings.CutPrefix(a, "--kv-events-config="); ok {
						err = json.Unmarshal([]byte(v), &spec)
					} else if a == "--kv-events-config" && i+1 < len(cmd) {
						err = json.Unmarshal([]byte(cmd[i+1]), &spec)
					}
				}
				if err != nil || !spec.Enable || spec.Publisher != "zmq" {
					t.Errorf("--kv-events-config %+v (%v): want events on, published with zmq", spec, err)
				}
				if want := fmt.Sprintf("tcp://*:%d", kv.ConnectPort); spec.Endpoint != want {
					t.Errorf("the engine publishes on %q, the pool dials %s", spec.Endpoint, want)
				}
				if want := fmt.Sprintf("tcp://*:%d", kv.ReplayPort); spec.ReplayEndpoint != want {
					t.Errorf("the engine replays on %q, the pool asks %s", spec.ReplayEndpoint, want)
				}
				ports := map[string]float64{}
				for _, p := range dig(c, "ports").([]any) {
					ports[digString(p, "name")], _ = dig(p, "containerPort").(float64)
				}
				if ports["kv-events"] != float64(kv.ConnectPort) || ports["kv-replay"] != float64(kv.ReplayPort) {
					t.Errorf("container ports %v: want kv-events %d and kv-replay %d", ports, kv.ConnectPort, kv.ReplayPort)
				}
				podLabels, _ := dig(tmpl, "metadata", "labels").(map[string]any)
				if admitted := extprocPorts(t, ms, podLabels); !admitted["kv-events"] || !admitted["kv-replay"] {
					t.Errorf("the engines' NetworkPolicy admits pd-extproc on %v, not on kv-events and kv-replay", admitted)
				}
			})
		}
	}
}

// extprocPorts are the ports on which the NetworkPolicies selecting pods with these labels admit
// pd-extproc's pods.
func extprocPorts(t *testing.T, ms []manifest, podLabels map[string]any) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, m := range ms {
		if m.kind() != "NetworkPolicy" || !selects(dig(m.doc, "spec", "podSelector", "matchLabels"), podLabels) {
			continue
		}
		for _, rule := range dig(m.doc, "spec", "ingress").([]any) {
			fromExtproc := false
			for _, from := range dig(rule, "from").([]any) {
				fromExtproc = fromExtproc || digString(from, "podSelector", "matchLabels", "app.kubernetes.io/name") == "pd-extproc"
			}
			ports, _ := dig(rule, "ports").([]any)
			for _, p := range ports {
				if fromExtproc {
					out[fmt.Sprint(dig(p, "port"))] = true
				}
			}
		}
	}
	return out
}
