package discovery

import (
	"slices"
	"testing"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// A pod that ended, its engine's requests failing until passive health
// ejected it, and a new pod the network gave its IP: the new pod's engine
// takes requests at once, with nothing of the old one's state, whether the
// informer tells of the old pod's deletion first or (after a relist, a
// StatefulSet pod recreated under its name) only of the pod now under the
// name.
func TestAPodOnAReusedIPStartsAnew(t *testing.T) {
	pod := func(name, uid string) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "llm", Name: name, UID: types.UID(uid), Labels: map[string]string{"app": "vllm"}},
			Status: corev1.PodStatus{PodIP: "10.1.2.3", Conditions: []corev1.PodCondition{
				{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
		}
	}
	tests := []struct {
		name    string
		deleted bool // the old pod's deletion is told before the new pod
		newName string
	}{
		{"deleted, then another pod", true, "vllm-b"},
		{"deleted, then a pod under its name", true, "vllm-0"},
		{"a pod under its name, the deletion unseen", false, "vllm-0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pools := scheduling.NewPools(scheduling.Spec{}, scheduling.Deps{})
			w := testWatch(pools.Decode, nil)
			old := pod("vllm-0", "uid-old")
			w.podAdded(old, true)
			e := pools.Decode.Endpoints()[0]
			for range config.DefaultConsecutiveFailures {
				e.ReportFailure()
			}
			if e.Healthy() {
				t.Fatal("not ejected: the test shows nothing")
			}
			if tt.deleted {
				w.podDeleted(old)
			}
			w.podAdded(pod(tt.newName, "uid-new"), true)
			got, err := pools.Decode.Select(nil)
			if err != nil {
				t.Fatal(err)
			}
			if got == e || !got.Healthy() || got.Ejections() != 0 {
				t.Errorf("picked the old pod's endpoint: %v, healthy %v, %d ejections; want the new pod's, healthy, never ejected",
					got == e, got.Healthy(), got.Ejections())
			}
		})
	}
}

// pd_extproc_discovery_endpoints counts the endpoints discovery gives the
// pool as the pool routes to them: two pods listed at one address (one that
// ended, its status not yet updated, and the one the network gave its IP)
// are one endpoint.
func TestDiscoveryEndpointsCountsAddresses(t *testing.T) {
	pod := func(name, ip string) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "llm", Name: name, UID: types.UID("uid-" + name), Labels: map[string]string{"app": "vllm"}},
			Status: corev1.PodStatus{PodIP: ip, Conditions: []corev1.PodCondition{
				{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
		}
	}
	tests := []struct {
		name  string
		pods  []*corev1.Pod
		ports []int // an InferencePool's target ports; nil: 8000
		want  float64
	}{
		{"two pods", []*corev1.Pod{pod("vllm-a", "10.1.2.3"), pod("vllm-b", "10.1.2.4")}, nil, 2},
		{"two pods at one address", []*corev1.Pod{pod("vllm-a", "10.1.2.3"), pod("vllm-b", "10.1.2.3")}, nil, 1},
		{"two pods at one address, two ports each", []*corev1.Pod{pod("vllm-a", "10.1.2.3"), pod("vllm-b", "10.1.2.3")}, []int{8000, 8001}, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pools := scheduling.NewPools(scheduling.Spec{}, scheduling.Deps{})
			w := testWatch(pools.Decode, tt.ports)
			for _, p := range tt.pods {
				w.podAdded(p, true)
			}
			m := metrics.New("kv-nixl")
			m.WatchDiscovery([]string{w.pool}, func() []metrics.DiscoveryState {
				st := w.status()
				return []metrics.DiscoveryState{{Pool: st.Pool, Endpoints: st.Endpoints}}
			})
			got := discoveryEndpoints(t, m)
			if got != tt.want || len(pools.Decode.Endpoints()) != int(tt.want) {
				t.Errorf("pd_extproc_discovery_endpoints = %v, the pool has %d endpoints; want %v", got, len(pools.Decode.Endpoints()), tt.want)
			}
		})
	}
}

