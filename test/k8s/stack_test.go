package k8s

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if theCluster != nil {
		theCluster.cleanup.Close()
	}
	if extprocDir != "" {
		os.RemoveAll(extprocDir)
	}
	os.Exit(code)
}

var (
	extprocBin, extprocDir string
	extprocErr             error
	extprocOnce            sync.Once
)

func mustExtproc(t testing.TB) string {
	t.Helper()
	extprocOnce.Do(func() {
		if extprocDir, extprocErr = os.MkdirTemp("", "pd-extproc-k8s-bin-"); extprocErr == nil {
			extprocBin, extprocErr = testbed.BuildExtproc(extprocDir)
		}
	})
	if extprocErr != nil {
		t.Fatal(extprocErr)
	}
	return extprocBin
}

// Engine pods get loopback IPs of their own, 127.77.x.y, out of the way of
// other tests' 127.0.0.x, so that every simulator listens on the engines'
// real port, as pods do.
var ipSeq atomic.Int32

func nextIP() string {
	n := ipSeq.Add(1)
	return fmt.Sprintf("127.77.%d.%d", n/250, n%250+1)
}

const enginePort = 8000

// extprocVerbosity is extproc's -v in the tests.
var extprocVerbosity = cmp.Or(os.Getenv("K8S_TEST_V"), "0")

// engine is a pod and the simulator that serves on its IP.
type engine struct {
	ns, name, ip string
	sim          *pdsim.Server
}

func (e *engine) addr() string { return fmt.Sprintf("%s:%d", e.ip, enginePort) }

// podSpec is what a test pod declares: a named container port, and a node,
// so that a deletion leaves it terminating (no kubelet confirms it).
func podSpec() corev1.PodSpec {
	return corev1.PodSpec{
		NodeName: "node-1",
		Containers: []corev1.Container{{
			Name: "engine", Image: "pdsim",
			Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: enginePort}},
		}},
	}
}

// startEngine starts a simulator of role and protocol on a new IP and
// creates its pod, not Ready yet. sim tweaks the simulator's config.
func (c *cluster) startEngine(t testing.TB, ns, name, role, protocol string, labels, annotations map[string]string, sim func(*testbed.SimConfig)) *engine {
	t.Helper()
	e := &engine{ns: ns, name: name, ip: nextIP()}
	cfg := testbed.SimConfig{
		Role: role, Protocol: protocol, IP: e.ip, Addr: e.addr(), BootstrapPort: 8998, SharedDir: t.TempDir(),
		Timings: testbed.Timings{TTFT: time.Millisecond, TPOT: time.Millisecond, KVTransfer: time.Millisecond, OutputTokens: 4, HandshakeTimeout: 10 * time.Second},
	}
	if sim != nil {
		sim(&cfg)
	}
	e.sim = testbed.MustStartSim(t, cfg)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Annotations: annotations}, Spec: podSpec()}
	if _, err := c.kube.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return e
}

