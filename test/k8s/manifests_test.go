package k8s

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/pd-extproc/pd-extproc/internal/chart"
)

// shippedManifests reads every object users apply: the engine examples of config/k8s, and the
// chart rendered with each value set of internal/chart.Examples.
func shippedManifests(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	out := loadManifests(t, "config/k8s/*.yaml")
	for _, ex := range chart.Examples {
		values, err := ex.ValuesMap()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, chartObjects(t, ex.Release, values)...)
	}
	return out
}

// prepareForManifests installs the CRDs the manifests use and creates their
// namespaces (helm install --create-namespace's, and the one the everything
// example discovers engines in), which namespaced objects need even in a dry run.
func prepareForManifests(t *testing.T, c *cluster) {
	t.Helper()
	c.installCRDs(t, "InferencePool", "GatewayClass", "Gateway", "HTTPRoute", "ReferenceGrant", "BackendTLSPolicy",
		"EnvoyExtensionPolicy", "EnvoyPatchPolicy", "ClientTrafficPolicy", "BackendTrafficPolicy", "EnvoyProxy", "Issuer", "Certificate",
		"ServiceMonitor", "PodMonitor", "PrometheusRule")
	for _, ns := range []string{"pd-extproc", "llm", "engines"} {
		_, err := c.kube.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
}

// Every shipped manifest, and every object the chart renders for each value
// set, is accepted by a real API server: server-side apply in dry-run mode
// runs admission, the OpenAPI schema, the CRDs' validation (CEL rules
// included) and defaulting, and stores nothing.
func TestManifestsPassServerSideDryRun(t *testing.T) {
	c := mustCluster(t)
	prepareForManifests(t, c)
	objs := shippedManifests(t)
	kinds := map[string]bool{}
	for _, obj := range objs {
		kinds[obj.GetKind()] = true
		if err := c.dryRunApply(obj); err != nil {
			t.Errorf("%s refused: %v", describe(obj), err)
		}
	}
	for _, k := range []string{"Deployment", "Role", "RoleBinding", "ServiceAccount", "InferencePool", "EnvoyExtensionPolicy", "HTTPRoute",
		"NetworkPolicy", "ReferenceGrant", "BackendTLSPolicy", "EnvoyProxy", "Certificate", "Issuer", "PodDisruptionBudget", "ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} {
		if !kinds[k] {
			t.Errorf("no %s among the %d objects checked", k, len(objs))
		}
	}
}

// Broken copies of shipped manifests are refused, each for its own reason:
// the dry run does check what the previous test relies on.
func TestBrokenManifestsAreRefused(t *testing.T) {
	c := mustCluster(t)
	prepareForManifests(t, c)
	objs := shippedManifests(t)
	pick := func(kind, name string) *unstructured.Unstructured {
		for _, o := range objs {
			if o.GetKind() == kind && o.GetName() == name {
				return o.DeepCopy()
			}
		}
		t.Fatalf("no %s %s in the manifests", kind, name)
		return nil
	}
	set := func(o *unstructured.Unstructured, v any, path ...string) {
		if err := unstructured.SetNestedField(o.Object, v, path...); err != nil {
			t.Fatal(err)
		}
	}
	// setTo breaks an object by setting v at path.
	setTo := func(v any, path ...string) func(*unstructured.Unstructured) {
		return func(o *unstructured.Unstructured) { set(o, v, path...) }
	}
	tests := []struct {
		name, kind, obj string
		breakIt         func(*unstructured.Unstructured)
		want            string // in the API server's answer
	}{
		{"InferencePool target port twice (a CEL rule)", "InferencePool", "vllm-decode",
			setTo([]any{map[string]any{"number": int64(8000)}, map[string]any{"number": int64(8000)}}, "spec", "targetPorts"), "port number must be unique"},
		{"InferencePool with nine target ports", "InferencePool", "vllm-decode", func(o *unstructured.Unstructured) {
			var ports []any
			for i := range 9 {
				ports = append(ports, map[string]any{"number": int64(8000 + i)})
			}
			set(o, ports, "spec", "targetPorts")
		}, "must have at most 8 items"},
		{"EnvoyExtensionPolicy failing open in FULL_DUPLEX_STREAMED (a CEL rule)", "EnvoyExtensionPolicy", "", func(o *unstructured.Unstructured) {
			procs, _, _ := unstructured.NestedSlice(o.Object, "spec", "extProc")
			procs[0].(map[string]any)["failOpen"] = true
			set(o, procs, "spec", "extProc")
		}, "FailOpen must be false"},
		{"Deployment with replicas as a string", "Deployment", "pd-extproc", setTo("two", "spec", "replicas"), "replicas"},
		{"Role with an unknown field", "Role", "pd-extproc", setTo([]any{"pods"}, "rules0"), "rules0"},
		{"NetworkPolicy naming a port no Service port could be called", "NetworkPolicy", "pd-extproc", func(o *unstructured.Unstructured) {
			ingress, _, _ := unstructured.NestedSlice(o.Object, "spec", "ingress")
			ingress[0].(map[string]any)["ports"] = []any{map[string]any{"port": "grpc_9002", "protocol": "TCP"}}
			set(o, ingress, "spec", "ingress")
		}, "grpc_9002"},
		{"NetworkPolicy of an unknown policy type", "NetworkPolicy", "pd-extproc", setTo([]any{"Inbound"}, "spec", "policyTypes"), "Inbound"},
		{"BackendTLSPolicy without the hostname it checks", "BackendTLSPolicy", "pd-extproc", func(o *unstructured.Unstructured) {
			unstructured.RemoveNestedField(o.Object, "spec", "validation", "hostname")
		}, "hostname"},
		{"BackendTLSPolicy trusting the system CAs beside its own (a CEL rule)", "BackendTLSPolicy", "pd-extproc",
			setTo("System", "spec", "validation", "wellKnownCACertificates"), "must not contain both CACertificateRefs and WellKnownCACertificates"},
		{"EnvoyProxy with a misspelt backendTLS", "EnvoyProxy", "pd-gateway-proxy", func(o *unstructured.Unstructured) {
			v, _, _ := unstructured.NestedMap(o.Object, "spec", "backendTLS")
			unstructured.RemoveNestedField(o.Object, "spec", "backendTLS")
			set(o, v, "spec", "backendTls")
		}, "backendTls"},
		{"Deployment whose preStop sleeps past the grace period", "Deployment", "pd-extproc", func(o *unstructured.Unstructured) {
			cs, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
			cs[0].(map[string]any)["lifecycle"] = map[string]any{"preStop": map[string]any{"sleep": map[string]any{"seconds": int64(700)}}}
			set(o, cs, "spec", "template", "spec", "containers")
		}, "less than terminationGracePeriodSeconds (600)"},
		{"PodDisruptionBudget with an eviction policy Kubernetes does not know", "PodDisruptionBudget", "pd-extproc",
			setTo("WhenUnhealthy", "spec", "unhealthyPodEvictionPolicy"), "WhenUnhealthy"},
		{"ServiceMonitor with a misspelt honorLabels", "ServiceMonitor", "router-pd-extproc", func(o *unstructured.Unstructured) {
			eps, _, _ := unstructured.NestedSlice(o.Object, "spec", "endpoints")
			delete(eps[0].(map[string]any), "honorLabels")
			eps[0].(map[string]any)["honourLabels"] = true
			set(o, eps, "spec", "endpoints")
		}, "honourLabels"},
		{"Certificate with a usage cert-manager does not know", "Certificate", "pd-extproc-tls",
			setTo([]any{"server authentication"}, "spec", "usages"), "server authentication"},
		{"HTTPRoute path of an unknown type", "HTTPRoute", "pd-gateway-inference", func(o *unstructured.Unstructured) {
			rules, _, _ := unstructured.NestedSlice(o.Object, "spec", "rules")
			m := rules[0].(map[string]any)["matches"].([]any)[0].(map[string]any)
			m["path"].(map[string]any)["type"] = "Glob"
			set(o, rules, "spec", "rules")
		}, "Glob"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var o *unstructured.Unstructured
			if tc.obj == "" {
				for _, x := range objs {
					if x.GetKind() == tc.kind {
						o = x.DeepCopy()
						break
					}
				}
			} else {
				o = pick(tc.kind, tc.obj)
			}
			if err := c.dryRunApply(o); err != nil {
				t.Fatalf("the unbroken %s is refused: %v", describe(o), err)
			}
			tc.breakIt(o)
			err := c.dryRunApply(o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("dry run of the broken %s: %v; want a refusal naming %q", describe(o), err, tc.want)
			}
		})
	}
}

