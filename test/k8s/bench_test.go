package k8s

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// BenchmarkDiscovery is the scale of discovery (docs/kubernetes.md): a decode
// pool of K8S_BENCH_PODS pods (1000) and K8S_BENCH_RATE pod writes per
// second (100) for K8S_BENCH_DURATION (60s), while workers ask extproc for
// routing decisions over ext_proc. It runs the scenario once, whatever b.N:
//
//	go test -run '^$' -bench Discovery -benchtime 1x -timeout 20m ./test/k8s/
//
// Of every ten writes, four are two pods created and made Ready (join), two
// are deletions (leave), four make pods unready and Ready again. It
// measures from each join's status write to the first routing decision that
// picks the pod (a probe asks with the pod alone in the subset hint), from
// each deletion to the first decision that refuses it, extproc's CPU and
// memory, and counts decisions that picked a deleted pod although they were
// asked after a probe had seen the deletion observed (there must be none).
func BenchmarkDiscovery(b *testing.B) {
	c := mustCluster(b)
	nPods, rate := envInt("K8S_BENCH_PODS", 1000), envInt("K8S_BENCH_RATE", 100)
	dur := envDuration("K8S_BENCH_DURATION", 60*time.Second)
	ns := c.namespace(b, "bench")
	p := &benchPool{c: c, ns: ns}
	start := time.Now()
	for range nPods {
		p.add(b, true)
	}
	b.Logf("created %d Ready pods in %v", nPods, time.Since(start).Round(time.Millisecond))

	start = time.Now()
	s := startStackLogging(b, "", extprocToken, fmt.Sprintf("connector: kv-nixl\npools:\n  decode: {kubernetes: {namespace: %s, selector: %q, port: %d}}\n",
		ns, roleLabel+"=decode", enginePort), io.Discard)
	endpoints := `pd_extproc_discovery_endpoints{pool="decode"}`
	eventually(b, "the initial list", func() bool { return s.metric(b, endpoints) == float64(nPods) })
	b.Logf("extproc started and discovered %d pods in %v", nPods, time.Since(start).Round(time.Millisecond))

	conn, err := grpc.NewClient(s.x.GRPCAddr, grpc.WithTransportCredentials(testbed.MustCredentials(b, s.mtls)))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)
	ctx, stop := context.WithCancel(context.Background())
	defer stop()

	// Background decisions at K8S_BENCH_DECISIONS per second (400). Half of
	// them name a recently deleted pod and a Ready one in the subset hint:
	// once the deletion is observed, only the Ready one may be picked.
	var mu sync.Mutex
	var recentlyDeleted []string
	perSecond := envInt("K8S_BENCH_DECISIONS", 400)
	var bg sync.WaitGroup
	decisions := make([][]decision, 4)
	for w := range decisions {
		bg.Go(func() {
			pace := time.NewTicker(time.Second * time.Duration(len(decisions)) / time.Duration(perSecond))
			defer pace.Stop()
			for ctx.Err() == nil {
				<-pace.C
				subset, deleted := "", ""
				mu.Lock()
				if n := len(recentlyDeleted); n > 0 && rand.IntN(2) == 0 {
					if live := p.anyReady(); live != "" {
						deleted = recentlyDeleted[rand.IntN(n)]
						subset = deleted + "," + live
					}
				}
				mu.Unlock()
				at := time.Now()
				if dest, err := route(ctx, client, subset); err == nil {
					decisions[w] = append(decisions[w], decision{at: at, dest: dest, deleted: deleted})
				}
			}
		})
	}

	cpu0, _ := testbed.CPUSeconds(s.x.Pid())
	apiCPU0, _ := testbed.CPUSeconds(c.api.Pid())
	var probes sync.WaitGroup
	var joins, leaves []time.Duration
	observedGone := map[string]time.Time{} // pod address -> when a probe saw it refused
	probe := func(addr string, since time.Time, wantRouted bool, then func()) {
		probes.Go(func() {
			defer then()
			for time.Since(since) < 30*time.Second {
				dest, err := route(context.Background(), client, addr)
				if err == nil && (dest == addr) == wantRouted {
					now := time.Now()
					mu.Lock()
					defer mu.Unlock()
					if wantRouted {
						joins = append(joins, now.Sub(since))
					} else {
						leaves = append(leaves, now.Sub(since))
						observedGone[addr] = now
						recentlyDeleted = append(recentlyDeleted, addr)
						if len(recentlyDeleted) > 20 {
							recentlyDeleted = recentlyDeleted[1:]
						}
					}
					return
				}
			}
			b.Errorf("%s: no decision %v after 30s", addr, map[bool]string{true: "picked it", false: "refused it"}[wantRouted])
		})
	}

	// The churn: one write per tick, from a few workers.
	ops := make(chan func(), 64)
	var writers sync.WaitGroup
	for range 8 {
		writers.Go(func() {
			for op := range ops {
				op()
			}
		})
	}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	end := time.After(dur)
	writes := 0
