package deploy

import (
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/chart"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

const metricPrefix = "pd_extproc_"

// document is one of the documents users read: the READMEs and docs/.
type document struct {
	path string // absolute
	rel  string // from the repository's root, as errors name it
	text string
}

// documents reads the documents users read.
func documents(t *testing.T) []document {
	t.Helper()
	root := testbed.MustRepoRoot(t)
	paths := []string{filepath.Join(root, "README.md"), filepath.Join(root, "charts", "pd-extproc", "README.md")}
	more, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	var docs []document
	for _, path := range append(paths, more...) {
		rel, _ := filepath.Rel(root, path)
		docs = append(docs, document{path: path, rel: rel, text: string(mustRead(t, path))})
	}
	return docs
}

// exportedMetrics names every metric pd-extproc exports, without the prefix.
func exportedMetrics(t *testing.T) []string {
	t.Helper()
	var out []string
	for name := range exportedSeries(t) {
		if bare, ok := strings.CutPrefix(name, metricPrefix); ok {
			out = append(out, bare)
		}
	}
	return out
}

// Every metric the docs name carries its full name, so that a query pasted into Prometheus
// finds it: `kv_params_missing_total` alone returns nothing.
func TestDocsNameMetricsInFull(t *testing.T) {
	names := exportedMetrics(t)
	word := regexp.MustCompile(`[A-Za-z0-9_:…]+`)
	for _, doc := range documents(t) {
		for i, line := range strings.Split(doc.text, "\n") {
			for _, w := range word.FindAllString(line, -1) {
				bare := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(w, "_bucket"), "_count"), "_sum")
				if slices.Contains(names, bare) && !strings.HasPrefix(w, metricPrefix) {
					t.Errorf("%s:%d names the metric %s without its prefix: write %s%s", doc.rel, i+1, w, metricPrefix, w)
				}
			}
		}
	}
}

// The documents link to files of the repository that exist, and to headings that exist.
func TestDocsLinkToFilesThatExist(t *testing.T) {
	link := regexp.MustCompile(`\]\(([^)#:\s]*)(#[^)\s]*)?\)`)
	for _, doc := range documents(t) {
		for _, m := range link.FindAllStringSubmatch(doc.text, -1) {
			target := doc.path
			if m[1] != "" {
				target = filepath.Join(filepath.Dir(doc.path), m[1])
			}
			if _, err := os.Stat(target); err != nil {
				t.Errorf("%s links to %s, which does not exist", doc.rel, m[1])
				continue
			}
			if anchor := strings.TrimPrefix(m[2], "#"); anchor != "" && strings.HasSuffix(target, ".md") && !slices.Contains(anchors(t, target), anchor) {
				t.Errorf("%s links to %s#%s, which has no such heading", doc.rel, m[1], anchor)
			}
		}
	}
}

// Every pd_extproc_ series the documents name in their prose (a name, a selector such as
// {reason="no_kv_params"}, or its labels as {pool,reason}) is one the registry exports, with
// those labels and values, so that a query written from the docs finds something.
func TestDocsNameSeriesThatExist(t *testing.T) {
	catalog := exportedSeries(t)
	for _, doc := range documents(t) {
		for i, line := range strings.Split(doc.text, "\n") {
			for _, p := range catalog.proseProblems(line) {
				t.Errorf("%s:%d %s", doc.rel, i+1, p)
			}
		}
	}
}

// The prose check catches what it is for, and passes what the docs may write.
func TestDocsSeriesCheckCatchesMistakes(t *testing.T) {
	catalog := exportedSeries(t)
	tests := []struct{ line, want string }{
		{"counted in `pd_extproc_prefill_failure_total`", "names pd_extproc_prefill_failure_total"},
		{`pd_extproc_prefill_failures_total{reason="no_kv_param"}`, "never takes the value no_kv_param"},
		{"`pd_extproc_held_requests{pool,objective}`", "has no label objective"},
		{"`pd_extproc_endpoint_inflight{pool=\"decode\"}`, `pd_extproc_discovery_*`, `pd_extproc_500`", ""},
		{"`pd_extproc_tokenize_seconds{outcome=\"ok\"}` ([KV events](docs/metrics.md#kv-events-pd_extproc_kv_events_))", ""},
	}
	for _, tc := range tests {
		got := strings.Join(catalog.proseProblems(tc.line), "; ")
		if tc.want == "" && got != "" || !strings.Contains(got, tc.want) {
			t.Errorf("proseProblems(%q) = %q, want a problem naming %q", tc.line, got, tc.want)
		}
	}
}

var (
	proseSeries = regexp.MustCompile(`pd_extproc_[a-z][a-z0-9_]*[a-z0-9]` + `(\{[^}\n]*\})?(_?\*)?`) // a name, a selector, a family
	labelList   = regexp.MustCompile(`^\{([a-z_]+(?:, ?[a-z_]+)*)\}$`)
	linkTarget  = regexp.MustCompile(`\]\([^)]*\)`)
)

