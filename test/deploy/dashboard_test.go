package deploy

import (
	"encoding/json"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/promql/parser"

	"github.com/pd-extproc/pd-extproc/internal/chart"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// dashboardPanel is a panel of the dashboard, rows among them, as Grafana places it.
type dashboardPanel struct {
	ID                       int
	Type, Title, Description string
	GridPos                  struct{ H, W, X, Y int }
	Targets                  []struct{ Expr, LegendFormat string }
}

// grafanaVars gives Grafana's variables values a query may hold.
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "$namespace", ".*", "$envoy_namespace", ".*")

// exprs are the panel's queries, its variables given values (grafanaVars).
func (p dashboardPanel) exprs() []string {
	out := make([]string, len(p.Targets))
	for i, tg := range p.Targets {
		out[i] = grafanaVars.Replace(tg.Expr)
	}
	return out
}

func dashboardPanels(t *testing.T) []dashboardPanel {
	t.Helper()
	var d struct{ Panels []dashboardPanel }
	if err := json.Unmarshal(mustRead(t, testbed.MustRepoPath(t, dashboardFile)), &d); err != nil {
		t.Fatal(err)
	}
	if len(d.Panels) < 30 {
		t.Fatalf("%d panels in %s: the file changed shape", len(d.Panels), dashboardFile)
	}
	return d.Panels
}

// Every panel has an id of its own and a place on the 24-column grid that no other panel takes
// (Grafana moves overlapping panels wherever it finds room).
func TestDashboardPanelsDoNotOverlap(t *testing.T) {
	panels := dashboardPanels(t)
	ids := map[int]string{}
	for i, p := range panels {
		g := p.GridPos
		if other, dup := ids[p.ID]; dup {
			t.Errorf("panels %q and %q both have id %d", other, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q at %+v is off the 24-column grid", p.Title, g)
		}
		for _, q := range panels[:i] {
			h := q.GridPos
			if g.X < h.X+h.W && h.X < g.X+g.W && g.Y < h.Y+h.H && h.Y < g.Y+g.H {
				t.Errorf("panel %q at %+v overlaps %q at %+v", p.Title, g, q.Title, h)
			}
		}
	}
}

// The Endpoints row draws, per pool and endpoint, each engine's scraped queue and KV use and
// the failed scrapes that take them away, per second and by why, each line named by its labels.
func TestDashboardEndpointsRowDrawsEngineScrapes(t *testing.T) {
	tests := []struct {
		metric, fn string // fn: the function over a counter's range, "" for a gauge
		by         []string
	}{
		{"pd_extproc_endpoint_engine_waiting", "", []string{"pool", "endpoint"}},
		{"pd_extproc_endpoint_engine_kv_usage", "", []string{"pool", "endpoint"}},
		{"pd_extproc_endpoint_scrape_failures_total", "rate", []string{"pool", "endpoint", "reason"}},
	}
	row := rowPanels(t, dashboardPanels(t), "Endpoints")
	for _, tc := range tests {
		drawn := false
		for _, p := range row {
			for _, tg := range p.Targets {
				if !aggregates(t, tg.Expr, tc.metric, tc.fn, tc.by) {
					continue
				}
				drawn = true
				for _, l := range tc.by {
					if !strings.Contains(tg.LegendFormat, "{{"+l+"}}") {
						t.Errorf("panel %q: legend %q does not name %s", p.Title, tg.LegendFormat, l)
					}
				}
			}
		}
		if !drawn {
			t.Errorf("the Endpoints row has no panel of %s(%s) by (%s)", tc.fn, tc.metric, strings.Join(tc.by, ", "))
		}
	}
}

// rowPanels are the panels below the row titled title, down to the next row.
func rowPanels(t *testing.T, panels []dashboardPanel, title string) []dashboardPanel {
	t.Helper()
	top, bottom := -1, 1<<30
	for _, p := range panels {
		if p.Type == "row" && p.Title == title {
			top = p.GridPos.Y
		}
	}
	for _, p := range panels {
		if p.Type == "row" && p.GridPos.Y > top && p.GridPos.Y < bottom {
			bottom = p.GridPos.Y
		}
	}
	var out []dashboardPanel
	for _, p := range panels {
		if p.Type != "row" && top >= 0 && p.GridPos.Y > top && p.GridPos.Y < bottom {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		t.Fatalf("no panels in the dashboard's row %q", title)
	}
	return out
}

// aggregates tells whether expr is an aggregation by exactly the labels by of metric, or of
// fn over metric's range when fn is not empty.
func aggregates(t *testing.T, expr, metric, fn string, by []string) bool {
	t.Helper()
	e, err := parser.NewParser(parser.Options{}).ParseExpr(strings.ReplaceAll(expr, "$__rate_interval", "5m"))
	if err != nil {
		t.Fatalf("%q: %v", expr, err)
	}
	agg, ok := e.(*parser.AggregateExpr)
	if !ok || agg.Without || len(agg.Grouping) != len(by) {
		return false
	}
	for _, l := range by {
		if !slices.Contains(agg.Grouping, l) {
			return false
		}
	}
	inner := agg.Expr
	if fn != "" {
		call, ok := inner.(*parser.Call)
		if !ok || call.Func.Name != fn {
			return false
		}
		m, ok := call.Args[0].(*parser.MatrixSelector)
		if !ok {
			return false
		}
		inner = m.VectorSelector
	}
	vs, ok := inner.(*parser.VectorSelector)
	return ok && vs.Name == metric
}

// Every alert the chart ships has panels an on-call operator can open from it: each series its
// expression reads is drawn by a panel whose description names the alert.
func TestDashboardDrawsWhatEachAlertReads(t *testing.T) {
	descriptions := map[string][]string{} // series -> the descriptions of the panels drawing it
	for _, p := range dashboardPanels(t) {
		for _, expr := range p.exprs() {
			for _, name := range selectedSeries(t, expr) {
				descriptions[name] = append(descriptions[name], p.Description)
			}
		}
	}
	rules := ruleExprs(t)
	for _, alert := range slices.Sorted(maps.Keys(rules)) {
		t.Run(alert, func(t *testing.T) {
			named := regexp.MustCompile(`\b` + alert + `\b`)
			for _, name := range slices.Compact(slices.Sorted(slices.Values(selectedSeries(t, rules[alert])))) {
				if len(descriptions[name]) == 0 {
					t.Errorf("alert %s reads %s, which no panel of %s draws", alert, name, dashboardFile)
				} else if !slices.ContainsFunc(descriptions[name], named.MatchString) {
					t.Errorf("alert %s reads %s: no panel drawing it names the alert in its description", alert, name)
				}
			}
		})
	}
}

// selectedSeries are the names of the series expr selects.
func selectedSeries(t *testing.T, expr string) []string {
	t.Helper()
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		t.Fatalf("%q: %v", expr, err)
	}
	var out []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			out = append(out, vs.Name)
		}
		return nil
	})
	return out
}

