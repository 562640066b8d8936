package discovery

import (
	"context"
	"slices"
	"sync"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	giev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	gieclient "sigs.k8s.io/gateway-api-inference-extension/client-go/clientset/versioned"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

const inferencePools = "inferencepools"

// informer is one informer, what its list/watch calls met, and whether its
// handler has had the first list.
type informer struct {
	cache.SharedIndexInformer
	src    *source
	synced cache.InformerSynced
}

// newInformer builds the informer over lw and registers h and its watch-error log.
func (w *poolWatch) newInformer(src *source, lw *cache.ListWatch, example runtime.Object, h cache.ResourceEventHandler) (informer, error) {
	inf := informer{SharedIndexInformer: cache.NewSharedIndexInformer(lw, example, 0, cache.Indexers{}), src: src}
	reg, err := inf.AddEventHandler(h)
	if err != nil {
		return inf, err
	}
	inf.synced = reg.HasSynced
	return inf, inf.SetWatchErrorHandlerWithContext(w.watchError(src))
}

// poolWatch keeps one pool's discovered endpoints: an informer on the pods of
// its namespace (filtered by its selector on the server) and, with an
// InferencePool, one on that pool object, whose selector and target ports
// apply live.
type poolWatch struct {
	pool string // the pool's name, for logs and metrics
	spec config.Kubernetes
	sink Sink
	log  logr.Logger

	pods  informer
	ipool *informer // nil without an InferencePool

	mu       sync.Mutex // orders changes; informers call from their own goroutines
	sel      selection
	byPod    map[string][]scheduling.Discovered // the endpoints of each pod not terminating, by namespace/name
	draining map[string][]scheduling.Discovered // those of each terminating pod still Ready (serving)
	why      map[string]string                  // why a pod is not (fully) an endpoint, to log changes once
	ipFound  bool
	ipSynced bool // the InferencePool informer has delivered its first list
	listed   bool // the pods of the first list have been handed over (publishListed)
}

func newPoolWatch(pool string, spec config.Kubernetes, sink Sink, kube kubernetes.Interface, gie gieclient.Interface, log logr.Logger, onError func(string)) (*poolWatch, error) {
	w := &poolWatch{pool: pool, spec: spec, sink: sink, log: log, byPod: map[string][]scheduling.Discovered{},
		draining: map[string][]scheduling.Discovered{}, why: map[string]string{}}
	userSel := spec.ParsedSelector()
	if spec.InferencePool == "" {
		w.sel = selection{selector: userSel, port: *spec.Port}
	}
	src := newSource("pods", spec.Namespace, onError)
	pods := kube.CoreV1().Pods(spec.Namespace)
	withSelector := func(o metav1.ListOptions) metav1.ListOptions {
		o.LabelSelector = userSel.String()
		return o
	}
	var err error
	w.pods, err = w.newInformer(src, src.listWatch(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return pods.List(ctx, withSelector(o))
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return pods.Watch(ctx, withSelector(o))
		},
	), &corev1.Pod{}, cache.ResourceEventHandlerDetailedFuncs{
		AddFunc:    func(obj any, initial bool) { w.podAdded(obj, !initial) },
		UpdateFunc: func(_, obj any) { w.podAdded(obj, true) },
		DeleteFunc: w.podDeleted,
	})
	if err != nil || spec.InferencePool == "" {
		return w, err
	}

	src = newSource(inferencePools, spec.Namespace, onError)
	ips := gie.InferenceV1().InferencePools(spec.Namespace)
	byName := func(o metav1.ListOptions) metav1.ListOptions {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", spec.InferencePool).String()
		return o
	}
	ipool, err := w.newInformer(src, src.listWatch(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return ips.List(ctx, byName(o))
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return ips.Watch(ctx, byName(o))
		},
	), &giev1.InferencePool{}, cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.inferencePoolChanged(obj.(*giev1.InferencePool)) },
		UpdateFunc: func(_, obj any) { w.inferencePoolChanged(obj.(*giev1.InferencePool)) },
		DeleteFunc: func(any) { w.inferencePoolChanged(nil) },
	})
	w.ipool = &ipool
	return w, err
}

