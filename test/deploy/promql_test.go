package deploy

import (
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

const (
	rulesFile     = "charts/pd-extproc/files/prometheus-rules.yaml"
	dashboardFile = "charts/pd-extproc/files/grafana-dashboard.json"
	metricsDoc    = "docs/metrics.md"
)

// targetLabels are the labels Prometheus adds to every series of a target (a ServiceMonitor's
// among them): a query may select on them whatever the series is.
var targetLabels = []string{"namespace", "pod", "instance", "job", "service", "container"}

// seriesCatalog is what the queries may name: each series pd-extproc's registry exports, with
// the label values it fixes (an empty set: any value), and Envoy's stats that docs/metrics.md
// documents.
type seriesCatalog map[string]map[string]map[string]bool

// exportedSeries builds the registry as the binary does, with an endpoint of each pool (scraped,
// so that the engine gauges exist, and failed scrapes of every reason), Kubernetes discovery and
// the limits in force.
func exportedSeries(t *testing.T) seriesCatalog {
	t.Helper()
	m := metrics.New("kv-nixl")
	failures := map[string]uint64{}
	for _, reason := range scheduling.ScrapeFailureReasons {
		failures[reason] = 1
	}
	m.WatchEndpoints(func() []metrics.EndpointState {
		return []metrics.EndpointState{
			{Pool: "prefill", Endpoint: "10.0.0.1:8000", Scraped: true, ScrapeFailures: failures, BootstrapPort: 8998},
			{Pool: "decode", Endpoint: "10.0.0.2:8000", Scraped: true, ScrapeFailures: failures},
		}
	})
	m.WatchDiscovery([]string{"prefill", "decode"}, func() []metrics.DiscoveryState {
		return []metrics.DiscoveryState{{Pool: "prefill"}, {Pool: "decode"}}
	})
	m.Limits(1024, 1<<30, 1024)
	m.WatchKVEvents(func() []metrics.KVEventsState { return []metrics.KVEventsState{{Pool: "prefill"}, {Pool: "decode"}} })
	m.WatchHeld(func() (int, int) { return 0, 0 })
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := seriesCatalog{}
	add := func(name string, pairs map[string]string) {
		if out[name] == nil {
			out[name] = map[string]map[string]bool{}
		}
		for k, v := range pairs {
			if out[name][k] == nil {
				out[name][k] = map[string]bool{}
			}
			if k != "endpoint" && k != "version" && k != "revision" && k != "goversion" { // open-ended
				out[name][k][v] = true
			}
		}
	}
	for _, f := range families {
		for _, s := range f.GetMetric() {
			pairs := map[string]string{}
			for _, l := range s.GetLabel() {
				pairs[l.GetName()] = l.GetValue()
			}
			name := f.GetName()
			switch f.GetType().String() {
			case "HISTOGRAM":
				add(name+"_count", pairs)
				add(name+"_sum", pairs)
				add(name+"_bucket", maps.Collect(func(yield func(string, string) bool) {
					maps.All(pairs)(yield)
					yield("le", "")
				}))
			default:
				add(name, pairs)
			}
		}
	}
	// Envoy's stats: the backticked envoy_* names of docs/metrics.md's section on them.
	doc := string(mustRead(t, testbed.MustRepoPath(t, metricsDoc)))
	_, section, _ := strings.Cut(doc, "\n## Envoy's stats the dashboard and the alerts read\n")
	section, _, _ = strings.Cut(section, "\n## ")
	for _, m := range regexp.MustCompile("`(envoy_[a-z_]+)`").FindAllStringSubmatch(section, -1) {
		out[m[1]] = map[string]map[string]bool{"envoy_cluster_name": {}, "envoy_http_conn_manager_prefix": {}}
	}
	if len(out) < 30 {
		t.Fatalf("only %d series in the catalog", len(out))
	}
	return out
}

// check parses expr with Prometheus's parser and returns what is wrong with the series it
// names: unknown names, labels they do not carry, values their labels never take.
func (c seriesCatalog) check(expr string) (parser.Expr, []string) {
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		return nil, []string{err.Error()}
	}
	var problems []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		known, ok := c[vs.Name]
		if !ok {
			problems = append(problems, "names "+vs.Name+", which neither pd-extproc exports nor docs/metrics.md lists among Envoy's stats")
			return nil
		}
		for _, m := range vs.LabelMatchers {
			if m.Name == labels.MetricName || slices.Contains(targetLabels, m.Name) {
				continue
			}
			values, ok := known[m.Name]
			switch {
			case !ok:
				problems = append(problems, vs.Name+" has no label "+m.Name)
			case len(values) > 0 && (m.Type == labels.MatchEqual || m.Type == labels.MatchNotEqual) && !values[m.Value]:
				problems = append(problems, vs.Name+"{"+m.Name+"} never takes the value "+m.Value)
			case len(values) > 0 && (m.Type == labels.MatchRegexp || m.Type == labels.MatchNotRegexp):
				for _, alt := range strings.Split(m.Value, "|") {
					if regexp.MustCompile(`^\w+$`).MatchString(alt) && !values[alt] {
						problems = append(problems, vs.Name+"{"+m.Name+"} never takes the value "+alt)
					}
				}
			}
		}
		return nil
	})
	return e, problems
}