// discoveryEndpoints is the value of m's pd_extproc_discovery_endpoints, of its one pool.
func discoveryEndpoints(t *testing.T, m *metrics.Metrics) float64 {
	t.Helper()
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "pd_extproc_discovery_endpoints" {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no pd_extproc_discovery_endpoints")
	return 0
}

// A pod whose IP names no engine (0.0.0.0, ::, a multicast address) is not
// an endpoint, and is named in one log line at the default verbosity each
// time that changes, not at each update of the pod.
func TestAPodWhoseIPNamesNoEngineIsSkippedAndLoggedOnce(t *testing.T) {
	var logged []string
	pools := scheduling.NewPools(scheduling.Spec{}, scheduling.Deps{})
	w := testWatch(pools.Decode, nil)
	w.log = funcr.New(func(_, args string) { logged = append(logged, args) }, funcr.Options{})
	pod := func(ip, version string) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "llm", Name: "vllm-0", ResourceVersion: version, Labels: map[string]string{"app": "vllm"}},
			Status:     corev1.PodStatus{PodIP: ip, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
		}
	}
	w.podAdded(pod("0.0.0.0", "1"), true)
	w.podAdded(pod("0.0.0.0", "2"), true) // a status heartbeat
	if eps := pools.Decode.Endpoints(); len(eps) != 0 {
		t.Errorf("endpoints %v, want none", eps)
	}
	want := `"level"=0 "msg"="pod" "pool"="decode" "pod"="llm/vllm-0" "endpoints"=0 "why"="pod IP 0.0.0.0 is the unspecified address, a listener's wildcard: it names no engine"`
	if len(logged) != 1 || logged[0] != want {
		t.Errorf("logged %q, want one line %s", logged, want)
	}
	w.podAdded(pod("10.1.2.3", "3"), true)
	if eps := pools.Decode.Endpoints(); len(eps) != 1 || eps[0].Addr != "10.1.2.3:8000" {
		t.Errorf("endpoints %v once the pod has an IP of its own, want 10.1.2.3:8000", eps)
	}
	if len(logged) != 1 {
		t.Errorf("logged %q at the default verbosity, want only the line above: a pod that becomes an endpoint is said at -v 1", logged[1:])
	}
}

// testWatch is a poolWatch of the pods labelled app=vllm, on port 8000 or
// on ports (an InferencePool's), whose informers never run: tests call
// podAdded and podDeleted as they would.
// countingSink counts the sets handed to its Sink.
type countingSink struct {
	Sink
	sets int
}

func (c *countingSink) SetDiscovered(eps []scheduling.Discovered) {
	c.sets++
	c.Sink.SetDiscovered(eps)
}

func testWatch(sink Sink, ports []int) *poolWatch {
	return &poolWatch{pool: "decode", sink: sink, log: logr.Discard(),
		pods:  informer{src: newSource("pods", "llm", nil), synced: func() bool { return true }},
		sel:   selection{selector: labels.SelectorFromSet(labels.Set{"app": "vllm"}), port: config.PodPort{Number: 8000}, ports: ports},
		byPod: map[string][]scheduling.Discovered{}, draining: map[string][]scheduling.Discovered{}, why: map[string]string{}}
}

