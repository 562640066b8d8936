package deploy

import (
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/internal/chart"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
	extprocconfig "github.com/pd-extproc/pd-extproc/pkg/config"
)

var renderings sync.Map // example name -> []manifest

// chartManifests renders the chart for the example of that name (internal/chart.Examples), as
// `helm template` would, once per test binary.
func chartManifests(t *testing.T, name string) []manifest {
	t.Helper()
	if ms, ok := renderings.Load(name); ok {
		return ms.([]manifest)
	}
	ex := example(t, name)
	values, err := ex.ValuesMap()
	if err != nil {
		t.Fatal(err)
	}
	ms := render(t, ex, values)
	renderings.Store(name, ms)
	return ms
}

// render renders the chart as `helm template` would, for ex's release with values, each
// object named after its template and the example.
func render(t *testing.T, ex chart.Example, values map[string]any) []manifest {
	t.Helper()
	out, err := chart.Render(testbed.MustRepoPath(t, chart.Dir), ex.Release, values)
	if err != nil {
		t.Fatalf("rendering the chart with the %s values: %v", ex.Name, err)
	}
	var ms []manifest
	source := ""
	for i, part := range splitYAML(out) {
		if src := regexp.MustCompile(`(?m)^# Source: (\S+)`).FindSubmatch(part); src != nil {
			source = string(src[1]) // the template's first document; the others follow it
		}
		var doc map[string]any
		if err := yaml.Unmarshal(part, &doc); err != nil {
			t.Fatalf("%s rendering, document %d: %v\n%s", ex.Name, i, err, part)
		}
		if doc != nil {
			ms = append(ms, manifest{file: fmt.Sprintf("%s (%s)", source, ex.Name), doc: doc})
		}
	}
	return ms
}

func example(t *testing.T, name string) chart.Example {
	t.Helper()
	for _, ex := range chart.Examples {
		if ex.Name == name {
			return ex
		}
	}
	t.Fatalf("no chart example %q", name)
	return chart.Example{}
}

// Every value set renders objects that name themselves, live in the release's namespace (the
// GatewayClass aside; the Roles of rbac.extraNamespaces, and the HTTPRoute's decode Service and
// its ReferenceGrant, where the decode pods are) and appear once; the config it renders loads with pd-extproc's own parser
// (an unknown key would otherwise surface only when the pod crash-loops); and helm lint's checks
// find nothing to warn about.
func TestChartRendersEachValueSet(t *testing.T) {
	for _, ex := range chart.Examples {
		t.Run(ex.Name, func(t *testing.T) {
			ms := chartManifests(t, ex.Name)
			seen := map[string]string{}
			for _, m := range ms {
				id := fmt.Sprintf("%s %s/%s", digString(m.doc, "apiVersion"), m.kind(), m.name())
				if digString(m.doc, "apiVersion") == "" || m.kind() == "" || m.name() == "" {
					t.Errorf("%s: object without apiVersion, kind or metadata.name: %v", m.file, m.doc)
				}
				ns := digString(m.doc, "metadata", "namespace")
				if wantNS := ex.Release.Namespace; clusterScoped[m.kind()] != (ns == "") || (ns != "" && ns != wantNS && !elsewhere(m)) {
					t.Errorf("%s: %s has namespace %q; want %q (or none for cluster-scoped kinds)", m.file, id, ns, wantNS)
				}
				if prev, dup := seen[id+ns]; dup {
					t.Errorf("%s: %s is also rendered by %s", m.file, id, prev)
				}
				seen[id+ns] = m.file
			}
			cfg := digString(find(t, ms, "ConfigMap", fullname(ex)), "data", "extproc.yaml")
			if _, err := extprocconfig.Parse([]byte(cfg)); err != nil {
				t.Errorf("the rendered config: %v\n%s", err, cfg)
			}
			values, err := ex.ValuesMap()
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range chart.Lint(testbed.MustRepoPath(t, chart.Dir), values) {
				t.Errorf("helm lint: %s", m)
			}
		})
	}
}

