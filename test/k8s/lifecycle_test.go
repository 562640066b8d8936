package k8s

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

const roleLabel = "pd-extproc.io/pool"

// selectorConfig is a kv-nixl config whose pools are the pods of ns by role
// label: prefill on the named port, decode on the number.
func selectorConfig(ns string) string {
	return fmt.Sprintf(`connector: kv-nixl
pools:
  prefill:
    kubernetes: {namespace: %[1]s, selector: "%[2]s=prefill", port: http}
  decode:
    kubernetes: {namespace: %[1]s, selector: "%[2]s=decode", port: %[3]d}
`, ns, roleLabel, enginePort)
}

// A pod that turns Ready joins its pool and serves; one that turns unready,
// is relabelled or is deleted leaves at once: once the change shows in
// extproc's endpoints, no request goes to it.
func TestPodLifecycle(t *testing.T) {
	c := mustCluster(t)
	ns := c.namespace(t, "lifecycle")
	s := startStack(t, "", extprocToken, selectorConfig(ns))
	nixl := pdsim.ProtocolNIXL
	prefill := c.startEngine(t, ns, "prefill-0", pdsim.RolePrefill, nixl, map[string]string{roleLabel: "prefill"}, nil, nil)
	d0 := c.startEngine(t, ns, "decode-0", pdsim.RoleDecode, nixl, map[string]string{roleLabel: "decode"}, nil, nil)
	d1 := c.startEngine(t, ns, "decode-1", pdsim.RoleDecode, nixl, map[string]string{roleLabel: "decode"}, nil, nil)
	for _, e := range []*engine{prefill, d0, d1} {
		c.setReady(t, e, false) // running, with an IP, not Ready
	}
	eventually(t, "discovery to sync", func() bool { return s.metric(t, `pd_extproc_discovery_synced{pool="decode"}`) == 1 })
	if eps := s.endpoints(t, "decode"); len(eps) != 0 {
		t.Fatalf("pods that are not Ready are endpoints: %v", eps)
	}
	if code, text := s.readyz(t); code != http.StatusServiceUnavailable || !strings.Contains(text, "no healthy decode endpoint") {
		t.Fatalf("/readyz with no Ready decode pod = %d %q, want 503 naming the decode pool", code, text)
	}

	// Ready: both join and serve, each with a real KV handoff from the prefill pod.
	for _, e := range []*engine{prefill, d0, d1} {
		c.setReady(t, e, true)
	}
	eventually(t, "the Ready pods to join", func() bool {
		return slices.Equal(sorted(s.endpoints(t, "decode")), sorted([]string{d0.addr(), d1.addr()})) && slices.Equal(s.endpoints(t, "prefill"), []string{prefill.addr()})
	})
	eventually(t, "readiness", func() bool { code, _ := s.readyz(t); return code == http.StatusOK })
	served := map[string]bool{}
	for i := range 8 {
		decode, source := s.mustPost(t, fmt.Sprintf("joined %d", i))
		served[decode] = true
		if source != prefill.sim.KVAddr() {
			t.Fatalf("decode pulled KV from %q, want the prefill pod's side channel %s", source, prefill.sim.KVAddr())
		}
	}
	if !served[d0.addr()] || !served[d1.addr()] {
		t.Errorf("8 requests went to %v; want both decode pods used", served)
	}

	// An update that changes nothing about the endpoint keeps its state:
	// a request held in flight on d0 is still counted after it.
	inflight := func(e *engine) float64 {
		return s.metric(t, fmt.Sprintf(`pd_extproc_endpoint_inflight{endpoint=%q,pool="decode"}`, e.addr()))
	}
	for _, d := range []*engine{d0, d1} {
		d.sim.SetFaults(pdsim.Faults{Delay: time.Minute})
	}
	ctx, cancel := context.WithCancel(context.Background())
	held := make(chan struct{}, 2)
	for i := range 2 { // least-load puts the second beside the first
		go func() { s.post(ctx, fmt.Sprintf("held %d", i)); held <- struct{}{} }()
		eventually(t, "the request in flight", func() bool { return inflight(d0)+inflight(d1) == float64(i+1) })
	}
	c.update(t, d0, func(p *corev1.Pod) { p.Annotations = map[string]string{"touched": "yes"} })
	// A watch delivers events in order: once a pod made Ready after the update
	// has joined, the update has been applied.
	marker := c.startEngine(t, ns, "marker", pdsim.RoleDecode, nixl, map[string]string{roleLabel: "decode"}, nil, nil)
	c.setReady(t, marker, true)
	eventually(t, "the update to be seen", func() bool { return slices.Contains(s.endpoints(t, "decode"), marker.addr()) })
	if got := inflight(d0); got != 1 {
		t.Errorf("after an informer update of the same pod the endpoint counts %v requests in flight, want 1: its state was lost", got)
	}
	cancel()
	<-held
	<-held
	for _, d := range []*engine{d0, d1} {
		d.sim.SetFaults(pdsim.Faults{})
	}
	c.deletePod(t, marker)
	eventually(t, "the marker pod to leave", func() bool { return len(s.endpoints(t, "decode")) == 2 })

	tests := []struct {
		name   string
		change func(e *engine)
	}{
		{"unready", func(e *engine) { c.setReady(t, e, false) }},
		{"relabelled", func(e *engine) { c.update(t, e, func(p *corev1.Pod) { p.Labels[roleLabel] = "drained" }) }},
		{"deleted", func(e *engine) { c.deletePod(t, e) }},
	}
	outer := t // the pod a case brings in serves into the next case
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// Each case takes d0 out, then brings a fresh Ready pod in its place.
			tc.change(d0)
			eventually(t, "the pod to leave", func() bool { return slices.Equal(s.endpoints(t, "decode"), []string{d1.addr()}) })
			before := len(d0.sim.Requests())
			for j := range 4 {
				if decode, _ := s.mustPost(t, fmt.Sprintf("%s %d", tc.name, j)); decode != d1.addr() {
					t.Fatalf("a request went to %s after it left the pool", decode)
				}
			}
			if n := len(d0.sim.Requests()); n != before {
				t.Fatalf("the pod that left got %d more requests", n-before)
			}
			d0 = c.startEngine(outer, ns, fmt.Sprintf("decode-0-%d", i), pdsim.RoleDecode, nixl, map[string]string{roleLabel: "decode"}, nil, nil)
			c.setReady(t, d0, true)
			eventually(t, "the new pod to join", func() bool { return len(s.endpoints(t, "decode")) == 2 })
		})
	}

	// A label change moves a pod between pools.
	c.update(t, d1, func(p *corev1.Pod) { p.Labels[roleLabel] = "prefill" })
	eventually(t, "decode-1 to move to the prefill pool", func() bool {
		return !slices.Contains(s.endpoints(t, "decode"), d1.addr()) && slices.Contains(s.endpoints(t, "prefill"), d1.addr())
	})
}

