package k8s

import (
	"context"
	"fmt"
	"testing"

	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/internal/chart"
)

// The chart's RBAC, created in a real API server with the RBAC authorizer, lets the
// ServiceAccount the Deployment runs as list and watch what each pool's discovery reads, in
// the namespace the pool names (config.pools.<pool>.kubernetes.namespace, else the release's):
// pods, and InferencePools for a pool with inference_pool. The API server's
// SubjectAccessReview answers for it; the same account may not list pods in a namespace no
// pool names.
func TestTheChartsRBACLetsEachPoolBeDiscovered(t *testing.T) {
	c := mustCluster(t)
	ctx := context.Background()
	newNS := func(prefix string) string {
		ns, err := c.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return ns.Name
	}
	for _, tc := range []struct {
		name   string
		values string // %[1]s: the engines' namespace
	}{
		{"the decode pool in another namespace", `config: {pools: {decode: {kubernetes: {namespace: %[1]s}}}}`},
		{"the prefill pool in another namespace", `config: {pools: {prefill: {kubernetes: {namespace: %[1]s}}}}`},
		{"both pools' InferencePools in another namespace", `config: {pools: {
  prefill: {kubernetes: {namespace: %[1]s, inference_pool: vllm-prefill, port: null}},
  decode: {kubernetes: {namespace: %[1]s, inference_pool: vllm-decode, port: null}}}}`},
		{"an InferencePool decode pool, its namespace in rbac.extraNamespaces", `{rbac: {extraNamespaces: [%[1]s]},
  config: {pools: {decode: {kubernetes: {namespace: %[1]s, inference_pool: vllm-decode, port: null}}}}}`},
		{"the pools' namespace also in rbac.extraNamespaces", `{config: {pools: {decode: {kubernetes: {namespace: %[1]s}}}}, rbac: {extraNamespaces: [%[1]s]}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rel, engines, other := newNS("release"), newNS("engines"), newNS("other")
			values := map[string]any{}
			if err := yaml.Unmarshal(fmt.Appendf(nil, tc.values, engines), &values); err != nil {
				t.Fatal(err)
			}
			objs := chartObjects(t, chart.Release{Name: "pd-extproc", Namespace: rel}, values)
			account := ""
			for _, o := range objs {
				switch o.GetKind() {
				case "ServiceAccount":
					account = o.GetName()
					c.create(t, o)
				case "Role", "RoleBinding":
					c.create(t, o)
				}
			}
			cfg := configOf(t, objs)
			user := authzv1.SubjectAccessReviewSpec{
				User:   fmt.Sprintf("system:serviceaccount:%s:%s", rel, account),
				Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + rel, "system:authenticated"},
			}
			can := func(verb, group, resource, ns string) bool {
				spec := user
				spec.ResourceAttributes = &authzv1.ResourceAttributes{Namespace: ns, Verb: verb, Group: group, Resource: resource}
				r, err := c.kube.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{Spec: spec}, metav1.CreateOptions{})
				if err != nil {
					t.Fatal(err)
				}
				return r.Status.Allowed
			}
			for _, pool := range []string{"prefill", "decode"} {
				k, _ := dig(cfg, "pools", pool, "kubernetes").(map[string]any)
				ns, _ := k["namespace"].(string)
				if ns == "" {
					ns = rel
				}
				wants := [][2]string{{"", "pods"}}
				if k["inference_pool"] != nil {
					wants = append(wants, [2]string{"inference.networking.k8s.io", "inferencepools"})
				}
				for _, w := range wants {
					for _, verb := range []string{"list", "watch"} {
						// The authorizer reads the RBAC objects from its informers:
						// a binding just made may take a moment to count.
						eventually(t, fmt.Sprintf("%s to be let %s %s in %s, where the %s pool is discovered (else the pool is never ready)",
							user.User, verb, w[1], ns, pool), func() bool { return can(verb, w[0], w[1], ns) })
					}
				}
			}
			if can("list", "", "pods", other) {
				t.Errorf("%s may list pods in %s, which no pool names", user.User, other)
			}
		})
	}
}

// configOf is the pd-extproc config the chart's ConfigMap holds, as a map.
func configOf(t *testing.T, objs []*unstructured.Unstructured) map[string]any {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() != "ConfigMap" {
			continue
		}
		if data, ok, _ := unstructured.NestedString(o.Object, "data", "extproc.yaml"); ok {
			cfg := map[string]any{}
			if err := yaml.Unmarshal([]byte(data), &cfg); err != nil {
				t.Fatal(err)
			}
			return cfg
		}
	}
	t.Fatal("no ConfigMap with extproc.yaml rendered")
	return nil
}

// dig is the value at keys in nested maps, nil where one is missing.
func dig(v any, keys ...string) any {
	for _, k := range keys {
		m, _ := v.(map[string]any)
		v = m[k]
	}
	return v
}
