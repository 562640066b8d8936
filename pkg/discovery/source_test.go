package discovery

import (
	"context"
	"errors"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
)

func TestSourceExplainsRefusals(t *testing.T) {
	pods := schema.GroupResource{Resource: "pods"}
	ipools := schema.GroupResource{Group: "inference.networking.k8s.io", Resource: inferencePools}
	tests := []struct {
		name, resource, verb string
		err                  error
		wantReason           string
		wantRefused          bool
		want                 []string
	}{
		{"watch forbidden", "pods", "watch", apierrors.NewForbidden(pods, "", errors.New("RBAC: no")),
			ReasonDenied, true, []string{`may not watch pods in namespace "llm"`, "grant the verbs list and watch on pods"}},
		{"unauthorized", "pods", "list", apierrors.NewUnauthorized("bad token"),
			ReasonDenied, true, []string{`may not list pods`}},
		{"CRD not installed", inferencePools, "list", apierrors.NewNotFound(ipools, ""),
			ReasonMissing, true, []string{"does not serve inferencepools", "install the InferencePool CRD"}},
		{"server gone", "pods", "watch", errors.New("dial tcp 127.0.0.1:6443: connect: connection refused"),
			ReasonUnreachable, false, []string{"watch pods", "connection refused"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var reasons []string
			s := newSource(tc.resource, "llm", func(r string) { reasons = append(reasons, r) })
			s.observe(context.Background(), tc.verb, tc.err)
			refused, reachable, lastErr, _ := s.state()
			if len(reasons) != 1 || reasons[0] != tc.wantReason {
				t.Errorf("counted %v, want [%s]", reasons, tc.wantReason)
			}
			if (refused != nil) != tc.wantRefused || reachable != tc.wantRefused {
				t.Errorf("refused %v, reachable %v", refused, reachable)
			}
			for _, w := range tc.want {
				if !strings.Contains(lastErr.Error(), w) {
					t.Errorf("error %q lacks %q", lastErr, w)
				}
			}
			// The same call succeeding clears the refusal.
			s.observe(context.Background(), tc.verb, nil)
			if refused, reachable, _, _ := s.state(); refused != nil || !reachable {
				t.Errorf("after a success: refused %v, reachable %v", refused, reachable)
			}
		})
	}
}

// A refused watch is not cleared by a list that succeeds: a Role without
// watch lists fine and must stay refused.
func TestSourceRefusedWatchOutlivesList(t *testing.T) {
	s := newSource("pods", "llm", nil)
	s.observe(context.Background(), "watch", apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "", errors.New("no")))
	s.observe(context.Background(), "list", nil)
	if refused, _, _, _ := s.state(); refused == nil {
		t.Error("a successful list cleared the refused watch")
	}
}

// TestStoppedStreamsAreCountedGone: a watch stream the informer stops (as
// after an expired watch) counts as gone like one that ended on its own, so
// that when the last one ends on its own the loss can be noticed; before,
// one stopped stream kept the count above zero for good.
func TestStoppedStreamsAreCountedGone(t *testing.T) {
	s := newSource("pods", "llm", nil)
	open := func() (*watch.FakeWatcher, watch.Interface) {
		s.observe(context.Background(), "watch", nil)
		inner := watch.NewFake()
		return inner, s.observeStream(inner)
	}
	ended := func(w watch.Interface) {
		for range w.ResultChan() { // closed once the stream is counted gone
		}
	}
	_, stopped := open()
	inner, dropped := open()
	stopped.Stop()
	ended(stopped)
	inner.Stop() // the server ends it
	ended(dropped)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.streams != 0 {
		t.Fatalf("%d watch streams counted open after both ended", s.streams)
	}
}

// TestARefusalAfterTheWatchKeepsThePool: a pool whose list and watch worked
// before the API server began refusing (a Role removed, credentials that
// stop working) stays routable on its last endpoints, as when the server
// is lost; one refused from the start (a Role without watch lists and
// syncs, but never hears of a change) does not.
func TestARefusalAfterTheWatchKeepsThePool(t *testing.T) {
	forbidden := apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "", errors.New("RBAC: no"))
	for _, tt := range []struct {
		name  string
		calls []error // list, then watch, ...
		want  bool
	}{
		{"listed and watched", []error{nil, nil}, true},
		{"refused after the watch", []error{nil, nil, forbidden, forbidden}, true},
		{"the watch refused from the start", []error{nil, forbidden}, false},
		{"the list refused from the start", []error{forbidden}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := newSource("pods", "llm", nil)
			for i, err := range tt.calls {
				s.observe(context.Background(), []string{"list", "watch"}[i%2], err)
			}
			refused, _, _, _ := s.state()
			st := PoolStatus{Synced: true, Refused: refused, Served: s.served()}
			if st.Ready() != tt.want {
				t.Errorf("Ready() = %v (refused %v, served %v), want %v", st.Ready(), refused, st.Served, tt.want)
			}
		})
	}
}