// kv-sglang: a prefill pod's sglang.ai/bootstrap-port annotation overrides
// the pool's bootstrap_port for that pod where its engine cannot be asked
// for its own (here, as behind SGLang's --api-key). Its simulator's
// bootstrap server listens only there, so a handoff that used the pool's
// port would fail.
func TestSGLangBootstrapAnnotation(t *testing.T) {
	c := mustCluster(t)
	ns := c.namespace(t, "sglang")
	cfg := strings.Replace(selectorConfig(ns), "kv-nixl", "kv-sglang", 1)
	s := startStack(t, "", extprocToken, cfg)
	sg := pdsim.ProtocolSGLang
	own := testbed.MustFreePort(t)
	prefill := c.startEngine(t, ns, "prefill-0", pdsim.RolePrefill, sg, map[string]string{roleLabel: "prefill"},
		map[string]string{"sglang.ai/bootstrap-port": fmt.Sprint(own)}, func(sc *testbed.SimConfig) { sc.BootstrapPort, sc.RefuseServerInfo = own, true })
	decode := c.startEngine(t, ns, "decode-0", pdsim.RoleDecode, sg, map[string]string{roleLabel: "decode"}, nil, nil)
	c.setReady(t, prefill, true)
	c.setReady(t, decode, true)
	eventually(t, "readiness", func() bool { code, _ := s.readyz(t); return code == http.StatusOK })
	eventually(t, "the prefill pod to join", func() bool { return len(s.endpoints(t, "prefill")) == 1 })
	if _, source := s.mustPost(t, "annotated"); source != prefill.sim.BootstrapAddr() {
		t.Errorf("decode paired through %q, want the annotated bootstrap server %s", source, prefill.sim.BootstrapAddr())
	}
}