// elsewhere is whether the chart may render m outside the release's namespace: the Roles of
// rbac.extraNamespaces, and the decode Service of the Envoy Gateway route with its
// ReferenceGrant, in the decode pods' namespace.
func elsewhere(m manifest) bool {
	switch m.kind() {
	case "Role", "RoleBinding", "ReferenceGrant":
		return true
	case "Service":
		return strings.HasSuffix(m.name(), "-decode")
	}
	return false
}

// fullname is the release's full name the chart gives its objects.
func fullname(ex chart.Example) string {
	if strings.Contains(ex.Release.Name, "pd-extproc") {
		return ex.Release.Name
	}
	return ex.Release.Name + "-pd-extproc"
}

// The chart's copies of the Envoy bootstrap and its SDS files are the shipped ones, which e2e
// runs through the emulator and compose mounts: a Helm chart reads nothing outside its directory.
func TestChartFilesAreTheShippedOnes(t *testing.T) {
	for copied, shipped := range map[string]string{
		"files/envoy.yaml":           "config/envoy/envoy.yaml",
		"files/sds/client-cert.yaml": "config/envoy/sds/client-cert.yaml",
		"files/sds/trusted-ca.yaml":  "config/envoy/sds/trusted-ca.yaml",
	} {
		got := mustRead(t, testbed.MustRepoPath(t, filepath.Join(chart.Dir, copied)))
		if want := mustRead(t, testbed.MustRepoPath(t, shipped)); string(got) != string(want) {
			t.Errorf("%s/%s differs from %s: copy it again", chart.Dir, copied, shipped)
		}
	}
	sds, _ := filepath.Glob(testbed.MustRepoPath(t, "config/envoy/sds/*.yaml"))
	copies, _ := filepath.Glob(testbed.MustRepoPath(t, filepath.Join(chart.Dir, "files/sds/*.yaml")))
	if len(sds) != len(copies) {
		t.Errorf("config/envoy/sds has %d files, the chart's files/sds %d", len(sds), len(copies))
	}
}

// The chart's README documents every value of values.yaml, with its default, and no other: a
// value is a row, or lies under one (a map documented whole, such as config).
func TestChartValuesAreDocumented(t *testing.T) {
	var values map[string]any
	if err := yaml.Unmarshal(mustRead(t, testbed.MustRepoPath(t, filepath.Join(chart.Dir, "values.yaml"))), &values); err != nil {
		t.Fatal(err)
	}
	readme := string(mustRead(t, testbed.MustRepoPath(t, filepath.Join(chart.Dir, "README.md"))))
	rows := map[string]string{} // key -> default cell
	for _, m := range regexp.MustCompile("(?m)^\\| `([a-zA-Z0-9_.]+)` \\| ([^|]*) \\|").FindAllStringSubmatch(readme, -1) {
		rows[m[1]] = strings.TrimSpace(m[2])
	}
	if len(rows) < 30 {
		t.Fatalf("the chart's README documents %d values", len(rows))
	}
	for key, cell := range rows {
		v, ok := lookup(values, key)
		if !ok {
			t.Errorf("README documents %s, which values.yaml lacks", key)
			continue
		}
		js, err := yaml.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		want := "`" + strings.TrimSpace(string(flowYAML(t, js))) + "`"
		if strings.HasPrefix(cell, "`") && cell != want {
			t.Errorf("README gives %s the default %s; values.yaml says %s", key, cell, want)
		}
	}
	for _, leaf := range leaves(values, "") {
		if !slices.ContainsFunc(slices.Collect(func(yield func(string) bool) {
			for k := range rows {
				yield(k)
			}
		}), func(k string) bool { return leaf == k || strings.HasPrefix(leaf, k+".") }) {
			t.Errorf("values.yaml has %s, which the README's table does not document", leaf)
		}
	}
}

// lookup walks a dotted key through nested maps.
func lookup(v any, key string) (any, bool) {
	for _, k := range strings.Split(key, ".") {
		m, ok := v.(map[string]any)
		if !ok {
			return nil, false
		}
		if v, ok = m[k]; !ok {
			return nil, false
		}
	}
	return v, true
}