// run runs the informers until ctx is done.
func (w *poolWatch) run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() { w.pods.RunWithContext(ctx) })
	wg.Go(func() { w.publishListed(ctx) })
	if w.ipool != nil {
		wg.Go(func() { w.ipool.RunWithContext(ctx) })
		wg.Go(func() { w.reportMissingPool(ctx) })
	}
	wg.Wait()
}

// reportMissingPool says once, when the InferencePool informer has synced,
// that the pool object does not exist (the pool stays empty until it does).
func (w *poolWatch) reportMissingPool(ctx context.Context) {
	if !cache.WaitForCacheSync(ctx.Done(), w.ipool.synced) {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.ipSynced = true
	if !w.ipFound {
		w.log.Info("InferencePool not found: the pool has no endpoints until it exists", "pool", w.pool,
			"namespace", w.spec.Namespace, "inferencePool", w.spec.InferencePool)
	}
}

func (w *poolWatch) watchError(src *source) cache.WatchErrorHandlerWithContext {
	return func(ctx context.Context, _ *cache.Reflector, err error) {
		if ctx.Err() != nil {
			return
		}
		src.streamBroken(err)
		w.log.Info("Kubernetes watch ended; keeping the endpoints known and listing again", "pool", w.pool,
			"resource", src.resource, "namespace", src.namespace, "error", err.Error())
	}
}

// podAdded takes a pod that was added or changed, and publishes the pool's
// new set unless the pod is of the informer's first list: those are
// published once, when the list is whole (publishListed), not one set per
// pod, which for thousands of pods cost a rebuild of the pool each.
func (w *poolWatch) podAdded(obj any, publish bool) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.setPod(pod.Namespace+"/"+pod.Name, pod) && publish {
		w.publish()
	}
}

