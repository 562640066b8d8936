package k8s

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	giev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	gieclient "sigs.k8s.io/gateway-api-inference-extension/client-go/clientset/versioned"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// An InferencePool with two target ports gives two endpoints per pod (as
// data-parallel ranks are exposed), its selector is ANDed with the config's,
// and changes to its ports and selector apply live.
func TestInferencePool(t *testing.T) {
	c := mustCluster(t)
	c.installCRDs(t, "InferencePool")
	ns := c.namespace(t, "infpool")
	gie, err := gieclient.NewForConfig(c.rest)
	if err != nil {
		t.Fatal(err)
	}
	pools := gie.InferenceV1().InferencePools(ns)
	ip := &giev1.InferencePool{
		ObjectMeta: metav1.ObjectMeta{Name: "vllm"},
		Spec: giev1.InferencePoolSpec{
			Selector:    giev1.LabelSelector{MatchLabels: map[giev1.LabelKey]giev1.LabelValue{"app": "vllm"}},
			TargetPorts: []giev1.Port{{Number: enginePort}, {Number: enginePort + 1}},
		},
	}
	if _, err = pools.Create(context.Background(), ip, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	s := startStack(t, "", extprocToken, fmt.Sprintf(`connector: kv-nixl
pools:
  prefill: {kubernetes: {namespace: %[1]s, inference_pool: vllm, selector: "%[2]s=prefill"}}
  decode: {kubernetes: {namespace: %[1]s, inference_pool: vllm, selector: "%[2]s=decode"}}
`, ns, roleLabel))

	// Each pod serves both target ports: a second simulator on its IP.
	var want []string
	engines := map[string][]*engine{}
	for _, role := range []string{pdsim.RolePrefill, pdsim.RoleDecode} {
		for i := range 2 {
			labels := map[string]string{"app": "vllm", roleLabel: role}
			e := c.startEngine(t, ns, fmt.Sprintf("%s-%d", role, i), role, pdsim.ProtocolNIXL, labels, nil, nil)
			testbed.MustStartSim(t, testbed.SimConfig{Role: role, Protocol: pdsim.ProtocolNIXL, IP: e.ip, Addr: fmt.Sprintf("%s:%d", e.ip, enginePort+1)})
			c.setReady(t, e, true)
			engines[role] = append(engines[role], e)
			if role == pdsim.RoleDecode {
				want = append(want, e.addr(), fmt.Sprintf("%s:%d", e.ip, enginePort+1))
			}
		}
	}
	other := c.startEngine(t, ns, "not-in-the-pool", pdsim.RoleDecode, pdsim.ProtocolNIXL, map[string]string{"app": "sglang", roleLabel: "decode"}, nil, nil)
	c.setReady(t, other, true)
	slices.Sort(want)
	eventually(t, "two endpoints per decode pod", func() bool { return slices.Equal(sorted(s.endpoints(t, "decode")), want) })
	eventually(t, "two endpoints per prefill pod", func() bool { return len(s.endpoints(t, "prefill")) == 4 })
	eventually(t, "readiness", func() bool { code, _ := s.readyz(t); return code == http.StatusOK })
	served := map[string]bool{}
	for i := range 16 {
		decode, _ := s.mustPost(t, fmt.Sprintf("pool %d", i))
		served[decode] = true
	}
	if len(served) < 3 {
		t.Errorf("16 requests reached only %v of the 4 decode endpoints", served)
	}

	tests := []struct {
		name   string
		change func(*giev1.InferencePool)
		want   func() []string
	}{
		{"one target port", func(p *giev1.InferencePool) { p.Spec.TargetPorts = []giev1.Port{{Number: enginePort + 1}} }, func() []string {
			var out []string
			for _, e := range engines[pdsim.RoleDecode] {
				out = append(out, fmt.Sprintf("%s:%d", e.ip, enginePort+1))
			}
			return sorted(out)
		}},
		{"another selector", func(p *giev1.InferencePool) {
			p.Spec.Selector.MatchLabels = map[giev1.LabelKey]giev1.LabelValue{"app": "sglang"}
		}, func() []string { return []string{fmt.Sprintf("%s:%d", other.ip, enginePort+1)} }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cur, err := pools.Get(context.Background(), "vllm", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			tc.change(cur)
			if _, err := pools.Update(context.Background(), cur, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
			eventually(t, "the change to apply", func() bool { return slices.Equal(sorted(s.endpoints(t, "decode")), tc.want()) })
		})
	}
	if err := pools.Delete(context.Background(), "vllm", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a deleted pool to empty", func() bool { return len(s.endpoints(t, "decode")) == 0 })
}

func sorted(s []string) []string {
	slices.Sort(s)
	return s
}
