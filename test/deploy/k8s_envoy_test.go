package deploy

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/internal/chart"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// The chart's standalone Envoy runs config/envoy/envoy.yaml but for the ext_proc address (the
// release's headless Service of the pd-extproc pods) and the name it checks in pd-extproc's
// certificate (the release's Service), so every rule that file passes holds here too; it finds
// its bootstrap, its SDS files and its certificate files where it mounts them; and the
// certificates the chart issues carry the names each side checks.
func TestKubernetesEnvoy(t *testing.T) {
	shipped := string(mustRead(t, testbed.MustRepoPath(t, "config/envoy/envoy.yaml")))
	for _, ex := range chart.Examples {
		ms := chartManifests(t, ex.Name)
		name := fullname(ex)
		if !slices.ContainsFunc(ms, func(m manifest) bool { return m.kind() == "Deployment" && m.name() == name+"-envoy" }) {
			continue // envoy.enabled false
		}
		t.Run(ex.Name, func(t *testing.T) {
			ns := ex.Release.Namespace
			values, err := ex.ValuesMap()
			if err != nil {
				t.Fatal(err)
			}
			domain, _ := values["clusterDomain"].(string) // a cluster whose domain is not cluster.local
			headless := fmt.Sprintf("%s-headless.%s.svc.%s", name, ns, cmp.Or(domain, "cluster.local"))
			serverName := fmt.Sprintf("%s.%s.svc", name, ns)
			boot := digString(find(t, ms, "ConfigMap", name+"-envoy"), "data", "envoy.yaml")
			want := strings.Replace(shipped, "{address: extproc, port_value: 9002}", "{address: "+headless+", port_value: 9002}", 1)
			if listen := dig(values, "envoy", "listenAddress"); listen == "::" { // an IPv6 cluster's
				want = strings.ReplaceAll(want, "socket_address: {address: 0.0.0.0,", `socket_address: {address: "::", ipv4_compat: true,`)
			}
			if want = strings.ReplaceAll(want, testbed.ServerSAN, serverName); !sameYAML(t, boot, want) {
				t.Errorf("the ConfigMap's envoy.yaml is not config/envoy/envoy.yaml with the ext_proc address %s, the name %s and the listeners' address", headless, serverName)
			}
			js, err := yaml.YAMLToJSON([]byte(boot))
			if err != nil {
				t.Fatal(err)
			}
			r := checkEnvoyBootstrapJSON(js, defaultServiceLimits(t))
			for _, e := range r.errs {
				if ex.Name == "defaults" || !strings.Contains(e, testbed.ServerSAN) { // the rules name the default install's SAN
					t.Error(e)
				}
			}

			dep := find(t, ms, "Deployment", name+"-envoy")
			pod := dig(dep, "spec", "template")
			c := dig(pod, "spec", "containers").([]any)[0]
			args := toStrings(dig(c, "args"))
			cfg := ""
			for i, a := range args {
				if a == "-c" && i+1 < len(args) {
					cfg = args[i+1]
				}
			}
			if vol := mountedVolume(pod, c, cfg); digString(vol, "configMap", "name") != name+"-envoy" || !strings.HasSuffix(cfg, "/envoy.yaml") {
				t.Errorf("-c %q is not the envoy.yaml key of the mounted ConfigMap %s-envoy", cfg, name)
			}
			dir := t.TempDir()
			path := filepath.Join(dir, "envoy.yaml")
			if err := os.WriteFile(path, []byte(boot), 0o600); err != nil {
				t.Fatal(err)
			}
			// The SDS files are config/envoy/sds's, in the ConfigMap <fullname>-envoy-sds.
			sdsData, _ := dig(find(t, ms, "ConfigMap", name+"-envoy-sds"), "data").(map[string]any)
			shippedSDS, _ := filepath.Glob(testbed.MustRepoPath(t, "config/envoy/sds/*.yaml"))
			if len(sdsData) != len(shippedSDS) {
				t.Errorf("ConfigMap %s-envoy-sds has %d files, config/envoy/sds %d", name, len(sdsData), len(shippedSDS))
			}
			for _, f := range shippedSDS {
				if got, _ := sdsData[filepath.Base(f)].(string); !sameYAML(t, got, string(mustRead(t, f))) {
					t.Errorf("ConfigMap %s-envoy-sds's %s is not config/envoy/sds/%s", name, filepath.Base(f), filepath.Base(f))
				}
				if err := os.WriteFile(filepath.Join(dir, filepath.Base(f)), mustRead(t, f), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			clientSecret := name + "-client-tls"
			if ex.Name == "everything" { // tls.clientSecret
				clientSecret = "router-client"
			}
			sds, certs := extProcTLSFiles(t, path, map[string]string{"/etc/envoy/sds": dir}) // the emulator must load the bootstrap
			for _, f := range sds {
				if vol := mountedVolume(pod, c, f); digString(vol, "configMap", "name") != name+"-envoy-sds" {
					t.Errorf("the bootstrap reads the SDS file %s, which is not in the mounted ConfigMap %s-envoy-sds", f, name)
				}
			}
			for _, f := range certs {
				if vol := mountedVolume(pod, c, f); digString(vol, "secret", "secretName") != clientSecret {
					t.Errorf("the bootstrap reads %s, which is not in the mounted Secret %s", f, clientSecret)
				}
			}

			// The headless Service finds the pd-extproc pods on their grpc port.
			svc := find(t, ms, "Service", name+"-headless")
			labels, _ := dig(find(t, ms, "Deployment", name), "spec", "template", "metadata", "labels").(map[string]any)
			if digString(svc, "spec", "clusterIP") != "None" || !selects(dig(svc, "spec", "selector"), labels) {
				t.Errorf("Service %s-headless is not a headless Service of the pd-extproc pods: %v", name, dig(svc, "spec"))
			}
			// The NetworkPolicy admits these pods to pd-extproc.
			envoyLabels, _ := dig(pod, "metadata", "labels").(map[string]any)
			np := find(t, ms, "NetworkPolicy", name)
			from := dig(dig(np, "spec", "ingress").([]any)[0], "from").([]any)[0]
			if !selects(dig(from, "podSelector", "matchLabels"), envoyLabels) {
				t.Errorf("the NetworkPolicy does not admit the Envoy pods %v", envoyLabels)
			}
		})
	}
}

// sameYAML compares two YAML documents as data (comments and layout aside).
func sameYAML(t *testing.T, a, b string) bool {
	t.Helper()
	var x, y any
	for _, p := range []struct {
		s string
		v *any
	}{{a, &x}, {b, &y}} {
		js, err := yaml.YAMLToJSON([]byte(p.s))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(js, p.v); err != nil {
			t.Fatal(err)
		}
	}
	return reflect.DeepEqual(x, y)
}

// The standalone Envoy drains before it stops: on SIGTERM Envoy exits at once and cuts every
// generation in flight, so its preStop hook asks the admin interface for a graceful drain and
// waits until no request is active, inside the grace period; a disruption budget lets a node
// drain take one Envoy at a time. The hook is run here, with bash, against a fake admin
// interface, as the kubelet runs it in the container.
func TestEnvoyDrainsBeforeItStops(t *testing.T) {
	ms := chartManifests(t, "defaults")
	dep := find(t, ms, "Deployment", "pd-extproc-envoy")
	pod := dig(dep, "spec", "template")
	c := dig(pod, "spec", "containers").([]any)[0]
	hook := toStrings(dig(c, "lifecycle", "preStop", "exec", "command"))
	if len(hook) != 3 || hook[0] != "/bin/bash" || hook[1] != "-c" {
		t.Fatalf("envoy preStop = %q, want /bin/bash -c <script>", hook)
	}
	env := map[string]string{}
	for _, e := range dig(c, "env").([]any) {
		env[digString(e, "name")] = digString(e, "value")
	}
	minWait, _ := strconv.Atoi(env["DRAIN_MIN_SECONDS"])
	maxWait, _ := strconv.Atoi(env["DRAIN_MAX_SECONDS"])
	grace, _ := dig(pod, "spec", "terminationGracePeriodSeconds").(float64)
	if maxWait < 60 || minWait+maxWait >= int(grace) {
		t.Errorf("DRAIN_MIN_SECONDS %d + DRAIN_MAX_SECONDS %d against terminationGracePeriodSeconds %v: want a wait of minutes, inside the grace", minWait, maxWait, grace)
	}
	args := strings.Join(toStrings(dig(c, "args")), " ")
	if !strings.Contains(args, "--drain-strategy immediate") || !strings.Contains(args, "--drain-time-s") {
		t.Errorf("envoy args %q: want --drain-time-s and --drain-strategy immediate (every connection told to close at the drain's start)", args)
	}
	pdb := find(t, ms, "PodDisruptionBudget", "pd-extproc-envoy")
	labels, _ := dig(pod, "metadata", "labels").(map[string]any)
	if !selects(dig(pdb, "spec", "selector", "matchLabels"), labels) || dig(pdb, "spec", "minAvailable") != 1.0 {
		t.Errorf("PodDisruptionBudget envoy = %v; want minAvailable 1 over the Envoy pods", dig(pdb, "spec"))
	}

	tests := []struct {
		name      string
		active    []int // what each stats poll answers; the last repeats
		noGauge   bool  // the stats answer lacks the gauge
		status    int   // the stats answer's status, when not 200
		down      bool  // no admin interface: Envoy is gone already
		maxWait   string
		wantPolls int // at least
	}{
		{name: "waits for the generations in flight", active: []int{2, 1, 0}, maxWait: "60", wantPolls: 3},
		{name: "nothing in flight", active: []int{0}, maxWait: "60", wantPolls: 1},
		{name: "stops waiting at DRAIN_MAX_SECONDS", active: []int{5}, maxWait: "2", wantPolls: 1},
		{name: "an answer without the gauge is not a 0", active: []int{0}, noGauge: true, maxWait: "3", wantPolls: 2},
		{name: "an answer that is not a 200 is not a 0", active: []int{0}, status: http.StatusServiceUnavailable, maxWait: "3", wantPolls: 2},
		{name: "Envoy gone", down: true, maxWait: "60"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			var calls []string
			polls := 0
			// Envoy's admin interface: HTTP/1.0 refused with a 426 (its HTTP/1 codec, unless
			// accept_http_10 is set, which the admin's settings never are), HTTP/1.1 without a
			// Host with a 400 (net/http's, as Envoy's), stats streamed in chunks.
			admin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if !r.ProtoAtLeast(1, 1) {
					http.Error(w, "Upgrade Required", http.StatusUpgradeRequired)
					return
				}
				mu.Lock()
				defer mu.Unlock()
				calls = append(calls, r.Method+" "+r.URL.RequestURI())
				if r.URL.Path == "/stats" {
					if tc.status != 0 {
						w.WriteHeader(tc.status)
					}
					fmt.Fprintln(w, "http.inference.downstream_cx_active: 1")
					w.(http.Flusher).Flush()
					if !tc.noGauge {
						fmt.Fprintf(w, "http.inference.downstream_rq_active: %d\n", tc.active[min(polls, len(tc.active)-1)])
					}
					polls++
				}
			}))
			port := admin.Listener.Addr().(*net.TCPAddr).Port
			if tc.down {
				admin.Close()
			} else {
				defer admin.Close()
			}
			cmd := exec.Command(hook[0], hook[1], hook[2])
			cmd.Env = append(os.Environ(), fmt.Sprintf("ENVOY_ADMIN_PORT=%d", port), "DRAIN_MIN_SECONDS=0", "DRAIN_MAX_SECONDS="+tc.maxWait)
			start := time.Now()
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("preStop: %v\n%s", err, out)
			}
			if took := time.Since(start); took > 30*time.Second {
				t.Errorf("preStop took %v", took)
			}
			mu.Lock()
			defer mu.Unlock()
			if tc.down {
				if len(calls) != 0 {
					t.Errorf("calls %q to a closed admin interface", calls)
				}
				return
			}
			if len(calls) == 0 || calls[0] != "POST /drain_listeners?graceful" || polls < tc.wantPolls {
				t.Errorf("admin calls %q (%d polls); want POST /drain_listeners?graceful first, then at least %d polls of downstream_rq_active", calls, polls, tc.wantPolls)
			}
			if last := tc.active[len(tc.active)-1]; last == 0 && !tc.noGauge && tc.status == 0 && polls != len(tc.active) {
				t.Errorf("%d polls for %v: the hook must stop at the first 0", polls, tc.active)
			}
		})
	}
}