// leaves are the dotted keys of every value that is not a non-empty map.
func leaves(v any, prefix string) []string {
	m, ok := v.(map[string]any)
	if !ok || len(m) == 0 {
		return []string{prefix}
	}
	var out []string
	for k, sub := range m {
		p := k
		if prefix != "" {
			p = prefix + "." + k
		}
		out = append(out, leaves(sub, p)...)
	}
	return out
}

// flowYAML writes a value as the README's default column does: JSON, which is YAML in flow style.
func flowYAML(t *testing.T, y []byte) []byte {
	t.Helper()
	js, err := yaml.YAMLToJSON(y)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// make release-dry-run packages the chart with the repository's version and the release's image.
func TestChartPackagesWithTheVersion(t *testing.T) {
	dir := t.TempDir()
	path, err := chart.Package(testbed.MustRepoPath(t, chart.Dir), "v1.2.3-4-gabcdef0", "registry.example.com/pd-extproc", dir)
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(path) != "pd-extproc-1.2.3-4-gabcdef0.tgz" {
		t.Errorf("package %s, want pd-extproc-1.2.3-4-gabcdef0.tgz", path)
	}
	out, err := chart.Render(path, chart.Release{Name: "pd-extproc", Namespace: "pd-extproc"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), "image: registry.example.com/pd-extproc:v1.2.3-4-gabcdef0\n") {
		t.Error("the packaged chart does not run registry.example.com/pd-extproc:v1.2.3-4-gabcdef0 by default")
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatal(err)
	}
	for version, want := range map[string]string{"v0.1.0": "0.1.0", "v0.1.0-dirty": "0.1.0-dirty", "fb1a0fb": "0.0.0-fb1a0fb", "dev": "0.0.0-dev"} {
		if got := chart.ChartVersion(version); got != want {
			t.Errorf("ChartVersion(%q) = %q, want %q", version, got, want)
		}
	}
}

// Envoy reads its bootstrap once, at start: a values change that changes it (the ext_proc
// port, here) must change the Envoy pod template too, so that helm upgrade rolls the pods onto
// it instead of leaving them dialling the old port.
func TestABootstrapChangeRollsEnvoy(t *testing.T) {
	ex := example(t, "defaults")
	podTemplate := func(values map[string]any) any {
		out, err := chart.Render(testbed.MustRepoPath(t, chart.Dir), ex.Release, values)
		if err != nil {
			t.Fatal(err)
		}
		for _, part := range splitYAML(out) {
			var doc map[string]any
			if err := yaml.Unmarshal(part, &doc); err != nil {
				t.Fatal(err)
			}
			if digString(doc, "kind") == "Deployment" && strings.HasSuffix(digString(doc, "metadata", "name"), "-envoy") {
				return dig(doc, "spec", "template")
			}
		}
		t.Fatal("no Envoy Deployment rendered")
		return nil
	}
	values, err := ex.ValuesMap()
	if err != nil {
		t.Fatal(err)
	}
	before := podTemplate(values)
	values["ports"] = map[string]any{"grpc": 9443, "metrics": 9090}
	if after := podTemplate(values); reflect.DeepEqual(before, after) {
		t.Error("ports.grpc changed the Envoy bootstrap but not its pod template: the pods keep the old port")
	}
}

// The chart refuses values that render objects which cannot run, saying what to change: a
// PodDisruptionBudget that keeps as many pods as the Deployment runs, by count or by percentage,
// blocks every node drain (kubectl drain waits for ever on a healthy pod), and a pool's default
// KV events under another policy than prefix-affinity is a config the pods refuse. One replica
// without a budget renders.
func TestChartRefusesValuesThatCannotRun(t *testing.T) {
	ex := example(t, "defaults")
	for _, tt := range []struct {
		name string
		set  func(v map[string]any)
		want string // "" renders
	}{
		{"one pd-extproc replica", func(v map[string]any) { v["replicas"] = 1 }, "podDisruptionBudget.enabled=false"},
		{"one replica, no budget", func(v map[string]any) {
			v["replicas"] = 1
			v["podDisruptionBudget"] = map[string]any{"enabled": false, "minAvailable": 1}
		}, ""},
		{"one Envoy", func(v map[string]any) { v["envoy"].(map[string]any)["replicas"] = 1 }, "envoy.podDisruptionBudget.enabled=false"},
		// Kubernetes rounds a percentage up (pkg/controller/disruption): half of one pod is one.
		{"one pd-extproc replica, half of it kept", func(v map[string]any) {
			v["replicas"] = 1
			v["podDisruptionBudget"] = map[string]any{"minAvailable": "50%"}
		}, "podDisruptionBudget.enabled=false"},
		{"two Envoys, all of them kept", func(v map[string]any) {
			v["envoy"].(map[string]any)["podDisruptionBudget"] = map[string]any{"minAvailable": "100%"}
		}, "envoy.podDisruptionBudget.enabled=false"},
		{"two pd-extproc replicas, half of them kept", func(v map[string]any) {
			v["podDisruptionBudget"] = map[string]any{"minAvailable": "50%"}
		}, ""},
		{"three Envoys, two thirds of them kept", func(v map[string]any) {
			v["envoy"].(map[string]any)["replicas"] = 3
			v["envoy"].(map[string]any)["podDisruptionBudget"] = map[string]any{"minAvailable": "66%"}
		}, ""},
		{"the decode pool by least load, its default KV events kept", func(v map[string]any) {
			v["config"] = map[string]any{"pools": map[string]any{"decode": map[string]any{"policy": "least-load"}}}
		}, "config.pools.decode.kv_events needs config.pools.decode.policy: prefix-affinity"},
		{"the decode pool by least load, its KV events dropped", func(v map[string]any) {
			v["config"] = map[string]any{"pools": map[string]any{"decode": map[string]any{"policy": "least-load", "kv_events": nil}}}
		}, ""},
		{"bodies larger than the buffers that hold them", func(v map[string]any) {
			v["config"] = map[string]any{"limits": map[string]any{"max_body_bytes": 134217728}}
		}, "config.limits.max_buffered_bytes (100663296) is below config.limits.max_body_bytes (134217728)"},
		{"larger bodies, larger buffers", func(v map[string]any) {
			v["config"] = map[string]any{"limits": map[string]any{"max_body_bytes": 134217728, "max_buffered_bytes": 402653184}}
		}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			values, err := ex.ValuesMap()
			if err != nil {
				t.Fatal(err)
			}
			if values["envoy"] == nil {
				values["envoy"] = map[string]any{}
			}
			tt.set(values)
			_, err = chart.Render(testbed.MustRepoPath(t, chart.Dir), ex.Release, values)
			if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
				t.Errorf("render: %v, want %q", err, cmp.Or(tt.want, "no error"))
			}
		})
	}
}

