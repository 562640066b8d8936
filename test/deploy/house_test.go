package deploy

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// The size limits of docs/architecture.md (rule 7): past them a file or a
// struct is doing more than one job and is split by concern.
const (
	maxFileLines    = 400
	maxStructFields = 15
)

// lineLimited are the trees whose non-test Go files keep to maxFileLines.
var lineLimited = []string{"pkg", "internal/envoyemu"}

// TestSizeLimits keeps rule 7 true: no non-test Go file in pkg/ or the
// emulator over maxFileLines, and no struct in a non-test Go file anywhere
// over maxStructFields, config types (named …Config or …Options) aside.
func TestSizeLimits(t *testing.T) {
	root := testbed.MustRepoRoot(t)
	for _, path := range repoFiles(t, root, func(rel string) bool {
		return strings.HasSuffix(rel, ".go") && !strings.HasSuffix(rel, "_test.go")
	}) {
		rel, _ := filepath.Rel(root, path)
		src, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if n := bytes.Count(src, []byte("\n")); n > maxFileLines && underAny(rel, lineLimited) {
			t.Errorf("%s has %d lines; split it by concern (at most %d)", rel, n, maxFileLines)
		}
		for name, fields := range structFields(t, path, src) {
			if fields > maxStructFields && !isConfigType(name) {
				t.Errorf("%s: struct %s has %d fields; split it by concern (at most %d)", rel, name, fields, maxStructFields)
			}
		}
	}
}

// TestRepositoryStandsAlone: no file names a document the repository lacks
// (the team's working notes, another repository's docs); what a comment or
// doc relies on is written down in docs/ with its upstream source, and an
// upstream document is named by its URL. Every Markdown path, and every
// relative link, must resolve to a file inside the repository, from the
// file's directory or from the root; every §N must be a numbered heading of
// docs/envoy.md. URLs, absolute paths (a container's) and what the build
// writes (bin/) are not documents; a Go file names documents in its comments.
func TestRepositoryStandsAlone(t *testing.T) {
	root := testbed.MustRepoRoot(t)
	if n := len(envoySections(t, filepath.Join(root, "docs", "envoy.md"))); n < 10 {
		t.Fatalf("docs/envoy.md has %d numbered headings: the heading format changed", n)
	}
	for _, s := range strayCitations(t, root) {
		t.Error(s)
	}
}

// strayCitations are the citations of documents outside the repository
// rooted at root, one line each.
func strayCitations(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	sections := envoySections(t, filepath.Join(root, "docs", "envoy.md"))
	url := regexp.MustCompile(`[a-z][a-z0-9+.-]*://\S+`)
	mdPath := regexp.MustCompile(`(^|[^\w./-])(\.{0,2}/?[\w.-]+(?:/[\w.-]+)*\.md)\b`)
	link := regexp.MustCompile(`\]\(([^)#\s]+)[^)]*\)`)
	section := regexp.MustCompile(`§\s?(\d+(?:\.\d+)*)`)
	for _, path := range repoFiles(t, root, func(string) bool { return true }) {
		rel, _ := filepath.Rel(root, path)
		src, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.IndexByte(src, 0) >= 0 {
			continue // binary
		}
		markdown, goSource := strings.HasSuffix(rel, ".md"), strings.HasSuffix(rel, ".go")
		for n, line := range strings.Split(string(src), "\n") {
			line = url.ReplaceAllString(line, "")
			if goSource { // only its comments name documents
				_, line, _ = strings.Cut(line, "//")
			}
			var names []string
			for _, m := range mdPath.FindAllStringSubmatch(line, -1) {
				names = append(names, m[2])
			}
			for _, m := range link.FindAllStringSubmatch(line, -1) {
				if markdown && !strings.Contains(m[1], ":") {
					names = append(names, m[1])
				}
			}
			slices.Sort(names)
			for _, name := range slices.Compact(names) {
				// An absolute path is a container's; bin/ is what the build writes.
				if strings.HasPrefix(name, "/") || strings.HasPrefix(name, "bin/") {
					continue
				}
				if !resolves(root, filepath.Dir(path), name) {
					out = append(out, fmt.Sprintf("%s:%d names %s, which is not in the repository: write what it says into docs/ with its upstream source, or link the upstream URL", rel, n+1, name))
				}
			}
			for _, m := range section.FindAllStringSubmatch(line, -1) {
				if !sections[m[1]] {
					out = append(out, fmt.Sprintf("%s:%d cites §%s, which is no numbered heading of docs/envoy.md", rel, n+1, m[1]))
				}
			}
		}
	}
	return out
}