// The names the chart takes at the bounds it checks (TestChartRefusesNamesKubernetesRefuses in
// test/deploy) are the API server's: a gateway.name of 56 characters and a GatewayClass name
// with dots render objects it takes, and the Service <gateway.name>-decode one character longer,
// or with a dot, it refuses.
func TestChartNameBoundsAreTheAPIServers(t *testing.T) {
	c := mustCluster(t)
	prepareForManifests(t, c)
	gw := "g" + strings.Repeat("x", 55)
	objs := chartObjects(t, chart.Release{Name: "pd-extproc", Namespace: "pd-extproc"}, map[string]any{
		"gateway": map[string]any{"enabled": true, "name": gw, "className": "llm.example.com"},
	})
	var decode *unstructured.Unstructured
	for _, obj := range objs {
		if err := c.dryRunApply(obj); err != nil {
			t.Errorf("%s refused: %v", describe(obj), err)
		}
		if obj.GetKind() == "Service" && obj.GetName() == gw+"-decode" {
			decode = obj
		}
	}
	if decode == nil {
		t.Fatalf("no Service %s-decode rendered", gw)
	}
	for name, want := range map[string]string{
		"x" + gw + "-decode": "must be no more than 63 characters",
		"pd.gateway-decode":  "must not contain dots",
	} {
		o := decode.DeepCopy()
		o.SetName(name)
		if err := c.dryRunApply(o); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("dry run of Service %s: %v; want a refusal naming %q", name, err, want)
		}
	}
}