// With neither the chart's Envoy nor Envoy Gateway in front, networkPolicy.envoyFrom admits the
// operator's own Envoy to the gRPC port, and nothing else does.
func TestNetworkPolicyAdmitsYourOwnEnvoy(t *testing.T) {
	ex := example(t, "defaults")
	own := map[string]any{"podSelector": map[string]any{"matchLabels": map[string]any{"app": "edge-envoy"}}}
	for _, tt := range []struct {
		name  string
		from  []any
		peers int // admitted to the gRPC port
	}{
		{"no Envoy in front", nil, 0},
		{"your own Envoy", []any{own}, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			values, err := ex.ValuesMap()
			if err != nil {
				t.Fatal(err)
			}
			values["envoy"] = map[string]any{"enabled": false}
			values["gateway"] = map[string]any{"enabled": false}
			values["networkPolicy"] = map[string]any{"envoyFrom": tt.from}
			peers := 0
			for _, m := range render(t, ex, values) {
				if m.kind() != "NetworkPolicy" {
					continue
				}
				for _, rule := range dig(m.doc, "spec", "ingress").([]any) {
					ports, _ := dig(rule, "ports").([]any)
					if len(ports) > 0 && fmt.Sprint(dig(ports[0], "port")) == "grpc" {
						peers += len(dig(rule, "from").([]any))
					}
				}
			}
			if peers != tt.peers {
				t.Errorf("%d peers admitted to the gRPC port, want %d", peers, tt.peers)
			}
		})
	}
}