// proseProblems checks the series a line of prose names: a family (pd_extproc_discovery_*),
// a link's anchor and a histogram by its own name pass.
func (c seriesCatalog) proseProblems(line string) []string {
	var out []string
	for _, m := range proseSeries.FindAllStringSubmatch(linkTarget.ReplaceAllString(line, "]"), -1) {
		if m[2] != "" {
			continue
		}
		name, sel := strings.TrimSuffix(m[0], m[1]), m[1]
		if c[name] == nil && c[name+"_bucket"] != nil {
			name += "_bucket"
		}
		expr := name + sel
		l := labelList.FindStringSubmatch(sel)
		if l != nil {
			expr = name
		}
		problems := second(c.check(expr))
		if l != nil && problems == nil {
			for _, label := range strings.Split(strings.ReplaceAll(l[1], " ", ""), ",") {
				if _, ok := c[name][label]; !ok {
					problems = append(problems, name+" has no label "+label)
				}
			}
		}
		for _, p := range problems {
			out = append(out, "names "+m[0]+": "+p)
		}
	}
	return out
}

// anchors are the heading ids GitHub gives a Markdown file: lower case, punctuation other
// than - and _ dropped, spaces made -.
func anchors(t *testing.T, path string) []string {
	t.Helper()
	var out []string
	drop := regexp.MustCompile(`[^\p{L}\p{N} _-]`)
	inCode := false
	for _, line := range strings.Split(string(mustRead(t, path)), "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
		}
		h, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " ")
		if inCode || !strings.HasPrefix(line, "#") || !ok {
			continue
		}
		out = append(out, strings.ReplaceAll(drop.ReplaceAllString(strings.ToLower(h), ""), " ", "-"))
	}
	return out
}

// The reasons the docs select pd_decisions_total by are the metric's own.
func TestDocsNameDecisionReasonsThatExist(t *testing.T) {
	sel := regexp.MustCompile(`pd_extproc_pd_decisions_total\{reason(=~?)"([^"]+)"`)
	for _, doc := range documents(t) {
		for _, m := range sel.FindAllStringSubmatch(doc.text, -1) {
			values := []string{m[2]}
			if m[1] == "=~" {
				values = strings.Split(m[2], "|")
			}
			for _, v := range values {
				if !slices.Contains(metrics.Reasons(), v) {
					t.Errorf("%s selects pd_extproc_pd_decisions_total{reason=%q}, which is no reason of the metric (%v)", doc.rel, v, metrics.Reasons())
				}
			}
		}
	}
}

// extprocFlags are the flags cmd/extproc defines.
func extprocFlags(t *testing.T) []string {
	t.Helper()
	def := regexp.MustCompile(`flag\.(?:String|Int|Bool|Duration|Func)(?:Var)?\((?:&[^,]+, )?"([^"]+)"`)
	var out []string
	for _, m := range def.FindAllStringSubmatch(string(mustRead(t, testbed.MustRepoPath(t, "cmd/extproc/main.go"))), -1) {
		out = append(out, m[1])
	}
	if len(out) < 10 {
		t.Fatalf("found only %d flags in cmd/extproc/main.go: %v", len(out), out)
	}
	return out
}

// The flags the chart's Deployment and the compose file pass, and the README's list, are the
// binary's own (an unknown flag makes extproc exit at start), and the README names every flag.
func TestFlagsAreTheBinarys(t *testing.T) {
	flags := extprocFlags(t)
	check := func(where string, args []string) {
		for _, a := range args {
			name, _, _ := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "=")
			if strings.HasPrefix(a, "-") && !slices.Contains(flags, name) {
				t.Errorf("%s passes %s, which extproc does not define", where, a)
			}
		}
	}
	for _, ex := range chart.Examples {
		dep := find(t, chartManifests(t, ex.Name), "Deployment", fullname(ex))
		check("the chart's Deployment ("+ex.Name+")", toStrings(dig(dig(dep, "spec", "template", "spec", "containers").([]any)[0], "args")))
	}
	compose := yamlDocuments(t, testbed.MustRepoPath(t, composeFile))[0]
	check(composeFile, toStrings(dig(compose, "services", "extproc", "command")))
	readme := string(mustRead(t, testbed.MustRepoPath(t, "README.md")))
	_, list, _ := strings.Cut(readme, "\nFlags: ")
	list, _, _ = strings.Cut(list, "\n\n")
	named := regexp.MustCompile("`(-{1,2}[a-z][a-z-]*)").FindAllStringSubmatch(list, -1)
	var documented []string
	for _, m := range named {
		documented = append(documented, strings.TrimLeft(m[1], "-"))
		if !slices.Contains(flags, documented[len(documented)-1]) {
			t.Errorf("README's Flags passes %s, which extproc does not define", m[1])
		}
	}
	for _, f := range flags {
		if !slices.Contains(documented, f) {
			t.Errorf("README's Flags paragraph does not name --%s", f)
		}
	}
}

