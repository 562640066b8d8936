package deploy

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	defaultconfig "github.com/pd-extproc/pd-extproc/config"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
	extprocconfig "github.com/pd-extproc/pd-extproc/pkg/config"
)

// The manifest directories; everything in them is applied with `kubectl apply -f <dir>`: the
// engine examples (pd-extproc itself is the chart's).
var manifestDirs = []string{"config/k8s"}

// manifestNamespace: the examples share the namespace of the chart's default install, whose
// pd-extproc discovers their pods.
const manifestNamespace = "pd-extproc"

// clusterScoped kinds carry no namespace.
var clusterScoped = map[string]bool{"Namespace": true, "GatewayClass": true}

type manifest struct {
	file string
	doc  map[string]any
}

func (m manifest) kind() string { return digString(m.doc, "kind") }
func (m manifest) name() string { return digString(m.doc, "metadata", "name") }

func loadManifests(t *testing.T, dir string) []manifest {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(testbed.MustRepoPath(t, dir), "*.yaml"))
	if err != nil || len(paths) == 0 {
		t.Fatalf("no manifests in %s: %v", dir, err)
	}
	var out []manifest
	for _, p := range paths {
		rel := dir + "/" + filepath.Base(p)
		for _, d := range yamlDocuments(t, p) {
			out = append(out, manifest{file: rel, doc: d})
		}
	}
	return out
}

// find returns the one object of a kind and name, failing when it is missing.
func find(t *testing.T, ms []manifest, kind, name string) map[string]any {
	t.Helper()
	for _, m := range ms {
		if m.kind() == kind && m.name() == name {
			return m.doc
		}
	}
	t.Fatalf("no %s %q", kind, name)
	return nil
}

func TestManifestsAreWellFormed(t *testing.T) {
	for _, dir := range manifestDirs {
		t.Run(dir, func(t *testing.T) {
			seen := map[string]string{}
			for _, m := range loadManifests(t, dir) {
				id := fmt.Sprintf("%s %s/%s", digString(m.doc, "apiVersion"), m.kind(), m.name())
				if digString(m.doc, "apiVersion") == "" || m.kind() == "" || m.name() == "" {
					t.Errorf("%s: object without apiVersion, kind or metadata.name: %v", m.file, m.doc)
					continue
				}
				ns := digString(m.doc, "metadata", "namespace")
				if clusterScoped[m.kind()] != (ns == "") || (ns != "" && ns != manifestNamespace) {
					t.Errorf("%s: %s has namespace %q; want %q (or none for cluster-scoped kinds)", m.file, id, ns, manifestNamespace)
				}
				if prev, dup := seen[id]; dup {
					t.Errorf("%s: %s is also defined in %s", m.file, id, prev)
				}
				seen[id] = m.file
			}
		})
	}
}

// The compose demo's extproc config loads with the service's own strict parser: a misspelt key
// would otherwise surface only when the container exits (the chart's configs: chart_test.go).
func TestComposeExtprocConfigLoads(t *testing.T) {
	if _, err := extprocconfig.Parse(yamlFileBytes(t, "config/envoy/extproc-compose.yaml")); err != nil {
		t.Error(err)
	}
}