// No NetworkPolicy, in the engine examples or any chart value set, admits a peer by its pod
// labels in every namespace: anyone who can create a pod anywhere could label it so and reach
// the engines' whole HTTP API, or pd-extproc's admin port. A peer with a podSelector names its
// namespace.
func TestNetworkPoliciesNameThePeersNamespace(t *testing.T) {
	ms := loadManifests(t, "config/k8s")
	for _, ex := range chart.Examples {
		ms = append(ms, chartManifests(t, ex.Name)...)
	}
	policies := 0
	for _, m := range ms {
		if m.kind() != "NetworkPolicy" {
			continue
		}
		policies++
		rules, _ := dig(m.doc, "spec", "ingress").([]any)
		for _, rule := range rules {
			peers, _ := dig(rule, "from").([]any)
			for _, peer := range peers {
				ns, hasNS := dig(peer, "namespaceSelector").(map[string]any)
				if dig(peer, "podSelector") != nil && hasNS && len(ns) == 0 {
					t.Errorf("%s: NetworkPolicy %s admits pods labelled %v from every namespace", m.file, m.name(), dig(peer, "podSelector"))
				}
			}
		}
	}
	if policies == 0 {
		t.Fatal("no NetworkPolicy found: the test shows nothing")
	}
}

// With Envoy's Service published (type LoadBalancer or NodePort), it carries the client port
// alone: the stats port, for Prometheus only, stays on a ClusterIP Service of its own, where
// the ServiceMonitor finds it.
func TestAPublishedEnvoyServiceCarriesTheClientPortAlone(t *testing.T) {
	ex := example(t, "defaults")
	for _, typ := range []string{"ClusterIP", "LoadBalancer", "NodePort"} {
		t.Run(typ, func(t *testing.T) {
			values, err := ex.ValuesMap()
			if err != nil {
				t.Fatal(err)
			}
			values["envoy"] = map[string]any{"service": map[string]any{"type": typ}}
			stats := 0
			for _, m := range render(t, ex, values) {
				doc := m.doc
				if m.kind() != "Service" || dig(doc, "metadata", "labels", "app.kubernetes.io/name") != "envoy" {
					continue
				}
				for _, port := range dig(doc, "spec", "ports").([]any) {
					name := digString(port, "name")
					switch {
					case name == "stats" && digString(doc, "spec", "type") != "ClusterIP":
						t.Errorf("Service %s of type %s publishes the stats port", digString(doc, "metadata", "name"), digString(doc, "spec", "type"))
					case name == "stats":
						stats++
					}
				}
			}
			if stats != 1 {
				t.Errorf("%d ClusterIP Services carry Envoy's stats port, want 1", stats)
			}
		})
	}
}

// On the Envoy Gateway path the chart's monitoring scrapes Envoy Gateway's proxies of its
// Gateway, where the Envoy alerts (decode overflow, certificate expiry) read: a PodMonitor on
// their metrics port in the proxies' namespace, selecting the pods Envoy Gateway labels with the
// Gateway they serve.
func TestTheGatewaysProxiesAreScraped(t *testing.T) {
	ex := example(t, "envoy-gateway")
	values, err := ex.ValuesMap()
	if err != nil {
		t.Fatal(err)
	}
	values["monitoring"] = map[string]any{"serviceMonitor": map[string]any{"enabled": true}}
	gateway := digString(values, "gateway", "name")
	if gateway == "" {
		gateway = "pd-gateway" // the chart's default
	}
	found := 0
	for _, m := range render(t, ex, values) {
		doc := m.doc
		if m.kind() != "PodMonitor" {
			continue
		}
		found++
		if got := digString(doc, "spec", "selector", "matchLabels", "gateway.envoyproxy.io/owning-gateway-name"); got != gateway {
			t.Errorf("PodMonitor selects the proxies of Gateway %q, want %q", got, gateway)
		}
		if got := fmt.Sprint(dig(doc, "spec", "namespaceSelector", "matchNames")); got != "[envoy-gateway-system]" {
			t.Errorf("PodMonitor looks in namespaces %s, want [envoy-gateway-system]", got)
		}
		if got := digString(dig(doc, "spec", "podMetricsEndpoints").([]any)[0], "port"); got != "metrics" {
			t.Errorf("PodMonitor scrapes port %q, want metrics (19001)", got)
		}
	}
	if found != 1 {
		t.Errorf("%d PodMonitors, want 1", found)
	}
}

