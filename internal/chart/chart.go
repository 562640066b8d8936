// Package chart renders, lints and packages the Helm chart of charts/pd-extproc with Helm's own
// Go library, as `helm template`, `helm lint` and `helm package` would, with no helm binary: for
// the tests that check what the chart renders, and for make release-dry-run.
package chart

import (
	"bytes"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
)

// Dir is the chart's directory in the repository.
const Dir = "charts/pd-extproc"

// KubeVersion is the Kubernetes version the chart is rendered for: the API server test/k8s runs.
const KubeVersion = "v1.37.2"

// Release names an install: `helm install <Name> ./charts/pd-extproc -n <Namespace>`.
type Release struct{ Name, Namespace string }

// Render renders the chart at dir for an install of rel with values over values.yaml, as `helm
// template` does, and returns every manifest in one YAML stream, templates in name order.
func Render(dir string, rel Release, values map[string]any) ([]byte, error) {
	c, err := loader.Load(dir)
	if err != nil {
		return nil, err
	}
	caps := chartutil.DefaultCapabilities.Copy()
	if caps.KubeVersion, err = kubeVersion(KubeVersion); err != nil {
		return nil, err
	}
	vals, err := chartutil.ToRenderValues(c, values, chartutil.ReleaseOptions{Name: rel.Name, Namespace: rel.Namespace, Revision: 1, IsInstall: true}, caps)
	if err != nil {
		return nil, err
	}
	files, err := engine.Render(c, vals)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	for _, name := range slices.Sorted(func(yield func(string) bool) {
		for n := range files {
			if !yield(n) {
				return
			}
		}
	}) {
		body := strings.TrimSpace(files[name])
		if !strings.HasSuffix(name, ".yaml") || body == "" {
			continue // NOTES.txt, partials, templates that render nothing
		}
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", name, body)
	}
	return out.Bytes(), nil
}

func kubeVersion(v string) (chartutil.KubeVersion, error) {
	m := regexp.MustCompile(`^v(\d+)\.(\d+)\.\d+$`).FindStringSubmatch(v)
	if m == nil {
		return chartutil.KubeVersion{}, fmt.Errorf("chart: kube version %q", v)
	}
	return chartutil.KubeVersion{Version: v, Major: m[1], Minor: m[2]}, nil
}

// Lint runs helm lint's checks on the chart at dir with values over values.yaml and returns
// what they find at warning level or worse.
func Lint(dir string, values map[string]any) []support.Message {
	var out []support.Message
	for _, m := range lint.AllWithKubeVersion(dir, values, "pd-extproc", mustKube(KubeVersion)).Messages {
		if m.Severity >= support.WarningSev {
			out = append(out, m)
		}
	}
	return out
}

func mustKube(v string) *chartutil.KubeVersion {
	kv, err := kubeVersion(v)
	if err != nil {
		panic(err)
	}
	return &kv
}

// Package writes the chart at dir as a .tgz into outDir, as `helm package --version
// --app-version` does, with its image repository set (image.repository in values.yaml), and
// returns the file's path. version is the repository's (git describe): the chart's version is
// it without the v, as SemVer (0.0.0-<commit> before any tag); its appVersion, the image tag, is
// it as it is.
func Package(dir, version, repository, outDir string) (string, error) {
	c, err := loader.Load(dir)
	if err != nil {
		return "", err
	}
	c.Metadata.Version = ChartVersion(version)
	c.Metadata.AppVersion = version
	if err := setRepository(c, repository); err != nil {
		return "", err
	}
	return chartutil.Save(c, outDir)
}

// ChartVersion is the SemVer a chart takes from the repository's version.
func ChartVersion(version string) string {
	if v, ok := strings.CutPrefix(version, "v"); ok && regexp.MustCompile(`^\d+\.\d+\.\d+`).MatchString(v) {
		return v
	}
	return "0.0.0-" + version
}

// setRepository names repository as the default image in the chart's values and in its
// values.yaml, comments kept.
func setRepository(c *chart.Chart, repository string) error {
	image, _ := c.Values["image"].(map[string]any)
	if image == nil {
		return fmt.Errorf("chart: values.yaml has no image")
	}
	old, _ := image["repository"].(string)
	image["repository"] = repository
	for _, f := range c.Raw {
		if f.Name == "values.yaml" {
			line := "\n  repository: " + old + "\n"
			if !bytes.Contains(f.Data, []byte(line)) {
				return fmt.Errorf("chart: values.yaml has no %q", strings.TrimSpace(line))
			}
			f.Data = bytes.Replace(f.Data, []byte(line), []byte("\n  repository: "+repository+"\n"), 1)
		}
	}
	return nil
}