// The chart's dashboard opens on the release's namespace, and its Envoy row on the Envoys of
// this release: the release's namespace with the chart's own Envoy, gateway.proxyNamespace
// with Envoy Gateway, both with both; with neither (your own Envoy) it keeps the file's "All".
// Nothing else of the file changes, so that the JSON imported by hand is the same dashboard.
func TestChartDashboardOpensOnTheRelease(t *testing.T) {
	var file map[string]any
	if err := json.Unmarshal(mustRead(t, testbed.MustRepoPath(t, dashboardFile)), &file); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, ns string
		envoy    bool
		gateway  map[string]any
		want     []any // the variable's current value; nil: none, Grafana's All
	}{
		{"chart's Envoy", "pd-extproc", true, map[string]any{"enabled": false}, []any{"pd-extproc"}},
		{"Envoy Gateway", "llm", false, map[string]any{"enabled": true}, []any{"envoy-gateway-system"}},
		{"Envoy Gateway, proxies elsewhere", "llm", false, map[string]any{"enabled": true, "proxyNamespace": "eg"}, []any{"eg"}},
		{"both", "llm", true, map[string]any{"enabled": true}, []any{"llm", "envoy-gateway-system"}},
		{"both in one namespace", "eg", true, map[string]any{"enabled": true, "proxyNamespace": "eg"}, []any{"eg"}},
		{"neither", "llm", false, map[string]any{"enabled": false}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			values := map[string]any{
				"envoy":      map[string]any{"enabled": tc.envoy},
				"gateway":    tc.gateway,
				"monitoring": map[string]any{"dashboard": map[string]any{"enabled": true}},
			}
			rel := chart.Release{Name: "pd-extproc", Namespace: tc.ns}
			cm := find(t, render(t, chart.Example{Name: tc.name, Release: rel}, values), "ConfigMap", "pd-extproc-dashboard")
			var got map[string]any
			if err := json.Unmarshal([]byte(digString(cm, "data", "pd-extproc.json")), &got); err != nil {
				t.Fatal(err)
			}
			found := false
			for _, v := range dig(got, "templating", "list").([]any) {
				if digString(v, "name") == "namespace" { // pd-extproc's own panels: this release's
					current, _ := v.(map[string]any)["current"].(map[string]any)
					if value, _ := current["value"].([]any); !reflect.DeepEqual(value, []any{tc.ns}) || !reflect.DeepEqual(current["text"], current["value"]) {
						t.Errorf("namespace opens on %v, want [%s]", current, tc.ns)
					}
					v.(map[string]any)["current"] = map[string]any{}
				}
				if digString(v, "name") != "envoy_namespace" {
					continue
				}
				found = true
				current, _ := v.(map[string]any)["current"].(map[string]any)
				if value, _ := current["value"].([]any); !reflect.DeepEqual(value, tc.want) {
					t.Errorf("envoy_namespace opens on %v, want %v", current, tc.want)
				}
				if tc.want != nil && !reflect.DeepEqual(current["text"], current["value"]) {
					t.Errorf("envoy_namespace shows %v for the value %v", current["text"], current["value"])
				}
				v.(map[string]any)["current"] = map[string]any{}
			}
			if !found {
				t.Fatal("the chart's dashboard has no variable envoy_namespace")
			}
			if !reflect.DeepEqual(got, file) {
				t.Errorf("the chart's dashboard differs from %s beyond its variables' current values", dashboardFile)
			}
		})
	}
}
