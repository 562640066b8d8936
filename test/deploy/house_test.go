package deploy

import (
	"bufio"
	"bytes"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
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

// TestRepositoryStandsAlone: no file cites a document that lives outside the
// repository (the team's working notes); what a comment or doc relies on is
// written down in docs/ with its upstream source.
func TestRepositoryStandsAlone(t *testing.T) {
	// Spelt in pieces so that this file does not match itself.
	outside := regexp.MustCompile(strings.Join([]string{
		`envoy-ext-proc` + `\.md`, `engine-wire` + `-formats`, `wire-` + `audit`, `peers(-2026)?` + `\.md`,
		`DESIGN` + `(\.md| §)`, `shared` + `/reference`, `\.\./` + `shared/`, `operator-` + `audit`, `envoy-` + `fidelity`,
	}, "|"))
	root := testbed.MustRepoRoot(t)
	for _, path := range repoFiles(t, root, func(string) bool { return true }) {
		rel, _ := filepath.Rel(root, path)
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(nil, 1<<20)
		for line := 1; sc.Scan(); line++ {
			if m := outside.FindString(sc.Text()); m != "" {
				t.Errorf("%s:%d cites %q, a document outside the repository: write the fact into docs/ with its upstream source", rel, line, m)
			}
		}
		f.Close()
	}
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