// The label and Secret key bounds the chart checks at render (TestChartRefusesNamesKubernetesRefuses
// in test/deploy): app.kubernetes.io/name (nameOverride) is a label value, capitals taken and a
// trailing dot refused, as the API server has it; a Secret volume's key (engineAPIKey.key) the
// API server takes whatever it holds but its emptiness, so the chart alone can refuse one no
// Secret can hold, which the kubelet would never mount.
func TestChartLabelAndKeyBoundsAreTheAPIServers(t *testing.T) {
	c := mustCluster(t)
	prepareForManifests(t, c)
	objs := chartObjects(t, chart.Release{Name: "pd-extproc", Namespace: "pd-extproc"}, map[string]any{
		"fullnameOverride": "router", "nameOverride": "PD", "engineAPIKey": map[string]any{"secretName": "engine-key"},
	})
	var deploy *unstructured.Unstructured
	for _, obj := range objs {
		if err := c.dryRunApply(obj); err != nil {
			t.Errorf("%s refused: %v", describe(obj), err)
		}
		if obj.GetKind() == "Deployment" && obj.GetName() == "router" {
			deploy = obj
		}
	}
	if deploy == nil {
		t.Fatal("no Deployment router rendered")
	}
	withKey := func(key string) *unstructured.Unstructured {
		o := deploy.DeepCopy()
		vols, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "volumes")
		for _, v := range vols {
			if s, _ := v.(map[string]any)["secret"].(map[string]any); s["secretName"] == "engine-key" {
				s["items"].([]any)[0].(map[string]any)["key"] = key
			}
		}
		if err := unstructured.SetNestedSlice(o.Object, vols, "spec", "template", "spec", "volumes"); err != nil {
			t.Fatal(err)
		}
		return o
	}
	dotted := deploy.DeepCopy()
	labels := dotted.GetLabels()
	labels["app.kubernetes.io/name"] = "pd."
	dotted.SetLabels(labels)
	for _, tc := range []struct {
		name string
		obj  *unstructured.Unstructured
		want string // "": taken
	}{
		{"the label app.kubernetes.io/name ending in a dot", dotted, "a valid label must be"},
		{"a Secret key with a slash", withKey("keys/api"), ""},
		{"an empty Secret key", withKey(""), "items[0].key: Required value"},
	} {
		err := c.dryRunApply(tc.obj)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("dry run of the Deployment with %s: %v; want %q", tc.name, err, tc.want)
		}
	}
}