// setReady writes the pod's status as a kubelet would: running on its IP,
// Ready or not.
func (c *cluster) setReady(t testing.TB, e *engine, ready bool) {
	t.Helper()
	pods := c.kube.CoreV1().Pods(e.ns)
	pod, err := pods.Get(context.Background(), e.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	now := metav1.Now()
	pod.Status = corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: e.ip, PodIPs: []corev1.PodIP{{IP: e.ip}}, HostIP: "127.0.0.1", StartTime: &now,
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: status, LastTransitionTime: now}},
	}
	if _, err := pods.UpdateStatus(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// update changes the pod's metadata (labels, annotations) with mutate.
func (c *cluster) update(t testing.TB, e *engine, mutate func(*corev1.Pod)) {
	t.Helper()
	pods := c.kube.CoreV1().Pods(e.ns)
	pod, err := pods.Get(context.Background(), e.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	mutate(pod)
	if _, err := pods.Update(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// deletePod deletes gracefully: with no kubelet the pod stays, terminating.
func (c *cluster) deletePod(t testing.TB, e *engine) {
	t.Helper()
	if err := c.kube.CoreV1().Pods(e.ns).Delete(context.Background(), e.name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// stack is extproc with Kubernetes discovery behind the Envoy emulator.
type stack struct {
	x     *testbed.Extproc
	proxy *envoyemu.Proxy
	mtls  *testbed.MTLS // of the Envoy-extproc link; a test dials extproc in Envoy's place with it
}

// startStack runs extproc on config with a kubeconfig for token at server
// (the API server's URL unless a test puts something between), and the
// Envoy emulator in front of it. It waits only until extproc has started.
// extproc's log goes to the test's.
func startStack(t testing.TB, server, token, config string) *stack {
	t.Helper()
	return startStackLogging(t, server, token, config, testbed.LineFunc(func(line string) { t.Log(line) }),
		"--log-flush-interval=0", "--log-format=console")
}

// startStackLogging is startStack with extproc's log going to log, and more flags.
func startStackLogging(t testing.TB, server, token, config string, log io.Writer, args ...string) *stack {
	t.Helper()
	c := mustCluster(t)
	if server == "" {
		server = c.url
	}
	mtls := testbed.MustNewMTLS(t, testbed.MTLSConfig{})
	x := testbed.MustStartExtproc(t, testbed.ExtprocConfig{
		Bin: mustExtproc(t), Config: config, Wait: testbed.WaitStarted, MTLS: mtls,
		Args: append([]string{"--kubeconfig", c.kubeconfig(t, server, token), "-v=" + extprocVerbosity}, args...),
		Log:  log,
	})
	proxy := testbed.MustStartEnvoy(t, testbed.EnvoyConfigs["full_duplex"], x.GRPCAddr, mtls.Envoy)
	return &stack{x: x, proxy: proxy, mtls: mtls}
}

// metric reads one sample; -1 when the series is absent.
func (s *stack) metric(t testing.TB, series string) float64 {
	t.Helper()
	return s.x.MustMetric(t, series)
}

// readyz answers GET /readyz?verbose: the status code and the text.
func (s *stack) readyz(t testing.TB) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + s.x.AdminAddr + "/readyz?verbose")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// eventually polls cond every 20 ms until it holds, failing after a bound.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		case <-tick.C:
		}
	}
}

// endpoints is the pool's endpoint set as /metrics lists it.
func (s *stack) endpoints(t testing.TB, pool string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+s.x.AdminAddr+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	const prefix = `pd_extproc_endpoint_healthy{endpoint="`
	var out []string
	for line := range strings.Lines(string(b)) {
		rest, ok := strings.CutPrefix(line, prefix)
		if !ok || !strings.Contains(rest, `pool="`+pool+`"`) {
			continue
		}
		addr, _, _ := strings.Cut(rest, `"`)
		out = append(out, addr)
	}
	return out
}

// post sends a chat completion through Envoy.
func (s *stack) post(ctx context.Context, prompt string) (*http.Response, string, error) {
	body := fmt.Sprintf(`{"model":"pdsim","messages":[{"role":"user","content":%q}],"max_tokens":4}`, prompt)
	return testbed.Post(ctx, s.proxy.URL()+"/v1/chat/completions", body, nil)
}

// mustPost sends a request that must succeed with a KV hit, and returns
// which decode endpoint served it and where its KV came from.
func (s *stack) mustPost(t testing.TB, prompt string) (decode, kvSource string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp, body, err := s.post(ctx, prompt)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST: %d %s", resp.StatusCode, body)
	}
	if kv := resp.Header.Get("x-pdsim-kv"); kv != "hit" {
		t.Fatalf("decode KV outcome %q, want a hit (a real handoff): %s", kv, body)
	}
	up := s.proxy.Upstreams()
	return up[len(up)-1], resp.Header.Get("x-pdsim-kv-source")
}