func yamlFileBytes(t *testing.T, rel string) []byte {
	t.Helper()
	docs := yamlDocuments(t, testbed.MustRepoPath(t, rel))
	if len(docs) != 1 {
		t.Fatalf("%s: want one document, got %d", rel, len(docs))
	}
	js, err := json.Marshal(docs[0])
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// tlsSecret is the kubernetes.io/tls Secret the Deployment reads its certificate from.
const tlsSecret = "pd-extproc-tls"

// mountedVolume is the volume of the pod that container c mounts at a directory holding path.
func mountedVolume(pod any, c any, path string) any {
	for _, vm := range dig(c, "volumeMounts").([]any) {
		if path != "" && strings.HasPrefix(path, digString(vm, "mountPath")+"/") {
			for _, v := range dig(pod, "spec", "volumes").([]any) {
				if digString(v, "name") == digString(vm, "name") {
					return v
				}
			}
		}
	}
	return nil
}

// The chart's pd-extproc as it installs by default.
func TestExtprocDeployment(t *testing.T) {
	ms := chartManifests(t, "defaults")
	dep := find(t, ms, "Deployment", "pd-extproc")
	pod := dig(dep, "spec", "template").(map[string]any)
	containers, _ := dig(pod, "spec", "containers").([]any)
	if len(containers) != 1 {
		t.Fatalf("want one container, got %d", len(containers))
	}
	c := containers[0]
	ports := map[string]float64{}
	for _, p := range dig(c, "ports").([]any) {
		ports[digString(p, "name")], _ = dig(p, "containerPort").(float64)
	}

	checks := []struct {
		what string
		got  any
		want any
	}{
		// Two replicas and a PDB: with failure_mode_allow false, no processor means 500s.
		{"replicas", dig(dep, "spec", "replicas"), 2.0},
		{"grpc containerPort", ports["grpc"], 9002.0},
		{"metrics containerPort", ports["metrics"], 9090.0},
		{"liveness path", digString(c, "livenessProbe", "httpGet", "path"), "/healthz"},
		{"liveness port", digString(c, "livenessProbe", "httpGet", "port"), "metrics"},
		{"readiness path", digString(c, "readinessProbe", "httpGet", "path"), "/readyz"},
		{"readiness port", digString(c, "readinessProbe", "httpGet", "port"), "metrics"},
		{"pod runAsNonRoot", dig(pod, "spec", "securityContext", "runAsNonRoot"), true},
		{"readOnlyRootFilesystem", dig(c, "securityContext", "readOnlyRootFilesystem"), true},
		{"allowPrivilegeEscalation", dig(c, "securityContext", "allowPrivilegeEscalation"), false},
		{"capabilities.drop", fmt.Sprint(dig(c, "securityContext", "capabilities", "drop")), "[ALL]"},
		{"memory limit set", dig(c, "resources", "limits", "memory") != nil, true},
		{"cpu request set", dig(c, "resources", "requests", "cpu") != nil, true},
	}
	for _, ck := range checks {
		if !reflect.DeepEqual(ck.got, ck.want) {
			t.Errorf("%s = %v, want %v", ck.what, ck.got, ck.want)
		}
	}

	// The --config flag must point into the mounted ConfigMap.
	args := toStrings(dig(c, "args"))
	cfgPath := flagValue(args, "--config")
	if vol := mountedVolume(pod, c, cfgPath); digString(vol, "configMap", "name") != "pd-extproc" || !strings.HasSuffix(cfgPath, "/extproc.yaml") {
		t.Errorf("--config=%q is not the extproc.yaml key of the mounted ConfigMap", cfgPath)
	}
	// mTLS from the Secret pd-extproc-tls, a kubernetes.io/tls Secret's keys.
	for flag, key := range map[string]string{"--tls-cert-file": "tls.crt", "--tls-key-file": "tls.key", "--tls-client-ca-file": "ca.crt"} {
		f := flagValue(args, flag)
		if vol := mountedVolume(pod, c, f); digString(vol, "secret", "secretName") != tlsSecret || filepath.Base(f) != key {
			t.Errorf("%s=%q is not the %s key of the mounted Secret %s", flag, f, key, tlsSecret)
		}
	}
	if got := flagValue(args, "--tls-client-allowed-sans"); got != testbed.ClientSAN {
		t.Errorf("--tls-client-allowed-sans=%q, want %s, the SAN of Envoy's client certificate", got, testbed.ClientSAN)
	}
	// The drain: the preStop sleep and --shutdown-grace fit in the termination grace period.
	grace, err := time.ParseDuration(flagValue(args, "--shutdown-grace"))
	if err != nil {
		t.Fatalf("--shutdown-grace: %v", err)
	}
	preStop, _ := dig(c, "lifecycle", "preStop", "sleep", "seconds").(float64)
	period, _ := dig(pod, "spec", "terminationGracePeriodSeconds").(float64)
	if preStop < 40 || period != 600 || time.Duration(preStop)*time.Second+grace != time.Duration(period-5)*time.Second {
		t.Errorf("preStop %vs + --shutdown-grace %v against terminationGracePeriodSeconds %v: want a sleep that outlasts cluster DNS's 30 s cache and Envoy's 5 s refresh, then the rest of 600 s but 5 s to flush", preStop, grace, period)
	}

	svc := find(t, ms, "Service", "pd-extproc")
	svcPorts := map[string]map[string]any{}
	for _, p := range dig(svc, "spec", "ports").([]any) {
		svcPorts[digString(p, "name")] = p.(map[string]any)
	}
	// The port serves TLS: appProtocol must not claim cleartext HTTP/2.
	if p := svcPorts["grpc"]; dig(p, "port") != 9002.0 || digString(p, "appProtocol") != "https" {
		t.Errorf("Service grpc port = %v; want 9002 with appProtocol https (TLS, HTTP/2 by ALPN)", p)
	}
	if p := svcPorts["metrics"]; dig(p, "port") != 9090.0 {
		t.Errorf("Service metrics port = %v, want 9090", p)
	}
	podLabels, _ := dig(pod, "metadata", "labels").(map[string]any)
	for _, sel := range []struct {
		what     string
		selector any
	}{
		{"Service", dig(svc, "spec", "selector")},
		{"PodDisruptionBudget", dig(find(t, ms, "PodDisruptionBudget", "pd-extproc"), "spec", "selector", "matchLabels")},
		{"Deployment", dig(dep, "spec", "selector", "matchLabels")},
	} {
		if !selects(sel.selector, podLabels) {
			t.Errorf("%s selector %v does not match the pod labels %v", sel.what, sel.selector, podLabels)
		}
	}
}

// sglangBlock: SGLang's KV events cut a prompt into its pages, one token each by default; the
// router looks requests up in blocks of 16 tokens, as vLLM's.
const sglangBlock = "--page-size=16"

// Each example engine pool is reachable through a headless Service (pools.<pool>.dns, the
// alternative to Kubernetes discovery, needs one name per pool that resolves to pod IPs) and
// starts the engine in its P/D role.
func TestEngineExamples(t *testing.T) {
	k8s := loadManifests(t, "config/k8s")
	defaults, err := extprocconfig.Unconfigured(defaultconfig.DefaultYAML)
	if err != nil {
		t.Fatal(err)
	}
	bootstrapPort := fmt.Sprint(defaults.Pools.Prefill.BootstrapPort)
	tests := []struct {
		file       string
		deployment string
		service    string
		wantArgs   []string                  // each must appear in command+args
		check      func(t *testing.T, c any) // engine-specific settings
	}{
		// The cached tokens in the answers, which response.rewrite_usage and the cache rule's check read.
		{"config/k8s/vllm-pd.yaml", "vllm-prefill", "vllm-prefill", []string{"--enable-prompt-tokens-details"}, checkNixl("kv_producer")},
		// The cache rule computes later turns' new tokens in the decode steps: a small step budget.
		{"config/k8s/vllm-pd.yaml", "vllm-decode", "vllm-decode", []string{"--max-num-seqs=128", "--max-num-batched-tokens=256", "--enable-prompt-tokens-details"}, checkNixl("kv_consumer")},
		// Without RDMA: the nixl backend with UCX over TCP runs on any pod network.
		{"config/k8s/sglang-pd.yaml", "sglang-prefill", "sglang-prefill",
			[]string{"--disaggregation-mode=prefill", "--disaggregation-bootstrap-port=" + bootstrapPort, "--disaggregation-transfer-backend=nixl", sglangBlock}, checkUCXOverTCP},
		{"config/k8s/sglang-pd.yaml", "sglang-decode", "sglang-decode",
			[]string{"--disaggregation-mode=decode", "--disaggregation-transfer-backend=nixl", sglangBlock}, checkUCXOverTCP},
	}
	for _, tc := range tests {
		t.Run(tc.deployment, func(t *testing.T) {
			dep := find(t, k8s, "Deployment", tc.deployment)
			c := dig(dep, "spec", "template", "spec", "containers").([]any)[0]
			cmd := append(toStrings(dig(c, "command")), toStrings(dig(c, "args"))...)
			for _, want := range tc.wantArgs {
				if !slices.Contains(cmd, want) {
					t.Errorf("command %v lacks %s", cmd, want)
				}
			}
			if tc.check != nil {
				tc.check(t, c)
			}
			svc := find(t, k8s, "Service", tc.service)
			if digString(svc, "spec", "clusterIP") != "None" {
				t.Errorf("Service %s is not headless (clusterIP: None)", tc.service)
			}
			labels, _ := dig(dep, "spec", "template", "metadata", "labels").(map[string]any)
			if !selects(dig(svc, "spec", "selector"), labels) {
				t.Errorf("Service %s does not select the %s pods", tc.service, tc.deployment)
			}
		})
	}

	// The Gateway route's backend Service must find the decode pods of either example.
	gwSvc := find(t, chartManifests(t, "envoy-gateway"), "Service", "pd-gateway-decode")
	for _, name := range []string{"vllm-decode", "sglang-decode"} {
		labels, _ := dig(find(t, k8s, "Deployment", name), "spec", "template", "metadata", "labels").(map[string]any)
		if !selects(dig(gwSvc, "spec", "selector"), labels) {
			t.Errorf("gateway Service pd-decode does not select the %s pods", name)
		}
	}
}

// checkNixl: the NixlConnector flag with the pool's role (vLLM deprecates kv_both for
// NixlConnector: NixlBaseConnector in vllm/backends/distributed/kv_transfer/kv_connector/v1/nixl/connector.py
// @ 055e47c2), and a side channel advertised on the pod IP (vLLM's default host, localhost, is
// unreachable from the other pool).
func checkNixl(role string) func(t *testing.T, c any) {
	return func(t *testing.T, c any) {
		t.Helper()
		args := toStrings(dig(c, "args"))
		i := slices.Index(args, "--kv-transfer-config")
		if i < 0 || i+1 >= len(args) {
			t.Fatalf("args %v lack --kv-transfer-config", args)
		}
		var ktc map[string]any
		if err := json.Unmarshal([]byte(args[i+1]), &ktc); err != nil {
			t.Fatalf("--kv-transfer-config is not JSON: %v", err)
		}
		if ktc["kv_connector"] != "NixlConnector" || ktc["kv_role"] != role {
			t.Errorf("--kv-transfer-config = %v, want NixlConnector with kv_role %s", ktc, role)
		}
		env := map[string]any{}
		for _, e := range dig(c, "env").([]any) {
			env[digString(e, "name")] = e
		}
		if got := digString(env["VLLM_NIXL_SIDE_CHANNEL_HOST"], "valueFrom", "fieldRef", "fieldPath"); got != "status.podIP" {
			t.Errorf("VLLM_NIXL_SIDE_CHANNEL_HOST comes from %q, want status.podIP", got)
		}
		if digString(env["VLLM_NIXL_SIDE_CHANNEL_PORT"], "value") == "" {
			t.Error("VLLM_NIXL_SIDE_CHANNEL_PORT is not set")
		}
	}
}

// checkUCXOverTCP: UCX restricted to TCP (and CUDA copies), which needs no RDMA device, and no
// RDMA resource asked for.
func checkUCXOverTCP(t *testing.T, c any) {
	t.Helper()
	ucx := ""
	for _, e := range dig(c, "env").([]any) {
		if digString(e, "name") == "UCX_TLS" {
			ucx = digString(e, "value")
		}
	}
	if ucx != "tcp,cuda_copy" {
		t.Errorf("UCX_TLS = %q, want tcp,cuda_copy", ucx)
	}
	if limits, _ := dig(c, "resources", "limits").(map[string]any); len(limits) != 1 || limits["nvidia.com/gpu"] == nil {
		t.Errorf("resources.limits = %v, want one GPU and no RDMA device", limits)
	}
}

// selects reports whether a label selector (a plain map) matches a label set.
func selects(selector any, labels map[string]any) bool {
	sel, ok := selector.(map[string]any)
	if !ok || len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}
