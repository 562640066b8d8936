// Package discovery finds pool endpoints in the Kubernetes API: for each pool
// with a pools.<pool>.kubernetes key, client-go informers watch the pods of a
// namespace (by label selector, or by an InferencePool's selector and target
// ports, read through the Gateway API Inference Extension's own Go types) and
// hand the pool its Ready pods' addresses whenever they change
// (scheduling.Pool.SetDiscovered). client-go stays in this package:
// pkg/scheduling only sees addresses.
//
// Until every informer has delivered its first list, Ready is false, and so
// is extproc's readiness. Once synced, losing the API server keeps the last
// endpoints (the informers list again when it returns, and the pools converge
// to what it then says); a refusal (Forbidden, a CRD not installed) makes
// Ready false with an error that names what is missing.
package discovery

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	gieclient "sigs.k8s.io/gateway-api-inference-extension/client-go/clientset/versioned"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// Sink takes a pool's whole discovered set after each change;
// *scheduling.Pool is one.
type Sink interface {
	SetDiscovered([]scheduling.Discovered)
}

// Options are discovery's run-time settings.
type Options struct {
	// Kubeconfig is the --kubeconfig file. Empty: in-cluster credentials
	// when running in a pod, else KUBECONFIG or ~/.kube/config.
	Kubeconfig string
	// REST, when set, is used as it is instead of Kubeconfig (tests).
	REST *rest.Config
	// OnError is called with the reason of each failed list or watch
	// (ReasonUnreachable, ReasonDenied, ReasonMissing) and the pool's name.
	OnError func(pool, reason string)
	Log     logr.Logger
}

// PoolStatus is one pool's discovery as it stands.
type PoolStatus struct {
	Pool, Namespace, InferencePool string
	// Synced: every informer of the pool has delivered its first list to the pool.
	Synced bool
	// Refused is why the API server refuses what discovery needs (RBAC, a
	// missing CRD); nil when nothing is refused.
	Refused error
	// Served: every informer of the pool had a list and a watch before
	// anything was refused, so its endpoints were followed once and are
	// routed on, stale, as when the API server is lost.
	Served bool
	// Reachable: the API server answered the last call.
	Reachable   bool
	LastError   error
	LastErrorAt time.Time
	Endpoints   int  // discovered addresses handed to the pool, each one endpoint there
	PoolFound   bool // the InferencePool exists (true without one)
}

// Ready reports whether the pool's discovered set can be routed: synced, and
// nothing refused unless the set was followed before the refusal (Served).
// A refusal from the start (a Role without watch lists, and syncs, but
// never hears of a change) is a setup to fix before any traffic; one that
// comes later is kept from turning a control-plane change into a
// data-plane outage, like an unreachable API server, which alone does not
// make it false.
func (st PoolStatus) Ready() bool { return st.Synced && (st.Refused == nil || st.Served) }

// Discovery is the informers of every pool with a kubernetes key.
type Discovery struct {
	watches []*poolWatch
}

// serviceAccountNamespace is where a pod reads the namespace it runs in.
var serviceAccountNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// New builds the watches of the pools whose config has a kubernetes key,
// sinks[name] receiving each pool's endpoints. It returns nil, nil when no
// pool has one. It talks to no server yet.
func New(pools map[string]*config.Kubernetes, sinks map[string]Sink, opts Options) (*Discovery, error) {
	names := make([]string, 0, len(pools))
	for name, k := range pools {
		if k != nil {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return nil, nil
	}
	slices.Sort(names)
	if opts.Log.GetSink() == nil {
		opts.Log = logr.Discard()
	}
	cfg, err := restConfig(opts)
	if err != nil {
		return nil, err
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	gie, err := gieclient.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("InferencePool client: %w", err)
	}
	d := &Discovery{}
	for _, name := range names {
		spec := *pools[name]
		if spec.Namespace == "" {
			if spec.Namespace, err = ownNamespace(); err != nil {
				return nil, fmt.Errorf("pools.%s.kubernetes.namespace: %w", name, err)
			}
		}
		onError := func(reason string) {
			if opts.OnError != nil {
				opts.OnError(name, reason)
			}
		}
		w, err := newPoolWatch(name, spec, sinks[name], kube, gie, opts.Log, onError)
		if err != nil {
			return nil, fmt.Errorf("pools.%s.kubernetes: %w", name, err)
		}
		d.watches = append(d.watches, w)
	}
	return d, nil
}

// Run runs the informers until ctx is done. Call it once.
func (d *Discovery) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, w := range d.watches {
		wg.Go(func() { w.run(ctx) })
	}
	wg.Wait()
}

// Status reads every pool's discovery now, in pool name order.
func (d *Discovery) Status() []PoolStatus {
	out := make([]PoolStatus, len(d.watches))
	for i, w := range d.watches {
		out[i] = w.status()
	}
	return out
}

// restConfig: explicit credentials first (Options.REST, --kubeconfig), then
// the pod's service account, then KUBECONFIG or ~/.kube/config.
func restConfig(opts Options) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	switch {
	case opts.REST != nil:
		cfg = rest.CopyConfig(opts.REST)
	case opts.Kubeconfig != "":
		cfg, err = clientcmd.BuildConfigFromFlags("", opts.Kubeconfig)
	default:
		cfg, err = rest.InClusterConfig()
		if errors.Is(err, rest.ErrNotInCluster) {
			cfg, err = clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
				clientcmd.NewDefaultClientConfigLoadingRules(), &clientcmd.ConfigOverrides{}).ClientConfig()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes credentials (in-cluster, --kubeconfig or KUBECONFIG): %w", err)
	}
	cfg.UserAgent = "pd-extproc"
	// Informers list once and then watch; the defaults (5 QPS) only slow a
	// relist of many pools after the API server returns.
	cfg.QPS, cfg.Burst = 50, 100
	return cfg, nil
}

func ownNamespace() (string, error) {
	b, err := os.ReadFile(serviceAccountNamespace)
	if err != nil {
		return "", fmt.Errorf("not set, and not running in a pod (%v): set the namespace of the engine pods", err)
	}
	return strings.TrimSpace(string(b)), nil
}