// The check itself, on a repository of its own: what it must catch, and what
// it must let be.
func TestStrayCitationsAreFound(t *testing.T) {
	root := t.TempDir()
	files := map[string]string{
		"docs/envoy.md": "# Envoy\n## 2. Bodies\n### 2.6 FULL_DUPLEX\n## 12. Sizing\n",
		"docs/ok.md": "See [the modes](envoy.md#2-bodies), docs/envoy.md §2.6 and §12, ../README.md,\n" +
			"https://github.com/llm-d/llm-d/blob/main/docs/operations.md and /usr/share/doc/pd/README.md.\n",
		"README.md": "make bench writes bin/bench.md; [docs](docs/ok.md).\n",
		"docs/bad.md": "From ../notes/PLAN.md and [the review](../../team/refs/review.md),\n" +
			"refs/others.md, §99 and docs/missing.md.\n",
		// The comment marks spelt in pieces, so that this file does not cite them.
		"pkg/x.go": "package x\n\n/" + "/ The rule is in docs/envoy.md §2.6 and in others-2026.md.\nvar y = x.md /" + "/ not a document\n",
	}
	for name, body := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got := strayCitations(t, root)
	want := []string{
		"docs/bad.md:1 names ../notes/PLAN.md",
		"docs/bad.md:1 names ../../team/refs/review.md",
		"docs/bad.md:2 names refs/others.md",
		"docs/bad.md:2 names docs/missing.md",
		"docs/bad.md:2 cites §99",
		"pkg/x.go:3 names others-2026.md",
	}
	for _, w := range want {
		if !slices.ContainsFunc(got, func(g string) bool { return strings.HasPrefix(g, w) }) {
			t.Errorf("not found: %s", w)
		}
	}
	if len(got) != len(want) {
		t.Errorf("found %d citations, want %d:\n%s", len(got), len(want), strings.Join(got, "\n"))
	}
}

// resolves reports whether name is a file or directory inside root, read
// from dir or from root.
func resolves(root, dir, name string) bool {
	for _, base := range []string{dir, root} {
		p := filepath.Join(base, name)
		if r, err := filepath.Rel(root, p); err != nil || r == ".." || strings.HasPrefix(r, ".."+string(filepath.Separator)) {
			continue // outside the repository
		}
		if _, err := os.Stat(p); err == nil {
			return true
		}
	}
	return false
}

// envoySections are the numbers of docs/envoy.md's numbered headings: "2"
// for "## 2. …", "2.6" for "### 2.6 …".
func envoySections(t *testing.T, path string) map[string]bool {
	t.Helper()
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	heading := regexp.MustCompile(`^#{2,4} (\d+(?:\.\d+)*)\.? `)
	out := map[string]bool{}
	for _, line := range strings.Split(string(src), "\n") {
		if m := heading.FindStringSubmatch(line); m != nil {
			out[m[1]] = true
		}
	}
	return out
}

// repoFiles lists the repository's files that keep, by their path relative
// to root; git's own directory, build output and fuzz corpora are skipped.
func repoFiles(t *testing.T, root string, keep func(rel string) bool) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch d.Name() {
			case ".git", "bin", "testdata", "node_modules":
				return filepath.SkipDir
			}
			return nil
		}
		if d.Type().IsRegular() && keep(rel) {
			out = append(out, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func underAny(rel string, dirs []string) bool {
	for _, d := range dirs {
		if strings.HasPrefix(rel, d+string(filepath.Separator)) {
			return true
		}
	}
	return false
}

// structFields counts the fields of each struct type declared in a file; an
// embedded field counts once, like a named one.
func structFields(t *testing.T, path string, src []byte) map[string]int {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), path, src, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	ast.Inspect(f, func(n ast.Node) bool {
		ts, ok := n.(*ast.TypeSpec)
		if !ok {
			return true
		}
		if st, ok := ts.Type.(*ast.StructType); ok {
			for _, field := range st.Fields.List {
				out[ts.Name.Name] += max(len(field.Names), 1)
			}
		}
		return true
	})
	return out
}

// isConfigType: a config type mirrors a file's or a command line's keys, one
// field each, so its size is the user's, not a design choice.
func isConfigType(name string) bool {
	return strings.HasSuffix(name, "Config") || strings.HasSuffix(name, "Options") || name == "options"
}