// engineAPIKey and engineCA mount their Secrets' keys at the very files the rendered config names (both pools' key files; the ca_file of each enabled tls block), unless the config names
// a file of its own; engineCA with no tls block enabled is refused.
func TestTheEnginesSecretsAreMountedWhereTheConfigReadsThem(t *testing.T) {
	ex := example(t, "everything")
	ms := chartManifests(t, ex.Name)
	var cfg extprocconfig.Config
	if err := yaml.Unmarshal([]byte(digString(find(t, ms, "ConfigMap", fullname(ex)), "data", "extproc.yaml")), &cfg); err != nil {
		t.Fatal(err)
	}
	pod := dig(find(t, ms, "Deployment", fullname(ex)), "spec", "template", "spec")
	tests := []struct {
		volume, secret, key string
		files               map[string]string // config key -> the file it names
	}{
		{"engine-api-key", "engine-api-key", "key", map[string]string{
			"prefill.api_key_file": cfg.Prefill.APIKeyFile, "pools.decode.api_key_file": cfg.Pools.Decode.APIKeyFile}},
		{"engine-ca", "engine-ca", "ca.crt", map[string]string{
			"prefill.tls.ca_file": cfg.Prefill.TLS.CAFile, "pools.decode.tls.ca_file": cfg.Pools.Decode.TLS.CAFile}},
	}
	for _, tc := range tests {
		var mountedAt, secret, key, path string
		for _, c := range dig(pod, "containers").([]any) {
			for _, m := range dig(c, "volumeMounts").([]any) {
				if digString(m, "name") == tc.volume {
					mountedAt = digString(m, "mountPath")
				}
			}
		}
		for _, v := range dig(pod, "volumes").([]any) {
			if digString(v, "name") == tc.volume {
				secret = digString(v, "secret", "secretName")
				item := dig(v, "secret", "items").([]any)[0]
				key, path = digString(item, "key"), digString(item, "path")
			}
		}
		if secret != tc.secret || key != tc.key || mountedAt == "" {
			t.Errorf("%s: the Secret %s's key %s is not mounted: secret %q, key %q, at %q", tc.volume, tc.secret, tc.key, secret, key, mountedAt)
			continue
		}
		for name, file := range tc.files {
			if want := filepath.Join(mountedAt, path); file != want {
				t.Errorf("%s is %q, but the key %s is mounted at %s", name, file, tc.key, want)
			}
		}
	}

	values, err := ex.ValuesMap()
	if err != nil {
		t.Fatal(err)
	}
	config := values["config"].(map[string]any)
	config["prefill"] = map[string]any{"api_key_file": "/keys/prefill", "tls": map[string]any{"enabled": true, "ca_file": "/cas/prefill.pem"}}
	for _, m := range render(t, ex, values) {
		if m.kind() == "ConfigMap" && m.name() == fullname(ex) {
			for _, own := range []string{"api_key_file: /keys/prefill", "ca_file: /cas/prefill.pem"} {
				if got := digString(m.doc, "data", "extproc.yaml"); !strings.Contains(got, own) {
					t.Errorf("the config's own %s was replaced:\n%s", own, got)
				}
			}
		}
	}
	config["prefill"] = map[string]any{}
	config["pools"].(map[string]any)["decode"].(map[string]any)["tls"] = nil
	if _, err := chart.Render(testbed.MustRepoPath(t, chart.Dir), ex.Release, values); err == nil || !strings.Contains(err.Error(), "engineCA.secretName is set, but neither") {
		t.Errorf("engineCA with no tls block enabled: %v, want the chart's refusal", err)
	}
}

