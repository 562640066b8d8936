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
			ReasonDenied, true, []string{`may not watch pods in namespace "llm"`, "grant the verbs get, list and watch on pods"}},
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
