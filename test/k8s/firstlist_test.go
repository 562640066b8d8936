package k8s

import (
	"context"
	"fmt"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/discovery"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// countingSink counts the sets discovery hands over and keeps the last.
type countingSink struct {
	mu   sync.Mutex
	sets int
	last []scheduling.Discovered
}

func (s *countingSink) SetDiscovered(eps []scheduling.Discovered) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sets++
	s.last = eps
}

func (s *countingSink) read() (int, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sets, len(s.last)
}

// The pods a pool has when discovery starts come in one set, not one set per
// pod: each set rebuilds the pool, and a first list of thousands of pods
// cost thousands of rebuilds under the pool's lock. The pool is synced once
// that set is handed over. Pods that change later are handed over as they
// change.
func TestTheFirstListIsOneSet(t *testing.T) {
	c := mustCluster(t)
	ns := c.namespace(t, "firstlist")
	const pods = 60
	now := metav1.Now()
	for i := range pods {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprint("engine-", i), Labels: map[string]string{roleLabel: "decode"}}, Spec: podSpec()}
		created, err := c.kube.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		created.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: fmt.Sprintf("10.200.%d.%d", i/200, i%200+1), StartTime: &now,
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now}}}
		if _, err := c.kube.CoreV1().Pods(ns).UpdateStatus(context.Background(), created, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	sink := &countingSink{}
	spec := &config.Kubernetes{Namespace: ns, Selector: roleLabel + "=decode", Port: &config.PodPort{Number: enginePort}}
	d, err := discovery.New(map[string]*config.Kubernetes{"decode": spec}, map[string]discovery.Sink{"decode": sink}, discovery.Options{REST: c.rest})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go d.Run(ctx)
	// Synced means handed to the pool: readiness waits for it.
	eventually(t, "the pool synced", func() bool { return d.Status()[0].Synced })
	if sets, n := sink.read(); sets != 1 || n != pods {
		t.Errorf("once synced, the pool had %d sets, the last of %d pods; want 1 set of %d", sets, n, pods)
	}
	if err := c.kube.CoreV1().Pods(ns).Delete(context.Background(), "engine-0", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a deletion after the first list", func() bool { _, n := sink.read(); return n == pods-1 })
	if sets, _ := sink.read(); sets != 2 {
		t.Errorf("%d sets after one deletion, want 2", sets)
	}
}