// A string value the templates put in the Envoy's command line reaches it as that string, even
// where YAML 1.1, which Helm and kubectl read manifests with, takes the bare word for a boolean:
// Envoy's log level off rendered bare was false, and the API server refused the Deployment
// (args[3]: expected string, got false).
func TestStringValuesStayStrings(t *testing.T) {
	ex := example(t, "defaults")
	for _, level := range []string{"off", "info"} {
		t.Run("envoy.logLevel="+level, func(t *testing.T) {
			values, err := ex.ValuesMap()
			if err != nil {
				t.Fatal(err)
			}
			values["envoy"] = map[string]any{"logLevel": level}
			c := dig(find(t, render(t, ex, values), "Deployment", "pd-extproc-envoy"), "spec", "template", "spec", "containers").([]any)[0]
			args, _ := dig(c, "args").([]any)
			for _, arg := range args {
				if _, ok := arg.(string); !ok {
					t.Errorf("argument %v is a %T, not a string: the API server refuses the Deployment", arg, arg)
				}
			}
			if !slices.ContainsFunc(args, func(a any) bool { return a == level }) {
				t.Errorf("no argument %q in %v", level, args)
			}
		})
	}
}

// The HTTPRoute's backend Service, which Envoy Gateway needs ready endpoints behind to build a
// route the EnvoyPatchPolicy can point at the ORIGINAL_DST cluster (with none it installs a
// fixed 503 and the patch finds no cluster to replace), lives where the decode pods are: a
// Service selects pods of its own namespace only. With the decode pool discovered in another
// namespace it goes there, with a ReferenceGrant that lets the HTTPRoute name it, and Envoy
// Gateway resolves the reference.
func TestTheRoutesBackendSelectsTheDecodePods(t *testing.T) {
	ex := example(t, "envoy-gateway")
	for _, tt := range []struct {
		name   string
		values string
		ns     string // where the backend Service must be
	}{
		{"decode pods in the release's namespace", ``, "pd-extproc"},
		{"decode pool discovered in another namespace", `
config: {pools: {decode: {kubernetes: {namespace: engines}}}}
rbac: {extraNamespaces: [engines]}
`, "engines"},
		{"the Service's namespace given", `
config: {pools: {decode: {kubernetes: null, dns: "vllm-decode.engines.svc.cluster.local:8000"}}}
gateway: {decodeService: {namespace: engines}}
`, "engines"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			values, err := ex.ValuesMap()
			if err != nil {
				t.Fatal(err)
			}
			var more map[string]any
			if err := yaml.Unmarshal([]byte(tt.values), &more); err != nil {
				t.Fatal(err)
			}
			maps.Copy(values, more)
			values["envoy"] = map[string]any{"enabled": false}
			values["gateway"] = merged(map[string]any{"enabled": true}, values["gateway"])
			ms := render(t, ex, values)
			route := find(t, ms, "HTTPRoute", "pd-gateway-inference")
			ref := dig(route, "spec", "rules").([]any)[0].(map[string]any)["backendRefs"].([]any)[0]
			ns := cmp.Or(digString(ref, "namespace"), digString(route, "metadata", "namespace"))
			if ns != tt.ns {
				t.Errorf("the route's backend is in namespace %q, want %q, where the decode pods are", ns, tt.ns)
			}
			var svc, grant map[string]any
			for _, m := range ms {
				switch {
				case m.kind() == "Service" && m.name() == digString(ref, "name") && digString(m.doc, "metadata", "namespace") == ns:
					svc = m.doc
				case m.kind() == "ReferenceGrant" && digString(m.doc, "metadata", "namespace") == ns:
					grant = m.doc
				}
			}
			if svc == nil {
				t.Fatalf("no Service %s/%s rendered for the route's backend", ns, digString(ref, "name"))
			}
			if ns != ex.Release.Namespace && grant == nil {
				t.Errorf("no ReferenceGrant in %s lets the HTTPRoute of %s name its backend", ns, ex.Release.Namespace)
			}
			egctl := testbed.FindTool("egctl")
			if egctl == "" {
				t.Skip("egctl not found: `make tools`")
			}
			stream := fmt.Appendf(nil, "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: %s}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: engines}\n", ex.Release.Namespace)
			for _, m := range ms {
				if !strings.HasPrefix(digString(m.doc, "apiVersion"), "cert-manager.io/") {
					doc, err := yaml.Marshal(m.doc)
					if err != nil {
						t.Fatal(err)
					}
					stream = append(append(stream, "---\n"...), doc...)
				}
			}
			res, err := translateGateway(t, egctl, append(stream, clientTLSSecret(t)...))
			if err != nil {
				t.Fatal(err)
			}
			var r report
			checkGatewayStatus(res, &r)
			for _, e := range r.errs {
				t.Error(e)
			}
		})
	}
}

