package deploy

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// headlessExtproc is the Service the Kubernetes Envoy resolves the pd-extproc pods by.
const headlessExtproc = "pd-extproc-headless.pd-extproc.svc.cluster.local"

// The Envoy of config/k8s/envoy.yaml runs config/envoy/envoy.yaml but for the ext_proc address
// (the headless Service of the pd-extproc pods), so every rule that file passes holds here too;
// it finds its certificate files and its bootstrap where it mounts them.
func TestKubernetesEnvoy(t *testing.T) {
	ms := loadManifests(t, "config/k8s")
	boot := digString(find(t, ms, "ConfigMap", "envoy"), "data", "envoy.yaml")
	shipped := string(mustRead(t, testbed.MustRepoPath(t, "config/envoy/envoy.yaml")))
	const composeAddr = "{address: extproc, port_value: 9002}"
	if want := strings.Replace(shipped, composeAddr, "{address: "+headlessExtproc+", port_value: 9002}", 1); !sameYAML(t, boot, want) {
		t.Errorf("the ConfigMap's envoy.yaml is not config/envoy/envoy.yaml with the ext_proc address %s", headlessExtproc)
	}
	js, err := yaml.YAMLToJSON([]byte(boot))
	if err != nil {
		t.Fatal(err)
	}
	r := checkEnvoyBootstrapJSON(js, defaultServiceLimits(t))
	for _, e := range r.errs {
		t.Error(e)
	}

	dep := find(t, ms, "Deployment", "envoy")
	pod := dig(dep, "spec", "template")
	c := dig(pod, "spec", "containers").([]any)[0]
	args := toStrings(dig(c, "args"))
	cfg := ""
	for i, a := range args {
		if a == "-c" && i+1 < len(args) {
			cfg = args[i+1]
		}
	}
	if vol := mountedVolume(pod, c, cfg); digString(vol, "configMap", "name") != "envoy" || !strings.HasSuffix(cfg, "/envoy.yaml") {
		t.Errorf("-c %q is not the envoy.yaml key of the mounted ConfigMap envoy", cfg)
	}
	path := filepath.Join(t.TempDir(), "envoy.yaml")
	if err := os.WriteFile(path, []byte(boot), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, f := range extProcTLSFiles(t, path) { // the emulator must load the bootstrap
		if vol := mountedVolume(pod, c, f); digString(vol, "secret", "secretName") != "pd-extproc-client-tls" {
			t.Errorf("the bootstrap reads %s, which is not in the mounted Secret pd-extproc-client-tls", f)
		}
	}

	// The headless Service finds the pd-extproc pods on their grpc port.
	svc := find(t, ms, "Service", "pd-extproc-headless")
	labels, _ := dig(find(t, ms, "Deployment", "pd-extproc"), "spec", "template", "metadata", "labels").(map[string]any)
	if digString(svc, "spec", "clusterIP") != "None" || !selects(dig(svc, "spec", "selector"), labels) {
		t.Errorf("Service pd-extproc-headless is not a headless Service of the pd-extproc pods: %v", dig(svc, "spec"))
	}
	// The NetworkPolicy admits these pods to pd-extproc.
	envoyLabels, _ := dig(pod, "metadata", "labels").(map[string]any)
	np := find(t, ms, "NetworkPolicy", "pd-extproc")
	from := dig(dig(np, "spec", "ingress").([]any)[0], "from").([]any)[0]
	if !selects(dig(from, "podSelector", "matchLabels"), envoyLabels) {
		t.Errorf("the NetworkPolicy does not admit the Envoy pods %v", envoyLabels)
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
