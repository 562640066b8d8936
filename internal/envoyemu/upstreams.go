package envoyemu

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
)

// extProcCluster is the cluster the ext_proc filter's gRPC client streams to:
// its endpoints, picked in turn per stream, and its circuit breakers.
type extProcCluster struct {
	conns     []*grpc.ClientConn
	clients   []extprocv3.ExternalProcessorClient
	addrs     []string
	rotation  atomic.Pointer[[]int] // the endpoints listed, as indexes of clients and addrs
	next      atomic.Uint64
	hash      []HashHeader // the headers its hash_policy names, nil: round robin
	resources *resources
	stop      context.CancelFunc // ends the watch of its TLS files
}

// newExtProcCluster dials one gRPC connection per endpoint: over TLS when
// the cluster has a TLS transport socket (§13), with its files read through
// mounts and followed when they come by SDS, else plaintext.
func newExtProcCluster(addrs []string, cl *Cluster, mounts map[string]string, logf func(string, ...any)) (*extProcCluster, error) {
	if len(addrs) == 0 {
		return nil, errors.New("no ext_proc endpoint")
	}
	t, perConn := DefaultThresholds, defaultHTTP2Streams
	if cl != nil {
		t, perConn = cl.Breakers, cl.StreamsPerConnection
	}
	creds := insecure.NewCredentials()
	ctx, stop := context.WithCancel(context.Background())
	c := &extProcCluster{resources: newResources(t, perConn), stop: stop}
	if cl != nil {
		c.hash = cl.HashHeaders
	}
	if cl != nil && cl.TLS != nil {
		tc, s, err := cl.TLS.clientConfig(func(p string) string { return mounted(mounts, p) })
		if err == nil {
			err = s.follow(ctx, logf)
		}
		if err != nil {
			stop()
			return nil, fmt.Errorf("cluster %q transport_socket: %w", cl.Name, err)
		}
		creds = credentials.NewTLS(tc)
	}
	for _, a := range addrs {
		conn, err := grpc.NewClient(a, grpc.WithTransportCredentials(creds))
		if err != nil {
			c.close()
			return nil, fmt.Errorf("ext_proc endpoint %s: %w", a, err)
		}
		c.conns = append(c.conns, conn)
		c.clients = append(c.clients, extprocv3.NewExternalProcessorClient(conn))
		c.addrs = append(c.addrs, a)
	}
	rotation := make([]int, len(c.clients))
	for i := range rotation {
		rotation[i] = i
	}
	c.rotation.Store(&rotation)
	return c, nil
}

// pick is the endpoint for a stream with this metadata. A cluster with a
// hash policy takes, for a stream carrying one of its headers, the endpoint
// its value hashes to (rendezvous hashing over the addresses: the same value
// always meets the same endpoint while it is listed, as on Envoy's ring),
// the policies read in order until a terminal one with a hash so far
// (HashPolicyImpl::generateHash). Otherwise, and for a stream with none of
// them (where Envoy's ring picks at random), it is Envoy's default
// ROUND_ROBIN load balancer. Envoy keeps one
// rotation per worker thread; the emulator has one in all. Health checks are
// not modelled: an endpoint leaves the rotation only when removed.
func (c *extProcCluster) pick(md metadata.MD) extprocv3.ExternalProcessorClient {
	rotation := *c.rotation.Load()
	var key []string
	for _, h := range c.hash {
		key = append(key, md.Get(h.Name)...)
		if h.Terminal && len(key) > 0 {
			break
		}
	}
	if len(key) == 0 {
		return c.clients[rotation[(c.next.Add(1)-1)%uint64(len(rotation))]]
	}
	k := strings.Join(key, "\x00") + "\x00"
	best, top := rotation[0], xxhash.Sum64String(k+c.addrs[rotation[0]])
	for _, i := range rotation[1:] {
		if w := xxhash.Sum64String(k + c.addrs[i]); w > top {
			best, top = i, w
		}
	}
	return c.clients[best]
}

// remove takes the endpoint at addr out of the rotation, as Envoy drops a
// host that DNS or EDS stops listing (a pod being deleted): no new stream
// goes to it, and the streams on it run on over its connection.
func (c *extProcCluster) remove(addr string) error {
	i := slices.Index(c.addrs, addr)
	for {
		old := c.rotation.Load()
		if i < 0 || !slices.Contains(*old, i) {
			return fmt.Errorf("ext_proc endpoint %s is not in the rotation", addr)
		}
		if len(*old) == 1 {
			return fmt.Errorf("ext_proc endpoint %s is the last one", addr)
		}
		rotation := slices.DeleteFunc(slices.Clone(*old), func(x int) bool { return x == i })
		if c.rotation.CompareAndSwap(old, &rotation) {
			return nil
		}
	}
}

func (c *extProcCluster) close() error {
	c.stop()
	var errs []error
	for _, conn := range c.conns {
		errs = append(errs, conn.Close())
	}
	return errors.Join(errs...)
}

// clusterResources holds the circuit breakers of the route clusters, built
// once per proxy from the config.
type clusterResources struct {
	mu   sync.Mutex
	byID map[string]*resources
}

func (c *clusterResources) get(cl *Cluster) *resources {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byID == nil {
		c.byID = map[string]*resources{}
	}
	r := c.byID[cl.Name]
	if r == nil {
		r = newResources(cl.Breakers, cl.StreamsPerConnection)
		c.byID[cl.Name] = r
	}
	return r
}

func (c *clusterResources) stats() map[string]ClusterStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]ClusterStats, len(c.byID))
	for name, r := range c.byID {
		out[name] = r.snapshot()
	}
	return out
}