// A terminating pod (deletionTimestamp set) that is still Ready serves only
// while its pool has no Ready pod that is not terminating, as kube-proxy
// falls back to serving-terminating endpoints: a one-replica rollout or a
// Recreate gets no 503 while a pod still serves. A pod that is not Ready
// never serves. Each row is a sequence of pod changes and the pool's
// endpoints (and pd_extproc_discovery_endpoints) after each. A change that
// leaves the endpoints as they were hands the pool no set: each set rebuilds
// it under its lock.
func TestTerminatingPodsServeOnlyWhenNoOtherPodIsReady(t *testing.T) {
	type state string
	const (
		ready               state = "Ready"
		notReady            state = "not Ready"
		terminating         state = "terminating, Ready"
		terminatingNotReady state = "terminating, not Ready" // its readiness probe failing
		deleted             state = "deleted"
	)
	ips := map[string]string{"old": "10.1.2.3", "new": "10.1.2.4", "other": "10.1.2.5"}
	type step struct {
		pod  string
		to   state
		want []string // the pool's endpoint addresses
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"one replica, rolling update", []step{
			{"old", ready, []string{"10.1.2.3:8000"}},
			{"new", notReady, []string{"10.1.2.3:8000"}},
			{"old", terminating, []string{"10.1.2.3:8000"}},
			{"new", ready, []string{"10.1.2.4:8000"}},
			{"old", terminatingNotReady, []string{"10.1.2.4:8000"}},
			{"old", deleted, []string{"10.1.2.4:8000"}},
		}},
		{"recreate: the old pod serves until its probe fails", []step{
			{"old", ready, []string{"10.1.2.3:8000"}},
			{"old", terminating, []string{"10.1.2.3:8000"}},
			{"old", terminatingNotReady, nil},
			{"new", ready, []string{"10.1.2.4:8000"}},
		}},
		{"a terminating pod leaves at once while another is Ready", []step{
			{"old", ready, []string{"10.1.2.3:8000"}},
			{"other", ready, []string{"10.1.2.3:8000", "10.1.2.5:8000"}},
			{"old", terminating, []string{"10.1.2.5:8000"}},
			{"other", notReady, []string{"10.1.2.3:8000"}},
			{"other", ready, []string{"10.1.2.5:8000"}},
			{"other", deleted, []string{"10.1.2.3:8000"}},
		}},
		{"a terminating pod is deleted while another is Ready", []step{
			{"old", ready, []string{"10.1.2.3:8000"}},
			{"other", ready, []string{"10.1.2.3:8000", "10.1.2.5:8000"}},
			{"old", terminating, []string{"10.1.2.5:8000"}},
			{"old", deleted, []string{"10.1.2.5:8000"}},
		}},
		{"every pod terminating: those still Ready serve", []step{
			{"old", ready, []string{"10.1.2.3:8000"}},
			{"other", ready, []string{"10.1.2.3:8000", "10.1.2.5:8000"}},
			{"old", terminating, []string{"10.1.2.5:8000"}},
			{"other", terminating, []string{"10.1.2.3:8000", "10.1.2.5:8000"}},
			{"other", terminatingNotReady, []string{"10.1.2.3:8000"}},
			{"new", notReady, []string{"10.1.2.3:8000"}},
			{"old", deleted, nil},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pools := scheduling.NewPools(scheduling.Spec{}, scheduling.Deps{})
			sink := &countingSink{Sink: pools.Decode}
			w := testWatch(sink, nil)
			var before []string
			for i, s := range tt.steps {
				pod := &corev1.Pod{
					ObjectMeta: metav1.ObjectMeta{Namespace: "llm", Name: s.pod, UID: types.UID("uid-" + s.pod), Labels: map[string]string{"app": "vllm"}},
					Status: corev1.PodStatus{PodIP: ips[s.pod], Conditions: []corev1.PodCondition{
						{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
				}
				if s.to == terminating || s.to == terminatingNotReady {
					pod.DeletionTimestamp = &metav1.Time{}
				}
				if s.to == notReady || s.to == terminatingNotReady {
					pod.Status.Conditions[0].Status = corev1.ConditionFalse
				}
				if s.to == deleted {
					w.podDeleted(pod)
				} else {
					w.podAdded(pod, true)
				}
				var got []string
				for _, e := range pools.Decode.Endpoints() {
					got = append(got, e.Addr)
				}
				slices.Sort(got)
				if !slices.Equal(got, s.want) || w.status().Endpoints != len(s.want) {
					t.Errorf("step %d (%s %s): endpoints %v, pd_extproc_discovery_endpoints %d; want %v",
						i, s.pod, s.to, got, w.status().Endpoints, s.want)
				}
				if want := !slices.Equal(before, s.want); sink.sets > 0 != want {
					t.Errorf("step %d (%s %s): %d sets handed to the pool, want a set: %v", i, s.pod, s.to, sink.sets, want)
				}
				before, sink.sets = s.want, 0
			}
		})
	}
}