// ruleExprs are the alerts of the chart's rule file, by name.
func ruleExprs(t *testing.T) map[string]string {
	t.Helper()
	var f struct {
		Groups []struct {
			Rules []struct{ Alert, Expr string }
		}
	}
	if err := yaml.Unmarshal(mustRead(t, testbed.MustRepoPath(t, rulesFile)), &f); err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			out[r.Alert] = r.Expr
		}
	}
	return out
}

// dashboardExprs are the queries of the dashboard's panels (dashboardPanel.exprs).
func dashboardExprs(t *testing.T) []string {
	t.Helper()
	var out []string
	for _, p := range dashboardPanels(t) {
		out = append(out, p.exprs()...)
	}
	return out
}

// docExprs are the expressions of docs/metrics.md's promql blocks: a comment line opens each.
func docExprs(t *testing.T) []string {
	t.Helper()
	var out []string
	for _, block := range regexp.MustCompile("(?s)```promql\n(.*?)```").FindAllStringSubmatch(string(mustRead(t, testbed.MustRepoPath(t, metricsDoc))), -1) {
		var cur []string
		flush := func() {
			if e := strings.TrimSpace(strings.Join(cur, "\n")); e != "" {
				out = append(out, e)
			}
			cur = nil
		}
		for _, line := range strings.Split(block[1], "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "#") {
				if len(cur) > 0 {
					flush()
				}
				continue
			}
			cur = append(cur, line)
		}
		flush()
	}
	return out
}

// Every query users are given (the chart's alerts, its dashboard, and docs/metrics.md's
// examples) parses with Prometheus's own parser and names only series pd-extproc exports (with
// labels and values they carry) or the Envoy stats the docs list; and every alert of the docs
// is one of the rule file's.
func TestPromQLNamesSeriesThatExist(t *testing.T) {
	catalog := exportedSeries(t)
	rules := ruleExprs(t)
	dashboard := dashboardExprs(t)
	docs := docExprs(t)
	if len(rules) < 20 || len(dashboard) < 30 || len(docs) < 20 {
		t.Fatalf("%d rules, %d dashboard queries, %d doc expressions: the files changed shape", len(rules), len(dashboard), len(docs))
	}
	canonical := map[string]string{} // the rules' expressions as the parser prints them
	for name, expr := range rules {
		e, problems := catalog.check(expr)
		for _, p := range problems {
			t.Errorf("%s alert %s: %s", rulesFile, name, p)
		}
		if e != nil {
			canonical[e.String()] = name
		}
	}
	for _, expr := range dashboard {
		for _, p := range second(catalog.check(expr)) {
			t.Errorf("%s query %q: %s", dashboardFile, expr, p)
		}
	}
	for _, expr := range docs {
		e, problems := catalog.check(expr)
		for _, p := range problems {
			t.Errorf("%s query %q: %s", metricsDoc, expr, p)
		}
		if e != nil && canonical[e.String()] == "" {
			t.Errorf("%s's alert %q is not in %s", metricsDoc, expr, rulesFile)
		}
	}
}

func second[A, B any](_ A, b B) B { return b }

// The check itself catches what it is for.
func TestPromQLCheckCatchesMistakes(t *testing.T) {
	catalog := exportedSeries(t)
	tests := []struct{ expr, want string }{
		{`rate(pd_extproc_request_total[5m])`, "names pd_extproc_request_total"},
		{`sum(rate(pd_extproc_pd_decisions_total{reason="prefil_failed"}[5m]))`, "never takes the value prefil_failed"},
		{`pd_extproc_endpoint_healthy{pools="decode"}`, "has no label pools"},
		{`sum(rate(pd_extproc_prefill_failures_total{reason=~"connect|dial"}[5m]))`, "never takes the value dial"},
		{`envoy_cluster_upstream_rq_total`, "names envoy_cluster_upstream_rq_total"},
		{`sum(rate(pd_extproc_requests_total[5m])`, "unclosed left parenthesis"},
		{`max by (pod) (envoy_server_days_until_first_cert_expiring{namespace="llm"}) < 21`, ""},
	}
	for _, tc := range tests {
		_, problems := catalog.check(tc.expr)
		got := strings.Join(problems, "; ")
		if tc.want == "" && got != "" || !strings.Contains(got, tc.want) {
			t.Errorf("check(%q) = %q, want a problem naming %q", tc.expr, got, tc.want)
		}
	}
}

