package discovery

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/rest"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

func TestPodEndpoints(t *testing.T) {
	restartAlways := corev1.ContainerRestartPolicyAlways
	ready := func(mut ...func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "p", Labels: map[string]string{"app": "vllm", "role": "decode"}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{
				{Name: "sidecar", Ports: []corev1.ContainerPort{{Name: "metrics", ContainerPort: 9090}}},
				{Name: "engine", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8000}}},
			}},
			Status: corev1.PodStatus{PodIP: "10.1.2.3", Conditions: []corev1.PodCondition{
				{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
				{Type: corev1.PodReady, Status: corev1.ConditionTrue},
			}},
		}
		for _, m := range mut {
			m(p)
		}
		return p
	}
	byLabels := labels.SelectorFromSet(labels.Set{"app": "vllm"})
	port8000 := selection{selector: byLabels, port: config.PodPort{Number: 8000}}
	ep := func(addr string, bootstrap int) scheduling.Discovered {
		return scheduling.Discovered{Addr: addr, BootstrapPort: bootstrap}
	}
	tests := []struct {
		name    string
		sel     selection
		pod     *corev1.Pod
		want    []scheduling.Discovered
		wantWhy string
	}{
		{"ready", port8000, ready(), []scheduling.Discovered{ep("10.1.2.3:8000", 0)}, ""},
		{"named port", selection{selector: byLabels, port: config.PodPort{Name: "http"}}, ready(),
			[]scheduling.Discovered{ep("10.1.2.3:8000", 0)}, ""},
		{"no such named port", selection{selector: byLabels, port: config.PodPort{Name: "grpc"}}, ready(), nil, `no container port named "grpc"`},
		{"named port on a native sidecar", selection{selector: byLabels, port: config.PodPort{Name: "proxy"}}, ready(func(p *corev1.Pod) {
			p.Spec.InitContainers = []corev1.Container{{Name: "routing-proxy", RestartPolicy: &restartAlways,
				Ports: []corev1.ContainerPort{{Name: "proxy", ContainerPort: 8200}}}}
		}), []scheduling.Discovered{ep("10.1.2.3:8200", 0)}, ""},
		{"named port on an init container that ends", selection{selector: byLabels, port: config.PodPort{Name: "proxy"}}, ready(func(p *corev1.Pod) {
			p.Spec.InitContainers = []corev1.Container{{Name: "setup", Ports: []corev1.ContainerPort{{Name: "proxy", ContainerPort: 8200}}}}
		}), nil, `no container port named "proxy"`},
		{"not selected", selection{selector: labels.SelectorFromSet(labels.Set{"app": "sglang"}), port: config.PodPort{Number: 8000}}, ready(), nil, "not selected"},
		{"no selection yet (InferencePool not found)", selection{}, ready(), nil, "not selected"},
		{"not ready", port8000, ready(func(p *corev1.Pod) { p.Status.Conditions[1].Status = corev1.ConditionFalse }), nil, "not Ready"},
		{"no Ready condition", port8000, ready(func(p *corev1.Pod) { p.Status.Conditions = p.Status.Conditions[:1] }), nil, "not Ready"},
		{"no IP", port8000, ready(func(p *corev1.Pod) { p.Status.PodIP = "" }), nil, "no pod IP"},
		{"IP 0.0.0.0", port8000, ready(func(p *corev1.Pod) { p.Status.PodIP = "0.0.0.0" }), nil,
			"pod IP 0.0.0.0 is the unspecified address, a listener's wildcard: it names no engine"},
		{"IP ::", port8000, ready(func(p *corev1.Pod) { p.Status.PodIP = "::" }), nil,
			"pod IP :: is the unspecified address, a listener's wildcard: it names no engine"},
		{"multicast IP", port8000, ready(func(p *corev1.Pod) { p.Status.PodIP = "ff02::1" }), nil,
			"pod IP ff02::1 is a multicast address: TCP connects to one host"},
		// A terminating pod's endpoints serve only while its pool has no
		// other (poolWatch.serving); one not Ready has none.
		{"terminating", port8000, ready(func(p *corev1.Pod) { p.DeletionTimestamp = &metav1.Time{} }),
			[]scheduling.Discovered{ep("10.1.2.3:8000", 0)}, "terminating"},
		{"terminating, not ready", port8000, ready(func(p *corev1.Pod) {
			p.DeletionTimestamp = &metav1.Time{}
			p.Status.Conditions[1].Status = corev1.ConditionFalse
		}), nil, "not Ready"},
		{"terminating, bad bootstrap port annotation", port8000, ready(func(p *corev1.Pod) {
			p.DeletionTimestamp = &metav1.Time{}
			p.Annotations = map[string]string{BootstrapPortAnnotation: "x"}
		}), []scheduling.Discovered{ep("10.1.2.3:8000", 0)},
			`terminating; annotation sglang.ai/bootstrap-port: "x" is not a port; the pool's bootstrap port applies`},
		// A pod that has run to its end keeps its IP and may keep a Ready
		// condition no kubelet updates any more (its node gone, the pod
		// GC marking it Failed); the network may have given the IP to
		// another pod. Kubernetes leaves it out of a Service's endpoints
		// whatever its conditions say.
		{"failed, Ready left True", port8000, ready(func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }), nil, "Failed"},
		{"succeeded, Ready left True", port8000, ready(func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }), nil, "Succeeded"},
		{"running", port8000, ready(func(p *corev1.Pod) { p.Status.Phase = corev1.PodRunning }), []scheduling.Discovered{ep("10.1.2.3:8000", 0)}, ""},
		{"IPv6", port8000, ready(func(p *corev1.Pod) { p.Status.PodIP = "fd00::3" }), []scheduling.Discovered{ep("[fd00::3]:8000", 0)}, ""},
		{"InferencePool target ports", selection{selector: byLabels, ports: []int{8000, 8001}}, ready(),
			[]scheduling.Discovered{ep("10.1.2.3:8000", 0), ep("10.1.2.3:8001", 0)}, ""},
		{"bootstrap port annotation", port8000, ready(func(p *corev1.Pod) { p.Annotations = map[string]string{BootstrapPortAnnotation: "9001"} }),
			[]scheduling.Discovered{ep("10.1.2.3:8000", 9001)}, ""},
		{"bad bootstrap port annotation", port8000, ready(func(p *corev1.Pod) { p.Annotations = map[string]string{BootstrapPortAnnotation: "90010"} }),
			[]scheduling.Discovered{ep("10.1.2.3:8000", 0)}, `annotation sglang.ai/bootstrap-port: "90010" is not a port; the pool's bootstrap port applies`},
		{"a bootstrap port per target port", selection{selector: byLabels, ports: []int{8000, 8001}},
			ready(func(p *corev1.Pod) { p.Annotations = map[string]string{BootstrapPortAnnotation: "9001, 9002"} }),
			[]scheduling.Discovered{ep("10.1.2.3:8000", 9001), ep("10.1.2.3:8001", 9002)}, ""},
		{"one bootstrap port for two target ports", selection{selector: byLabels, ports: []int{8000, 8001}},
			ready(func(p *corev1.Pod) { p.Annotations = map[string]string{BootstrapPortAnnotation: "9001"} }),
			[]scheduling.Discovered{ep("10.1.2.3:8000", 9001), ep("10.1.2.3:8001", 9001)},
			`annotation sglang.ai/bootstrap-port: one port, 9001, for 2 target ports: each SGLang server needs its own; list one per target port`},
		{"bootstrap ports that do not match the target ports", selection{selector: byLabels, ports: []int{8000, 8001, 8002}},
			ready(func(p *corev1.Pod) { p.Annotations = map[string]string{BootstrapPortAnnotation: "9001,9002"} }),
			[]scheduling.Discovered{ep("10.1.2.3:8000", 0), ep("10.1.2.3:8001", 0), ep("10.1.2.3:8002", 0)},
			`annotation sglang.ai/bootstrap-port: "9001,9002" names 2 ports for 3 target ports; the pool's bootstrap port applies`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, why := tc.sel.endpoints(tc.pod)
			if !slices.Equal(got, tc.want) || why != tc.wantWhy {
				t.Errorf("endpoints = %v (%q), want %v (%q)", got, why, tc.want, tc.wantWhy)
			}
		})
	}
}

