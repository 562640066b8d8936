package k8s

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"

	"github.com/pd-extproc/pd-extproc/internal/chart"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// loadManifests reads every object of the YAML files that match pattern
// (repository-relative, or absolute), in file order.
func loadManifests(t testing.TB, pattern string) []*unstructured.Unstructured {
	t.Helper()
	abs, err := testbed.RepoPath(pattern)
	if err != nil {
		t.Fatal(err)
	}
	paths, err := filepath.Glob(abs)
	if err != nil || len(paths) == 0 {
		t.Fatalf("no files match %s: %v", pattern, err)
	}
	var out []*unstructured.Unstructured
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		objs, err := decodeObjects(data)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		out = append(out, objs...)
	}
	return out
}

// chartObjects renders the chart for an install of rel with values over values.yaml, as
// `helm template` does, into objects.
func chartObjects(t testing.TB, rel chart.Release, values map[string]any) []*unstructured.Unstructured {
	t.Helper()
	out, err := chart.Render(testbed.MustRepoPath(t, chart.Dir), rel, values)
	if err != nil {
		t.Fatalf("rendering the chart: %v", err)
	}
	objs, err := decodeObjects(out)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// decodeObjects splits a YAML stream into objects; empty documents are skipped.
func decodeObjects(data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var out []*unstructured.Unstructured
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, err
		}
		if len(obj) > 0 {
			out = append(out, &unstructured.Unstructured{Object: obj})
		}
	}
}

// resource is where obj lives in the API.
func (c *cluster) resource(obj *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := obj.GroupVersionKind()
	m, err := c.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if meta.IsNoMatchError(err) {
		c.mapper.Reset() // a CRD installed since the last discovery
		m, err = c.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	}
	if err != nil {
		return nil, err
	}
	if m.Scope.Name() == meta.RESTScopeNameRoot {
		return c.dyn.Resource(m.Resource), nil
	}
	return c.dyn.Resource(m.Resource).Namespace(obj.GetNamespace()), nil
}

// create creates obj for real.
func (c *cluster) create(t testing.TB, obj *unstructured.Unstructured) {
	t.Helper()
	r, err := c.resource(obj)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Create(context.Background(), obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("creating %s %s: %v", obj.GetKind(), obj.GetName(), err)
	}
}

// dryRunApply applies obj with server-side apply and dryRun=All: admission,
// schema, CEL rules and defaulting all run, nothing is stored.
func (c *cluster) dryRunApply(obj *unstructured.Unstructured) error {
	r, err := c.resource(obj)
	if err != nil {
		return err
	}
	_, err = r.Apply(context.Background(), obj.GetName(), obj, metav1.ApplyOptions{FieldManager: "pd-extproc-test", Force: true, DryRun: []string{metav1.DryRunAll}})
	return err
}

// The CRDs the shipped manifests and the chart use, from the modules that
// publish them (egctl's dependencies for Gateway API and Envoy Gateway, ours
// for InferencePool, cert-manager's and the Prometheus Operator's own
// modules), never copies in this repository.
var crdSources = []struct {
	module, dir string
	stripHelm   bool // Envoy Gateway's chart templates open and close with Helm lines
}{
	{"sigs.k8s.io/gateway-api-inference-extension@v1.6.0", "config/crd/bases", false},
	{"sigs.k8s.io/gateway-api@v1.6.1", "config/crd/standard", false},
	{"github.com/envoyproxy/gateway@v1.9.1", "charts/gateway-crds-helm/templates/generated", true},
	{"github.com/cert-manager/cert-manager@v1.21.2", "deploy/crds", false},
	{"github.com/prometheus-operator/prometheus-operator@v0.94.1", "example/prometheus-operator-crd", false},
}

// installCRDs installs the CRDs that define kinds (those of the sources
// above; the Gateway API ones of the Envoy Gateway chart are left to
// sigs.k8s.io/gateway-api) and waits until each is served. Kinds the API
// server already serves are left as they are.
func (c *cluster) installCRDs(t testing.TB, kinds ...string) {
	t.Helper()
	want := map[string]bool{}
	for _, k := range kinds {
		want[k] = true
	}
	crds := c.dyn.Resource(crdResource)
	served, err := crds.List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, crd := range served.Items {
		if kind, _, _ := unstructured.NestedString(crd.Object, "spec", "names", "kind"); established(&crd) {
			delete(want, kind)
		}
	}
	if len(want) == 0 {
		return
	}
	var names []string
	for _, src := range crdSources {
		if len(want) == 0 {
			break
		}
		dir := moduleDir(t, src.module)
		files, _ := filepath.Glob(filepath.Join(dir, src.dir, "*.yaml"))
		for _, f := range files {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			if src.stripHelm {
				if !strings.Contains(filepath.Base(f), "gateway.envoyproxy.io") {
					continue
				}
				data = stripHelmLines(data)
			}
			objs, err := decodeObjects(data)
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			for _, crd := range objs {
				kind, _, _ := unstructured.NestedString(crd.Object, "spec", "names", "kind")
				if crd.GetKind() != "CustomResourceDefinition" || !want[kind] {
					continue
				}
				delete(want, kind)
				c.create(t, crd)
				names = append(names, crd.GetName())
			}
		}
	}
	if len(want) > 0 {
		t.Fatalf("no CRD found for %v", want)
	}
	for _, name := range names {
		err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			crd, err := crds.Get(ctx, name, metav1.GetOptions{})
			return err == nil && established(crd), err
		})
		if err != nil {
			t.Fatalf("CRD %s not established: %v", name, err)
		}
	}
	c.mapper.Reset()
}

// established is whether the API server serves a CRD's kind.
func established(crd *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
	for _, cond := range conds {
		m, _ := cond.(map[string]any)
		if m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}

// moduleDir is a module's directory in the module cache, downloaded if need be.
func moduleDir(t testing.TB, modVersion string) string {
	t.Helper()
	cmd := exec.Command("go", "mod", "download", "-json", modVersion)
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go mod download %s: %v\n%s", modVersion, err, out)
	}
	var m struct{ Dir, Error string }
	if err := json.Unmarshal(out, &m); err != nil || m.Dir == "" {
		t.Fatalf("go mod download %s: %v %s", modVersion, err, m.Error)
	}
	return m.Dir
}

// stripHelmLines drops the template lines ({{ ... }}) a chart wraps around
// plain YAML.
func stripHelmLines(data []byte) []byte {
	var b bytes.Buffer
	for line := range bytes.Lines(data) {
		if !bytes.HasPrefix(bytes.TrimSpace(line), []byte("{{")) {
			b.Write(line)
		}
	}
	return b.Bytes()
}

func describe(obj *unstructured.Unstructured) string {
	return fmt.Sprintf("%s %s/%s", obj.GetKind(), obj.GetNamespace(), obj.GetName())
}

var crdResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
