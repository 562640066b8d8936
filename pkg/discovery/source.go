package discovery

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// Why a list or watch failed: the reason label of
// pd_extproc_discovery_errors_total, which metrics names.
const (
	ReasonUnreachable = metrics.DiscoveryUnreachable // the API server did not answer (or broke off): the last endpoints stay
	ReasonDenied      = metrics.DiscoveryDenied      // Forbidden or Unauthorized: RBAC or credentials
	ReasonMissing     = metrics.DiscoveryMissing     // the resource is not served: the InferencePool CRD is not installed
)

// source is one informer's list/watch as the API server answers it: whether
// the server is reachable, the last error, and any refusal that keeps the
// informer's data from being trusted (a Role without watch still lists, so
// the informer syncs, but never hears of a change).
type source struct {
	resource  string // "pods", "inferencepools"
	namespace string
	onError   func(reason string)

	mu        sync.Mutex
	streams   int       // watch streams open, each counted until it ends
	watched   bool      // a watch was opened: the informer heard of changes once
	lastOK    time.Time // the last successful list or watch
	reachable bool
	lastErr   error
	lastErrAt time.Time
	refused   map[string]error // by verb (list, watch): denied or missing, cleared by that verb's success
}

func newSource(resource, namespace string, onError func(string)) *source {
	return &source{resource: resource, namespace: namespace, onError: onError, refused: map[string]error{}}
}

// listWatch wraps list and watch calls so that each answer is observed.
func (s *source) listWatch(
	list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error),
) *cache.ListWatch {
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			obj, err := list(ctx, o)
			s.observe(ctx, "list", err)
			return obj, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			w, err := watchFn(ctx, o)
			s.observe(ctx, "watch", err)
			if err != nil {
				return nil, err
			}
			return s.observeStream(w), nil
		},
	}
}

// observe records the outcome of one call. A cancelled context (shutdown) is
// no news about the server.
func (s *source) observe(ctx context.Context, verb string, err error) {
	if err != nil && ctx.Err() != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil {
		s.reachable, s.lastOK = true, time.Now()
		delete(s.refused, verb)
		if verb == "watch" {
			s.streams++
			s.watched = true
		}
		return
	}
	reason, explained := s.explain(verb, err)
	s.lastErr, s.lastErrAt = explained, time.Now()
	if reason == ReasonUnreachable {
		s.reachable = false
	} else {
		s.reachable = true
		s.refused[verb] = explained
	}
	if s.onError != nil {
		s.onError(reason)
	}
}

// streamBroken records a watch that ended with an error after it started:
// the server went away or dropped it, and the informer lists again on its
// own. An expired resource version is the protocol at work, not news.
func (s *source) streamBroken(err error) {
	if apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
		return
	}
	s.mu.Lock()
	s.reachable = false
	s.lastErr, s.lastErrAt = fmt.Errorf("watching %s: %w", s.resource, err), time.Now()
	s.mu.Unlock()
	if s.onError != nil {
		s.onError(ReasonUnreachable)
	}
}

// explain classifies err and words it for an operator: what is missing, and
// what to grant or install.
func (s *source) explain(verb string, err error) (string, error) {
	switch {
	case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
		return ReasonDenied, fmt.Errorf("may not %s %s in namespace %q: grant the verbs list and watch on %s "+
			"to pd-extproc's service account (the chart's Role and RoleBinding: rbac.create, rbac.extraNamespaces for another namespace): %w",
			verb, s.resource, s.namespace, s.resource, err)
	case apierrors.IsNotFound(err) && s.resource == inferencePools:
		return ReasonMissing, fmt.Errorf("the API server does not serve %s (inference.networking.k8s.io/v1): "+
			"install the InferencePool CRD of sigs.k8s.io/gateway-api-inference-extension (see the README, Kubernetes): %w", s.resource, err)
	}
	return ReasonUnreachable, fmt.Errorf("%s %s: %w", verb, s.resource, err)
}

// state reads the source now: the first refusal (nil when none), whether
// the server answered last time, and the last error of any kind.
func (s *source) state() (refused error, reachable bool, lastErr error, lastErrAt time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, verb := range []string{"list", "watch"} {
		if err := s.refused[verb]; err != nil {
			refused = errors.Join(refused, err)
		}
	}
	return refused, s.reachable, s.lastErr, s.lastErrAt
}

// served reports whether a watch was ever opened, so that what the informer
// holds was once followed: a refusal since (a Role removed, credentials
// that stopped working) leaves it stale, not wrong.
func (s *source) served() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.watched
}