// Every test and benchmark the docs cite exists, so that a reader can run what a claim rests
// on (go test -run Name).
func TestDocsNameTestsThatExist(t *testing.T) {
	root := testbed.MustRepoRoot(t)
	defined := map[string]bool{}
	decl := regexp.MustCompile(`(?m)^func ((?:Test|Benchmark|Fuzz)\w+)\(`)
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		switch {
		case err != nil:
			return err
		case d.IsDir() && strings.HasPrefix(d.Name(), ".") && path != root:
			return filepath.SkipDir
		case !d.IsDir() && strings.HasSuffix(path, "_test.go"):
			for _, m := range decl.FindAllStringSubmatch(string(mustRead(t, path)), -1) {
				defined[m[1]] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	cited := regexp.MustCompile(`\b(?:Test|Benchmark|Fuzz)[A-Z]\w*`)
	for _, doc := range append(documents(t), document{rel: "CHANGELOG.md", text: string(mustRead(t, filepath.Join(root, "CHANGELOG.md")))}) {
		for _, name := range cited.FindAllString(doc.text, -1) {
			if !defined[name] {
				t.Errorf("%s cites %s, which no _test.go defines", doc.rel, name)
			}
		}
	}
}

// docs/architecture.md's package table names, for each package, the packages of this module
// it imports (a package of tests only, those its tests import; a row may name what tests
// import besides): a newcomer reads the structure there, so it must be the code's (go list).
func TestArchitectureTableNamesEachPackagesImports(t *testing.T) {
	root := testbed.MustRepoRoot(t)
	const module = "github.com/pd-extproc/pd-extproc/"
	cmd := exec.Command("go", "list", "-f", `{{.ImportPath}}|{{len .GoFiles}}|{{join .Imports " "}}|{{join .TestImports " "}} {{join .XTestImports " "}}`, "./...")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	own := func(list string) []string {
		var out []string
		for _, imp := range strings.Fields(list) {
			if p, ok := strings.CutPrefix(imp, module); ok {
				out = append(out, p)
			}
		}
		return out
	}
	imports, tests := map[string][]string{}, map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Split(line, "|")
		pkg := strings.TrimPrefix(f[0], module)
		imports[pkg], tests[pkg] = own(f[2]), own(f[3])
		if f[1] == "0" {
			imports[pkg] = tests[pkg]
		}
	}
	name := regexp.MustCompile("`([a-z][a-z0-9/]*)`")
	rows := 0
	for _, line := range strings.Split(string(mustRead(t, filepath.Join(root, filepath.FromSlash("docs/architecture.md")))), "\n") {
		cells := strings.Split(line, " | ")
		if len(cells) != 3 || !strings.HasPrefix(line, "| `") {
			continue
		}
		var pkgs []string
		for _, m := range name.FindAllStringSubmatch(cells[0], -1) {
			if _, ok := imports[m[1]]; ok {
				pkgs = append(pkgs, m[1])
			}
		}
		if len(pkgs) == 0 || strings.Contains(cells[2], "everything in") {
			continue // a folder of data, or a package that may import anything
		}
		rows++
		want, may := map[string]bool{}, map[string]bool{} // each other aside
		for _, p := range pkgs {
			for _, imp := range imports[p] {
				want[imp], may[imp] = !slices.Contains(pkgs, imp), true
			}
			for _, imp := range tests[p] {
				may[imp] = true
			}
		}
		named := map[string]bool{}
		for _, m := range name.FindAllStringSubmatch(cells[2], -1) {
			if _, ok := imports[m[1]]; ok {
				named[m[1]] = true
			}
		}
		for imp, w := range want {
			if w && !named[imp] {
				t.Errorf("docs/architecture.md: %v imports %s, which its row does not name", pkgs, imp)
			}
		}
		for imp := range named {
			if !may[imp] {
				t.Errorf("docs/architecture.md: %v's row names %s, which it does not import", pkgs, imp)
			}
		}
	}
	if rows < 20 {
		t.Fatalf("read %d rows of docs/architecture.md's package table: the test shows nothing", rows)
	}
}

// docs/metrics.md names every metric pd-extproc exports (a histogram by its name, not its
// _bucket, _sum and _count series): an operator looks there for what a series means.
func TestEveryMetricIsDocumented(t *testing.T) {
	doc := string(mustRead(t, filepath.Join(testbed.MustRepoRoot(t), filepath.FromSlash("docs/metrics.md"))))
	series := exportedSeries(t)
	missing := map[string]bool{}
	for name := range series {
		base := name
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(name, suffix); ok && series[b+"_bucket"] != nil {
				base = b
			}
		}
		if strings.HasPrefix(base, metricPrefix) && !strings.Contains(doc, "`"+base+"`") {
			missing[base] = true
		}
	}
	for _, name := range slices.Sorted(maps.Keys(missing)) {
		t.Errorf("docs/metrics.md does not name %s", name)
	}
}