// The last Ready pod of a pool keeps serving while it terminates (deleted
// with a grace period, so it stays with a deletionTimestamp), as kube-proxy
// falls back to terminating endpoints; once another pod is Ready, the
// terminating one leaves.
func TestTerminatingPodServesUntilAnotherIsReady(t *testing.T) {
	c := mustCluster(t)
	ns := c.namespace(t, "terminating")
	var seen atomic.Bool // extproc logged the old pod as terminating
	s := startStackLogging(t, "", extprocToken, selectorConfig(ns), testbed.LineFunc(func(line string) {
		t.Log(line)
		if strings.Contains(line, ns+"/decode-old") && strings.Contains(line, "terminating") {
			seen.Store(true)
		}
	}), "--log-flush-interval=0", "--log-format=console", "-v=1")
	nixl := pdsim.ProtocolNIXL
	prefill := c.startEngine(t, ns, "prefill-0", pdsim.RolePrefill, nixl, map[string]string{roleLabel: "prefill"}, nil, nil)
	old := c.startEngine(t, ns, "decode-old", pdsim.RoleDecode, nixl, map[string]string{roleLabel: "decode"}, nil, nil)
	c.setReady(t, prefill, true)
	c.setReady(t, old, true)
	eventually(t, "readiness", func() bool { code, _ := s.readyz(t); return code == http.StatusOK })

	grace := int64(600)
	if err := c.kube.CoreV1().Pods(ns).Delete(context.Background(), old.name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
		t.Fatal(err)
	}
	if pod, err := c.kube.CoreV1().Pods(ns).Get(context.Background(), old.name, metav1.GetOptions{}); err != nil || pod.DeletionTimestamp == nil {
		t.Fatalf("the deleted pod is not terminating: %v %v", pod, err)
	}
	eventually(t, "extproc to see the pod terminating", seen.Load)
	// /readyz?verbose reads the pool's watch under the lock its update holds:
	// once it answers, the update is published, and the next one's checks see it.
	s.readyz(t)
	if _, text := s.readyz(t); !strings.Contains(text, "[+]decode pool") {
		t.Fatalf("/readyz?verbose with the only decode pod terminating = %q, want the decode pool passing", text)
	}
	if eps := s.endpoints(t, "decode"); !slices.Equal(eps, []string{old.addr()}) {
		t.Fatalf("decode endpoints with the only pod terminating = %v, want it kept: %s", eps, old.addr())
	}
	if decode, _ := s.mustPost(t, "while terminating"); decode != old.addr() {
		t.Fatalf("the request went to %s, want the terminating pod %s", decode, old.addr())
	}

	fresh := c.startEngine(t, ns, "decode-new", pdsim.RoleDecode, nixl, map[string]string{roleLabel: "decode"}, nil, nil)
	c.setReady(t, fresh, true)
	eventually(t, "the terminating pod to give way", func() bool {
		return slices.Equal(s.endpoints(t, "decode"), []string{fresh.addr()})
	})
	before := len(old.sim.Requests())
	if decode, _ := s.mustPost(t, "after the new pod is Ready"); decode != fresh.addr() {
		t.Fatalf("the request went to %s, want the Ready pod %s", decode, fresh.addr())
	}
	if n := len(old.sim.Requests()); n != before {
		t.Fatalf("the terminating pod got %d more requests after another was Ready", n-before)
	}
}