func TestNamespaceDefaultsToThePods(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "namespace")
	old := serviceAccountNamespace
	t.Cleanup(func() { serviceAccountNamespace = old })
	opts := Options{REST: &rest.Config{Host: "https://127.0.0.1:1"}} // New talks to no server
	pools := map[string]*config.Kubernetes{"decode": {Selector: "app=vllm", Port: &config.PodPort{Number: 8000}}}
	sinks := map[string]Sink{"decode": sinkFunc(func([]scheduling.Discovered) {})}

	serviceAccountNamespace = file
	if _, err := New(pools, sinks, opts); err == nil || !strings.Contains(err.Error(), "pools.decode.kubernetes.namespace: not set, and not running in a pod") {
		t.Errorf("New outside a pod = %v, want an error naming the key", err)
	}
	if err := os.WriteFile(file, []byte("llm\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d, err := New(pools, sinks, opts)
	if err != nil {
		t.Fatal(err)
	}
	if st := d.Status(); len(st) != 1 || st[0].Namespace != "llm" || st[0].Ready() {
		t.Errorf("status %+v, want the pod's namespace and not ready before any list", st)
	}
	if d, err := New(map[string]*config.Kubernetes{"decode": nil}, sinks, opts); d != nil || err != nil {
		t.Errorf("New with no kubernetes pool = %v, %v; want nil, nil", d, err)
	}
}

type sinkFunc func([]scheduling.Discovered)

func (f sinkFunc) SetDiscovered(eps []scheduling.Discovered) { f(eps) }