churn:
	for i := 0; ; i++ {
		select {
		case <-end:
			break churn
		case <-tick.C:
		}
		switch i % 10 {
		case 0, 2: // a new pod, then (the next tick's write) Ready
			pod := p.add(b, false)
			ops <- func() {
				at := p.setReady(b, pod, true)
				probe(pod.addr(), at, true, func() { p.release(pod, true) }) // deletable once it has joined
			}
			writes += 2
		case 4, 6: // a deletion
			if pod := p.takeReady(); pod != nil {
				ops <- func() { at := p.remove(b, pod); probe(pod.addr(), at, false, func() {}) }
				writes++
			}
		case 8: // two pods unready, and two made Ready again
			for range 2 {
				if pod := p.takeReady(); pod != nil {
					ops <- func() { p.setReady(b, pod, false); p.release(pod, false) }
				}
				if pod := p.takeUnready(); pod != nil {
					ops <- func() { p.setReady(b, pod, true); p.release(pod, true) }
				}
			}
			writes += 4
		}
	}
	tick.Stop()
	close(ops)
	writers.Wait()
	probes.Wait()
	cpu1, _ := testbed.CPUSeconds(s.x.Pid())
	apiCPU1, _ := testbed.CPUSeconds(c.api.Pid())
	rss, peak, _ := testbed.Memory(s.x.Pid())
	heap := s.metric(b, "go_memstats_heap_inuse_bytes")
	stop()
	bg.Wait()

	violations, total, hinted := 0, 0, 0
	for _, ds := range decisions {
		total += len(ds)
		for _, d := range ds {
			if gone, ok := observedGone[d.dest]; ok && d.at.After(gone) {
				violations++
			}
			if d.deleted != "" {
				hinted++
			}
		}
	}
	secs := dur.Seconds()
	b.ReportMetric(percentile(joins, 50).Seconds()*1000, "join-p50-ms")
	b.ReportMetric(percentile(joins, 99).Seconds()*1000, "join-p99-ms")
	b.ReportMetric(percentile(leaves, 50).Seconds()*1000, "leave-p50-ms")
	b.ReportMetric(percentile(leaves, 99).Seconds()*1000, "leave-p99-ms")
	b.ReportMetric((cpu1-cpu0)/secs, "extproc-cores")
	b.ReportMetric(float64(peak)/(1<<20), "extproc-peak-rss-MiB")
	b.ReportMetric(float64(violations), "routed-after-deletion")
	b.Logf("pods %d, %d writes in %v (%.0f/s); %d joins: p50 %v p90 %v p99 %v max %v; %d leaves: p50 %v p90 %v p99 %v max %v",
		nPods, writes, dur, float64(writes)/secs, len(joins), percentile(joins, 50), percentile(joins, 90), percentile(joins, 99), percentile(joins, 100),
		len(leaves), percentile(leaves, 50), percentile(leaves, 90), percentile(leaves, 99), percentile(leaves, 100))
	b.Logf("extproc: %.3f cores, RSS %.0f MiB (peak %.0f MiB), Go heap in use %.0f MiB; kube-apiserver %.3f cores; %d background decisions (%.0f/s, %d of them offered a deleted pod beside a Ready one), %d picked a pod after its deletion was observed",
		(cpu1-cpu0)/secs, float64(rss)/(1<<20), float64(peak)/(1<<20), heap/(1<<20), (apiCPU1-apiCPU0)/secs, total, float64(total)/secs, hinted, violations)
	if violations > 0 {
		b.Errorf("%d decisions picked a pod after its deletion was observed", violations)
	}
}