// merged is a copy of over's keys over base's, base a map or nil.
func merged(over map[string]any, base any) map[string]any {
	out := map[string]any{}
	if b, ok := base.(map[string]any); ok {
		maps.Copy(out, b)
	}
	maps.Copy(out, over)
	return out
}

// Any release name Helm takes (at most 53 characters: a DNS subdomain, so digits first and dots
// allowed), in any namespace, renders names the API server and cert-manager accept: Services are
// RFC 1035 labels (a letter first, at most 63 characters), other objects DNS subdomains, the
// certificates' DNS names hostnames and their common names at most 64 characters (X.509's
// bound); and the release name and namespace are strings wherever they stand, never numbers.
func TestChartNamesFitAnyRelease(t *testing.T) {
	values := map[string]any{
		"gateway":    map[string]any{"enabled": true},
		"monitoring": map[string]any{"serviceMonitor": map[string]any{"enabled": true}, "dashboard": map[string]any{"enabled": true}},
	}
	for _, rel := range []chart.Release{
		{Name: "inference-router-for-the-llama-fleet-in-europe-west4", Namespace: "pd-extproc"}, // 52 characters
		{Name: "router-with-pd-extproc-in-its-name-and-forty-four-x", Namespace: "pd-extproc"},  // 51, kept whole: it holds pd-extproc
		{Name: "2026", Namespace: "pd-extproc"},
		{Name: "router.v2", Namespace: "pd-extproc"},
		{Name: "pd-extproc", Namespace: "2026"},
	} {
		t.Run(rel.Name+" in "+rel.Namespace, func(t *testing.T) {
			ms := render(t, chart.Example{Name: rel.Name, Release: rel}, values)
			bare := regexp.MustCompile(`[:\[,](` + regexp.QuoteMeta(rel.Name) + "|" + regexp.QuoteMeta(rel.Namespace) + `)[,\]}]`)
			for _, m := range ms {
				if js, _ := json.Marshal(m.doc); bare.Match(js) {
					t.Errorf("%s %s: the release name or namespace is rendered as a number, where the API server takes a string", m.kind(), m.name())
				}
				check, rule := validation.IsDNS1123Subdomain, "a DNS subdomain"
				if m.kind() == "Service" {
					check, rule = validation.IsDNS1035Label, "an RFC 1035 label"
				}
				if errs := check(m.name()); errs != nil {
					t.Errorf("%s %q is not %s: %v", m.kind(), m.name(), rule, errs)
				}
				if m.kind() != "Certificate" {
					continue
				}
				if cn := digString(m.doc, "spec", "commonName"); len(cn) > 64 {
					t.Errorf("Certificate %s: commonName %q is %d characters, over 64", m.name(), cn, len(cn))
				}
				names, _ := dig(m.doc, "spec", "dnsNames").([]any)
				for _, n := range names {
					for _, label := range strings.Split(n.(string), ".") {
						if errs := validation.IsDNS1123Label(label); errs != nil {
							t.Errorf("Certificate %s: DNS name %q: %v", m.name(), n, errs)
						}
					}
				}
			}
		})
	}
}
