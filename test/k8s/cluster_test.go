package k8s

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/pd-extproc/pd-extproc/internal/chart"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// The identities of the API server's static token file. extproc runs as the
// service account the shipped manifests bind their Role to, so the tests
// check that the shipped RBAC is enough; nowatch is bound to what a test gives it.
const (
	adminToken   = "admin-token"
	extprocToken = "extproc-token"
	extprocUser  = "system:serviceaccount:pd-extproc:pd-extproc"
	nowatchToken = "nowatch-token"
	nowatchUser  = "nowatch"
)

// cluster is a Kubernetes control plane on loopback: etcd and kube-apiserver,
// no controller-manager, no scheduler, no kubelet. Tests create pods and
// write their status themselves.
type cluster struct {
	dir     string
	pki     *pki
	etcd    *testbed.Process
	api     *testbed.Process
	apiArgs []string // all but the port
	port    int
	url     string   // https://127.0.0.1:port
	log     *os.File // etcd's and kube-apiserver's output
	cleanup *testbed.Cleanups

	rest   *rest.Config // admin
	kube   kubernetes.Interface
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

var (
	theCluster  *cluster
	clusterErr  error
	clusterOnce sync.Once
)

// binaries finds kube-apiserver and etcd on PATH (make puts TOOLS_BIN there)
// or in testbed.ToolDirs.
func binaries() (apiserver, etcd string, err error) {
	apiserver, etcd = testbed.FindTool("kube-apiserver"), testbed.FindTool("etcd")
	if apiserver == "" || etcd == "" {
		return "", "", errors.New("kube-apiserver or etcd not found on PATH or in TOOLS_BIN: `make tools` builds them")
	}
	return apiserver, etcd, nil
}

// mustCluster returns the package's control plane, started on first use,
// and skips the test when its binaries are not built.
func mustCluster(t testing.TB) *cluster {
	t.Helper()
	clusterOnce.Do(func() { theCluster, clusterErr = startCluster() })
	if errors.Is(clusterErr, errNoBinaries) {
		t.Skipf("skipping: %v", clusterErr)
	}
	if clusterErr != nil {
		t.Fatalf("starting the control plane: %v", clusterErr)
	}
	return theCluster
}

var errNoBinaries = errors.New("no control plane binaries")

func startCluster() (*cluster, error) {
	_, etcdBin, err := binaries()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errNoBinaries, err)
	}
	dir, err := os.MkdirTemp("", "pd-extproc-k8s-")
	if err != nil {
		return nil, err
	}
	c := &cluster{dir: dir, cleanup: &testbed.Cleanups{}}
	c.cleanup.Cleanup(func() { os.RemoveAll(dir) })
	if c.pki, err = newPKI(dir); err != nil {
		return nil, c.fail(err)
	}
	log, err := os.Create(filepath.Join(dir, "control-plane.log")) // its start is in a failure's message
	if err != nil {
		return nil, c.fail(err)
	}
	c.cleanup.Cleanup(func() { log.Close() })
	c.log = log

	var client string
	c.etcd, err = testbed.WithFreshPorts(func() (*testbed.Process, error) {
		cp, pp, err := twoPorts()
		if err != nil {
			return nil, err
		}
		client = fmt.Sprintf("http://127.0.0.1:%d", cp)
		peer := fmt.Sprintf("http://127.0.0.1:%d", pp)
		return testbed.StartProcess(context.Background(), c.cleanup, testbed.ProcessConfig{
			Name: "etcd", Bin: etcdBin, Log: log, Timeout: time.Minute,
			Args: []string{
				"--name=default", "--data-dir=" + filepath.Join(dir, "etcd"), "--log-level=warn", "--unsafe-no-fsync",
				"--listen-client-urls=" + client, "--advertise-client-urls=" + client,
				"--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer, "--initial-cluster=default=" + peer,
			},
			Ready: testbed.HTTPOK(client + "/health"),
		})
	})
	if err != nil {
		return nil, c.fail(err)
	}

	tokens := filepath.Join(dir, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(strings.Join([]string{
		adminToken + ",admin,admin,system:masters",
		extprocToken + "," + extprocUser + ",extproc,\"system:serviceaccounts,system:serviceaccounts:pd-extproc\"",
		nowatchToken + "," + nowatchUser + ",nowatch",
	}, "\n")+"\n"), 0o600); err != nil {
		return nil, c.fail(err)
	}
	c.apiArgs = []string{
		"--etcd-servers=" + client,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		"--tls-cert-file=" + c.pki.certFile, "--tls-private-key-file=" + c.pki.keyFile, "--cert-dir=" + filepath.Join(dir, "certs"),
		"--token-auth-file=" + tokens, "--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc", "--service-account-key-file=" + c.pki.saPublic,
		"--service-account-signing-key-file=" + c.pki.saPrivate,
		"--service-cluster-ip-range=10.96.0.0/24",
		// On loopback there is no address for the kubernetes Service's endpoints.
		"--endpoint-reconciler-type=none",
		"--profiling=false", "--v=0",
	}
	// The port is picked again while another socket takes it first; a
	// restart (startAPI) keeps it.
	if _, err := testbed.WithFreshPorts(func() (struct{}, error) {
		port, err := testbed.FreePort()
		if err != nil {
			return struct{}{}, err
		}
		c.url = fmt.Sprintf("https://127.0.0.1:%d", port)
		c.port = port
		return struct{}{}, c.startAPI()
	}); err != nil {
		return nil, c.fail(err)
	}
	c.rest = &rest.Config{
		Host: c.url, BearerToken: adminToken, TLSClientConfig: rest.TLSClientConfig{CAData: c.pki.ca.PEM},
		QPS: 500, Burst: 1000, UserAgent: "pd-extproc-test",
	}
	if c.kube, err = kubernetes.NewForConfig(c.rest); err != nil {
		return nil, c.fail(err)
	}
	if c.dyn, err = dynamic.NewForConfig(c.rest); err != nil {
		return nil, c.fail(err)
	}
	c.mapper = restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(c.kube.Discovery()))
	return c, nil
}