// publishListed publishes the pool's set once the pod informer's first list
// has been handled.
func (w *poolWatch) publishListed(ctx context.Context) {
	if !cache.WaitForCacheSync(ctx.Done(), w.pods.synced) {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.publish()
	w.listed = true
}

func (w *poolWatch) podDeleted(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.setPod(key, nil) {
		w.publish()
	}
}

// setPod updates one pod's endpoints (nil pod: deleted) and reports whether
// what the pool routes to (serving) changed. Caller holds mu.
func (w *poolWatch) setPod(key string, pod *corev1.Pod) bool {
	var eps []scheduling.Discovered
	why := "deleted"
	if pod != nil {
		eps, why = w.sel.endpoints(pod)
	}
	if why != w.why[key] && pod != nil {
		log := w.log.V(1)
		if why != "" && why == noEngine(pod) { // the network's fault, not a pod's life: said by default
			log = w.log
		}
		log.Info("pod", "pool", w.pool, "pod", key, "endpoints", len(eps), "why", why)
	}
	if pod == nil || why == "" {
		delete(w.why, key)
	} else {
		w.why[key] = why
	}
	old, oldDraining, readyBefore := w.byPod[key], w.draining[key], len(w.byPod) > 0
	delete(w.byPod, key)
	delete(w.draining, key)
	switch {
	case len(eps) == 0:
	case pod.DeletionTimestamp != nil:
		w.draining[key] = eps
	default:
		w.byPod[key] = eps
	}
	switch ready := len(w.byPod) > 0; {
	case readyBefore && ready:
		return !slices.Equal(old, w.byPod[key])
	case !readyBefore && !ready:
		return !slices.Equal(oldDraining, w.draining[key])
	case readyBefore: // the pool's last Ready pod left: its terminating pods serve
		return len(w.draining) != 1 || !slices.Equal(old, w.draining[key])
	default: // the pool's first Ready pod came: its terminating pods stop serving
		return len(w.draining) != 0 || !slices.Equal(oldDraining, w.byPod[key])
	}
}

// serving is what the pool routes to: the endpoints of the pods that are not
// terminating or, when there are none, those of the terminating pods still
// Ready, as kube-proxy falls back to serving terminating endpoints
// (CategorizeEndpoints, kubernetes pkg/proxy/topology.go). Caller holds mu.
func (w *poolWatch) serving() map[string][]scheduling.Discovered {
	if len(w.byPod) == 0 {
		return w.draining
	}
	return w.byPod
}

// inferencePoolChanged applies the InferencePool's selector (ANDed with the
// config's) and target ports to every pod known; nil: the pool is gone.
func (w *poolWatch) inferencePoolChanged(ip *giev1.InferencePool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.sel = selection{}
	w.ipFound = ip != nil
	if ip != nil {
		sel := labels.Set{}
		for k, v := range ip.Spec.Selector.MatchLabels {
			sel[string(k)] = string(v)
		}
		reqs, _ := w.spec.ParsedSelector().Requirements()
		w.sel.selector = labels.SelectorFromSet(sel).Add(reqs...)
		for _, p := range ip.Spec.TargetPorts {
			w.sel.ports = append(w.sel.ports, int(p.Number))
		}
		w.log.Info("InferencePool", "pool", w.pool, "namespace", ip.Namespace, "inferencePool", ip.Name,
			"selector", w.sel.selector.String(), "targetPorts", w.sel.ports)
	} else if w.ipSynced {
		w.log.Info("InferencePool deleted: the pool has no endpoints until it is back", "pool", w.pool,
			"namespace", w.spec.Namespace, "inferencePool", w.spec.InferencePool)
	}
	changed := false
	seen := map[string]bool{}
	for _, obj := range w.pods.GetStore().List() {
		pod := obj.(*corev1.Pod)
		key := pod.Namespace + "/" + pod.Name
		seen[key] = true
		changed = w.setPod(key, pod) || changed
	}
	for _, known := range []map[string][]scheduling.Discovered{w.byPod, w.draining} {
		for key := range known {
			if !seen[key] {
				changed = w.setPod(key, nil) || changed
			}
		}
	}
	if changed {
		w.publish()
	}
}

// publish hands the pool's whole set to the sink. Caller holds mu, so sets
// arrive in order.
func (w *poolWatch) publish() {
	var all []scheduling.Discovered
	for _, eps := range w.serving() {
		all = append(all, eps...)
	}
	w.sink.SetDiscovered(all)
}

// status reads the watch now.
func (w *poolWatch) status() PoolStatus {
	st := PoolStatus{Pool: w.pool, Namespace: w.spec.Namespace, InferencePool: w.spec.InferencePool, Reachable: true}
	infs := []informer{w.pods}
	if w.ipool != nil {
		infs = append(infs, *w.ipool)
	}
	st.Synced, st.Served = true, true
	for _, inf := range infs {
		st.Synced = st.Synced && inf.synced()
		st.Served = st.Served && inf.src.served()
		refused, reachable, lastErr, at := inf.src.state()
		if refused != nil && st.Refused == nil {
			st.Refused = refused
		}
		st.Reachable = st.Reachable && reachable
		if lastErr != nil && at.After(st.LastErrorAt) {
			st.LastError, st.LastErrorAt = lastErr, at
		}
	}
	w.mu.Lock()
	addrs := map[string]bool{} // two pods listed at one are one endpoint (scheduling.Pool.SetDiscovered)
	for _, eps := range w.serving() {
		for _, e := range eps {
			addrs[e.Addr] = true
		}
	}
	st.Endpoints = len(addrs)
	st.PoolFound = w.ipFound || w.ipool == nil
	st.Synced = st.Synced && w.listed // synced means handed to the pool
	w.mu.Unlock()
	return st
}
