package envoyemu

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// extProcCluster is the cluster the ext_proc filter's gRPC client streams to:
// its endpoints, picked in turn per stream, and its circuit breakers.
type extProcCluster struct {
	conns     []*grpc.ClientConn
	clients   []extprocv3.ExternalProcessorClient
	next      atomic.Uint64
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
	}
	return c, nil
}

// pick is Envoy's default ROUND_ROBIN load balancer over the endpoints. Envoy
// keeps one rotation per worker thread; the emulator has one in all. Health
// checks are not modelled: every endpoint stays in the rotation.
func (c *extProcCluster) pick() extprocv3.ExternalProcessorClient {
	return c.clients[(c.next.Add(1)-1)%uint64(len(c.clients))]
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