// twoPorts is two free loopback ports.
func twoPorts() (int, int, error) {
	a, err := testbed.FreePort()
	if err != nil {
		return 0, 0, err
	}
	b, err := testbed.FreePort()
	return a, b, err
}

func (c *cluster) fail(err error) error {
	c.cleanup.Close()
	return err
}

// startAPI starts kube-apiserver and waits for its /readyz.
func (c *cluster) startAPI() error {
	apiserver, _, err := binaries()
	if err != nil {
		return err
	}
	probe := &http.Client{Transport: &http.Transport{Proxy: nil, TLSClientConfig: &tls.Config{RootCAs: c.pki.ca.Roots()}, DisableKeepAlives: true}}
	c.api, err = testbed.StartProcess(context.Background(), c.cleanup, testbed.ProcessConfig{
		Name: "kube-apiserver", Bin: apiserver, Args: append(c.apiArgs, fmt.Sprintf("--secure-port=%d", c.port)), Log: c.log, Timeout: 2 * time.Minute,
		Ready: func(ctx context.Context) error {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.url+"/readyz", nil)
			req.Header.Set("Authorization", "Bearer "+adminToken)
			resp, err := probe.Do(req)
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("/readyz: %s", resp.Status)
			}
			return nil
		},
	})
	return err
}

// stopAPI kills kube-apiserver, as a crash or a lost control plane would.
func (c *cluster) stopAPI() { c.api.Kill() }

// kubeconfig writes a kubeconfig for token into dir and returns its path.
func (c *cluster) kubeconfig(t testing.TB, server, token string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	ca := filepath.Join(filepath.Dir(path), "ca.crt")
	if err := os.WriteFile(ca, c.pki.ca.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: %q, certificate-authority: %q, tls-server-name: localhost}}]
users: [{name: u, user: {token: %q}}]
contexts: [{name: test, context: {cluster: test, user: u}}]
current-context: test
`, server, ca, token)
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// namespace creates a namespace of its own for a test, with the default
// ServiceAccount a controller-manager would have made (pods need it), and
// binds the chart's Role (with rbac.inferencePools) there to extproc's
// service account, as rbac.extraNamespaces would.
func (c *cluster) namespace(t testing.TB, prefix string) string {
	t.Helper()
	ctx := context.Background()
	ns, err := c.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.kube.CoreV1().ServiceAccounts(ns.Name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	for _, m := range chartObjects(t, chart.Release{Name: "pd-extproc", Namespace: "pd-extproc"}, map[string]any{"rbac": map[string]any{"inferencePools": true}}) {
		if k := m.GetKind(); k != "Role" && k != "RoleBinding" {
			continue
		}
		m.SetNamespace(ns.Name)
		c.create(t, m)
	}
	return ns.Name
}
