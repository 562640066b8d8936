package main

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/pd-extproc/pd-extproc/pkg/server/grpcbuf"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// The driver stands in for Envoy, whose own cost is not under test: it uses
// the same chunk-sized gRPC buffers as extproc and echo, to spend as little
// CPU as it can on the two cores it shares with the servers.
func init() { grpcbuf.UseChunkSized() }

// envoyWindow is Envoy's default HTTP/2 initial stream and connection window
// (256 MiB): Envoy never throttles what an ext_proc server sends back.
const envoyWindow = 256 << 20

// Client plays Envoy's side of the ext_proc cluster: a few HTTP/2 connections
// (Envoy opens one per worker thread) carrying one Process stream per request.
type Client struct {
	conns []*grpc.ClientConn
	procs []extprocv3.ExternalProcessorClient
}

// Dial opens n connections to addr.
func Dial(addr string, n int) (*Client, error) {
	c := &Client{}
	for range max(n, 1) {
		conn, err := grpc.NewClient(addr,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithInitialWindowSize(envoyWindow),
			grpc.WithInitialConnWindowSize(envoyWindow),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
		if err != nil {
			c.Close()
			return nil, err
		}
		conn.Connect()
		c.conns = append(c.conns, conn)
		c.procs = append(c.procs, extprocv3.NewExternalProcessorClient(conn))
	}
	return c, nil
}

// Close closes every connection.
func (c *Client) Close() {
	for _, conn := range c.conns {
		conn.Close()
	}
}

// Load is one closed-loop run: Concurrency workers, each sending its next
// request as soon as the previous one is complete, for Duration or until
// Requests have been sent in total.
type Load struct {
	Mode        Mode
	Payload     *Payload
	Answer      *Answer // when set, the response path is played after each request
	Concurrency int
	Duration    time.Duration // used when Requests is 0
	Requests    int
	IDPrefix    string // request ids are IDPrefix-<n>, unique per run
}

// LoadResult holds the latencies of the completed requests, sorted, and of
// their answers' chunks.
type LoadResult struct {
	Latencies []time.Duration
	Chunks    []time.Duration
	Errors    int
	FirstErr  error
	Elapsed   time.Duration // first request sent to last reply received
}

// requestTimeout bounds one exchange, so a stuck server shows up as errors.
const requestTimeout = 2 * time.Minute

// Run executes l against c.
func (c *Client) Run(ctx context.Context, l Load) LoadResult {
	var (
		mu     sync.Mutex
		res    LoadResult
		issued atomic.Int64
		wg     sync.WaitGroup
	)
	start := time.Now()
	deadline := start.Add(l.Duration)
	more := func() (int64, bool) {
		n := issued.Add(1)
		if l.Requests > 0 {
			return n, n <= int64(l.Requests)
		}
		return n, time.Now().Before(deadline) && ctx.Err() == nil
	}
	for w := range l.Concurrency {
		proc := c.procs[w%len(c.procs)]
		wg.Go(func() {
			var lat, chunks []time.Duration
			var errs int
			var firstErr error
			for {
				n, ok := more()
				if !ok {
					break
				}
				rctx, cancel := context.WithTimeout(ctx, requestTimeout)
				t0 := time.Now()
				r, err := roundTrip(rctx, proc, l.Mode, l.Payload, l.Answer, fmt.Sprintf("%s-%d", l.IDPrefix, n), false)
				d := time.Since(t0)
				cancel()
				if err != nil {
					errs++
					if firstErr == nil {
						firstErr = err
					}
					continue
				}
				lat = append(lat, d)
				chunks = append(chunks, r.Chunks...)
			}
			mu.Lock()
			res.Latencies = append(res.Latencies, lat...)
			res.Chunks = append(res.Chunks, chunks...)
			res.Errors += errs
			if res.FirstErr == nil {
				res.FirstErr = firstErr
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	res.Elapsed = time.Since(start)
	slices.Sort(res.Latencies)
	slices.Sort(res.Chunks)
	return res
}

// Percentile returns the nearest-rank q-quantile (0 < q <= 1) of sorted latencies.
func Percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(float64(len(sorted))*q)) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// Mean is the average latency.
func Mean(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	return sum / time.Duration(len(d))
}