// The alerts fire on the series they are for, and not on others, as Prometheus evaluates them
// (promtool test rules, testdata/prometheus-rules-test.yaml).
func TestAlertsFireOnTheSeriesTheyAreFor(t *testing.T) {
	promtool := testbed.FindTool("promtool")
	if promtool == "" {
		t.Skip("promtool not found on PATH or in " + strings.Join(testbed.ToolDirs(), ", ") +
			" (go install github.com/prometheus/prometheus/cmd/promtool@v0.316.0) to evaluate the alerts")
	}
	dir := t.TempDir()
	for _, f := range []struct{ from, to string }{
		{testbed.MustRepoPath(t, rulesFile), "prometheus-rules.yaml"},
		{"testdata/prometheus-rules-test.yaml", "test.yaml"},
	} {
		if err := os.WriteFile(filepath.Join(dir, f.to), mustRead(t, f.from), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := runTool(t, dir, promtool, "test", "rules", "test.yaml"); err != nil {
		t.Errorf("promtool test rules: %v\n%s", err, out)
	}
}

// The dashboard's Envoy panels read the Envoys that route for pd-extproc, wherever they run: the
// standalone Envoy beside the release, or Envoy Gateway's proxies in its own namespace
// (envoy-gateway-system by default). Their namespace is a variable of its own, which lists the
// namespaces of Envoys with pd-extproc's decode cluster (pd_original_dst, in both installs);
// pd-extproc's panels keep the release's.
func TestDashboardEnvoyPanelsReadEnvoysNamespace(t *testing.T) {
	var d struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
		Templating struct {
			List []struct {
				Name, Type, Definition string
				IncludeAll             bool
			}
		}
	}
	if err := json.Unmarshal(mustRead(t, testbed.MustRepoPath(t, dashboardFile)), &d); err != nil {
		t.Fatal(err)
	}
	catalog := exportedSeries(t)
	vars := map[string]string{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v.Definition
		if v.Name != "envoy_namespace" {
			continue
		}
		selector, ok := strings.CutPrefix(v.Definition, "label_values(")
		selector, ok2 := strings.CutSuffix(selector, ", namespace)")
		if v.Type != "query" || !v.IncludeAll || !ok || !ok2 {
			t.Errorf("variable envoy_namespace: %s %q, all %v; want a query of label_values(<an Envoy series>, namespace) with All", v.Type, v.Definition, v.IncludeAll)
			continue
		}
		for _, p := range second(catalog.check(selector)) {
			t.Errorf("variable envoy_namespace %q: %s", selector, p)
		}
		if !strings.HasPrefix(selector, "envoy_") || !strings.Contains(selector, `envoy_cluster_name="pd_original_dst"`) {
			t.Errorf("variable envoy_namespace lists %q, not the namespaces of Envoys with the cluster pd_original_dst", selector)
		}
	}
	if _, ok := vars["envoy_namespace"]; !ok {
		t.Error("the dashboard has no variable envoy_namespace")
	}
	for _, f := range []string{"config/envoy/envoy.yaml", "charts/pd-extproc/templates/gateway-policies.yaml"} {
		if !strings.Contains(string(mustRead(t, testbed.MustRepoPath(t, f))), "name: pd_original_dst") {
			t.Errorf("%s has no cluster pd_original_dst, which the variable envoy_namespace looks for", f)
		}
	}
	envoyPanels := 0
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			e, err := parser.NewParser(parser.Options{}).ParseExpr(strings.ReplaceAll(tg.Expr, "$__rate_interval", "5m"))
			if err != nil {
				t.Fatalf("panel %q: %v", p.Title, err)
			}
			parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
				vs, ok := n.(*parser.VectorSelector)
				if !ok {
					return nil
				}
				want := "$namespace"
				if strings.HasPrefix(vs.Name, "envoy_") {
					want = "$envoy_namespace"
					envoyPanels++
				}
				if !slices.ContainsFunc(vs.LabelMatchers, func(m *labels.Matcher) bool {
					return m.Name == "namespace" && m.Type == labels.MatchRegexp && m.Value == want
				}) {
					t.Errorf("panel %q: %s selects %v, want namespace=~%q", p.Title, vs.Name, vs.LabelMatchers, want)
				}
				return nil
			})
		}
	}
	if envoyPanels < 4 {
		t.Errorf("%d Envoy selectors in the dashboard's panels, want its Envoy row's", envoyPanels)
	}
}