type decision struct {
	at      time.Time
	dest    string
	deleted string // the deleted pod the subset hint named beside a Ready one
}

// route asks extproc for the decode endpoint of a bodiless request, with
// subset as the endpoint-subset hint when set; "" when it refused.
func route(ctx context.Context, client extprocv3.ExternalProcessorClient, subset string) (string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := client.Process(ctx)
	if err != nil {
		return "", err
	}
	req := envoymsg.Headers(envoymsg.Request, true, envoymsg.Header{":method", "GET"}, envoymsg.Header{":path", "/v1/models"},
		envoymsg.Header{":authority", "gw"}, envoymsg.Header{":scheme", "http"})
	if subset != "" {
		req.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			handlers.SubsetHintNamespace: {Fields: map[string]*structpb.Value{handlers.SubsetHintKey: structpb.NewStringValue(subset)}},
		}}
	}
	if err := st.Send(req); err != nil {
		return "", err
	}
	resp, err := st.Recv()
	if err != nil {
		return "", err
	}
	for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == handlers.DestinationHeader {
			return cmp.Or(string(h.GetHeader().GetRawValue()), h.GetHeader().GetValue()), nil
		}
	}
	return "", nil
}

// benchPool is the pods of the benchmark and their state. A pod being
// written is in neither list.
type benchPool struct {
	c              *cluster
	ns             string
	mu             sync.Mutex
	n              int
	ready, unready []*benchPod
}

type benchPod struct {
	ip  string
	pod *corev1.Pod // as last written
}

func (p *benchPod) addr() string { return fmt.Sprintf("%s:%d", p.ip, enginePort) }

// add creates a pod, Ready at once (and listed) or left for the caller.
func (p *benchPool) add(b *testing.B, ready bool) *benchPod {
	p.mu.Lock()
	p.n++
	name := fmt.Sprintf("decode-%d", p.n)
	p.mu.Unlock()
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{roleLabel: "decode"}}, Spec: podSpec()}
	created, err := p.c.kube.CoreV1().Pods(p.ns).Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		b.Fatal(err)
	}
	bp := &benchPod{ip: nextIP(), pod: created}
	if ready {
		p.setReady(b, bp, true)
		p.release(bp, true)
	}
	return bp
}

// setReady writes the pod's status and returns when the write was done.
func (p *benchPool) setReady(b *testing.B, bp *benchPod, ready bool) time.Time {
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	bp.pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: bp.ip, PodIPs: []corev1.PodIP{{IP: bp.ip}},
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: status}}}
	updated, err := p.c.kube.CoreV1().Pods(p.ns).UpdateStatus(context.Background(), bp.pod, metav1.UpdateOptions{})
	if err != nil {
		b.Error(err)
		return time.Now()
	}
	bp.pod = updated
	return time.Now()
}

func (p *benchPool) remove(b *testing.B, bp *benchPod) time.Time {
	zero := int64(0)
	if err := p.c.kube.CoreV1().Pods(p.ns).Delete(context.Background(), bp.pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		b.Error(err)
	}
	return time.Now()
}

func (p *benchPool) release(bp *benchPod, ready bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if ready {
		p.ready = append(p.ready, bp)
	} else {
		p.unready = append(p.unready, bp)
	}
}

// anyReady is the address of a Ready pod, "" when there is none.
func (p *benchPool) anyReady() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.ready) == 0 {
		return ""
	}
	return p.ready[rand.IntN(len(p.ready))].addr()
}

func (p *benchPool) takeReady() *benchPod   { return p.take(&p.ready) }
func (p *benchPool) takeUnready() *benchPod { return p.take(&p.unready) }

func (p *benchPool) take(list *[]*benchPod) *benchPod {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(*list) == 0 {
		return nil
	}
	i := rand.IntN(len(*list))
	bp := (*list)[i]
	*list = slices.Delete(*list, i, i+1)
	return bp
}

func percentile(ds []time.Duration, q int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*q/100)].Round(100 * time.Microsecond)
}

func envInt(key string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(key)); err == nil && n > 0 {
		return n
	}
	return def
}

func envDuration(key string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(os.Getenv(key)); err == nil && d > 0 {
		return d
	}
	return def
}