// Kubernetes sets no file limit and container runtimes often leave Envoy a soft 1,024, which two
// connections per generation exhaust; the chart's Envoy starts with its soft limit raised to the
// hard one, and its arguments passed on. Run here with bash, a fake envoy on PATH, and a soft
// limit lowered first.
func TestEnvoyStartsWithItsHardFileLimit(t *testing.T) {
	c := dig(find(t, chartManifests(t, "defaults"), "Deployment", "pd-extproc-envoy"), "spec", "template", "spec", "containers").([]any)[0]
	command, args := toStrings(dig(c, "command")), toStrings(dig(c, "args"))
	dir := t.TempDir()
	fake := "#!/bin/bash\necho \"soft=$(ulimit -Sn) hard=$(ulimit -Hn) args=$*\"\n"
	if err := os.WriteFile(filepath.Join(dir, "envoy"), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("/bin/bash", append([]string{"-c", `ulimit -Sn 256 && exec "$@"`, "lower"}, append(command, args...)...)...)
	cmd.Env = append(os.Environ(), "PATH="+dir+":"+os.Getenv("PATH"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %v\n%s", command, err, out)
	}
	var soft, hard, rest string
	if _, err := fmt.Sscanf(string(out), "soft=%s hard=%s args=%s", &soft, &hard, &rest); err != nil || soft != hard {
		t.Errorf("envoy started with %q; want its soft file limit raised to the hard one", out)
	}
	if !strings.Contains(string(out), "args="+strings.Join(args, " ")) {
		t.Errorf("envoy started with %q; want the arguments %q", out, args)
	}
}

// Envoy Gateway's proxies drain as long as the standalone Envoy before they stop (Envoy Gateway's
// own default, 60 s, cuts every longer generation at each proxy restart), and two of them run
// with a disruption budget (its default is one, with none).
func TestEnvoyGatewayProxiesDrainAndStayTwo(t *testing.T) {
	ep := find(t, chartManifests(t, "envoy-gateway"), "EnvoyProxy", "pd-gateway-proxy")
	drain, err := time.ParseDuration(digString(ep, "spec", "shutdown", "drainTimeout"))
	if err != nil || drain < 585*time.Second {
		t.Errorf("EnvoyProxy shutdown.drainTimeout = %v (%v), want the standalone Envoy's 585 s", drain, err)
	}
	k := dig(ep, "spec", "provider", "kubernetes")
	if replicas, _ := dig(k, "envoyDeployment", "replicas").(float64); replicas < 2 || dig(k, "envoyPDB", "minAvailable") != 1.0 {
		t.Errorf("EnvoyProxy provider.kubernetes = %v, want two proxies or more and a disruption budget of one", k)
	}
}
