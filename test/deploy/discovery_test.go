package deploy

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/labels"

	extprocconfig "github.com/pd-extproc/pd-extproc/pkg/config"
)

// The ServiceAccount the Deployment runs as is the one the Roles are bound to, and the Roles
// grant exactly what discovery uses: get, list and watch on pods, and on InferencePools.
func TestDiscoveryRBAC(t *testing.T) {
	ms := loadManifests(t, "config/k8s")
	pod := dig(find(t, ms, "Deployment", "pd-extproc"), "spec", "template", "spec")
	sa := digString(pod, "serviceAccountName")
	if sa == "" || dig(pod, "automountServiceAccountToken") != true {
		t.Fatalf("the Deployment runs as %q with automountServiceAccountToken %v; discovery needs a token", sa, dig(pod, "automountServiceAccountToken"))
	}
	find(t, ms, "ServiceAccount", sa)
	tests := []struct {
		role      string
		apiGroup  string
		resources []any
	}{
		{"pd-extproc", "", []any{"pods"}},
		{"pd-extproc-inferencepools", "inference.networking.k8s.io", []any{"inferencepools"}},
	}
	for _, tc := range tests {
		t.Run(tc.role, func(t *testing.T) {
			want := []any{map[string]any{"apiGroups": []any{tc.apiGroup}, "resources": tc.resources, "verbs": []any{"get", "list", "watch"}}}
			if rules := dig(find(t, ms, "Role", tc.role), "rules"); !reflect.DeepEqual(rules, want) {
				t.Errorf("rules = %v, want exactly %v", rules, want)
			}
			rb := find(t, ms, "RoleBinding", tc.role)
			if digString(rb, "roleRef", "kind") != "Role" || digString(rb, "roleRef", "name") != tc.role {
				t.Errorf("RoleBinding %s refers to %v", tc.role, dig(rb, "roleRef"))
			}
			want = []any{map[string]any{"kind": "ServiceAccount", "name": sa, "namespace": manifestNamespace}}
			if subjects := dig(rb, "subjects"); !reflect.DeepEqual(subjects, want) {
				t.Errorf("RoleBinding %s binds %v, want the Deployment's ServiceAccount", tc.role, subjects)
			}
		})
	}
}

// The shipped ConfigMap discovers the pods of both engine examples: its selectors match their
// pod labels and its named port is a container port of theirs; the InferencePool examples
// select the same pods on the same port.
func TestDiscoveryFindsTheEngineExamples(t *testing.T) {
	ms := loadManifests(t, "config/k8s")
	cfg, err := extprocconfig.Parse([]byte(digString(find(t, ms, "ConfigMap", "pd-extproc"), "data", "extproc.yaml")))
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
	for _, m := range loadManifests(t, "config/k8s") {
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
