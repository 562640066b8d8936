package deploy

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/scanner"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// The size limits of docs/architecture.md (rule 7): past them a file or a
// struct is doing more than one job and is split by concern.
const (
	maxFileLines    = 400
	maxFuncLines    = 80
	maxStructFields = 15
)

// lineLimited are the trees whose non-test Go files keep to maxFileLines.
var lineLimited = []string{"pkg", "internal/envoyemu"}

// TestSizeLimits keeps rule 7 true: no non-test Go file in pkg/ or the
// emulator over maxFileLines nor any of its functions over maxFuncLines, and
// no struct in a non-test Go file anywhere over maxStructFields, config types
// (named …Config or …Options) aside.
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
		for name, n := range funcLines(t, path, src) {
			if n > maxFuncLines && underAny(rel, lineLimited) {
				t.Errorf("%s: func %s has %d lines; split it by concern (at most %d)", rel, name, n, maxFuncLines)
			}
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
// upstream document is named by its URL. Every Markdown path, every relative
// link and every path that goes up (../, to a file or a directory) must
// resolve inside the repository, from the file's directory or from the root;
// every §N must be a numbered heading of docs/envoy.md. A Go file names
// documents in its comments, of both kinds, and its string literals; any other
// file anywhere. URLs, absolute paths (a container's) and what the build
// writes (bin/) are not documents.
func TestRepositoryStandsAlone(t *testing.T) {
	root := testbed.MustRepoRoot(t)
	if n := len(envoySections(t, filepath.Join(root, filepath.FromSlash("docs/envoy.md")))); n < 10 {
		t.Fatalf("docs/envoy.md has %d numbered headings: the heading format changed", n)
	}
	for _, s := range strayCitations(t, root) {
		t.Error(s)
	}
}

var (
	urlPattern = regexp.MustCompile(`[a-z][a-z0-9+.-]*://\S+`)
	// pathPattern is a relative path: it starts after a character that is
	// none of a path's, nor ~, so that no part of an absolute path (a
	// container's) or of a home directory's is read as one.
	pathPattern = regexp.MustCompile(`(?:^|[^\w./~-])([\w.-]+(?:/[\w.-]+)*/?)`)
	linkPattern = regexp.MustCompile(`\]\(([^)#\s]+)[^)]*\)`)
	sectionMark = regexp.MustCompile(`§\s?(\d+(?:\.\d+)*)`)
)

// strayCitations are the citations of documents outside the repository
// rooted at root, one line each.
func strayCitations(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	sections := envoySections(t, filepath.Join(root, filepath.FromSlash("docs/envoy.md")))
	for _, path := range repoFiles(t, root, func(string) bool { return true }) {
		rel, _ := filepath.Rel(root, path)
		src, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.IndexByte(src, 0) >= 0 {
			continue // binary
		}
		for _, l := range prose(t, rel, src) {
			for _, name := range documentNames(urlPattern.ReplaceAllString(l.text, "")) {
				if !resolves(root, filepath.Dir(path), name) {
					out = append(out, fmt.Sprintf("%s:%d names %s, which is not in the repository: write what it says into docs/ with its upstream source, or link the upstream URL", rel, l.n, name))
				}
			}
			for _, m := range sectionMark.FindAllStringSubmatch(l.text, -1) {
				if !sections[m[1]] {
					out = append(out, fmt.Sprintf("%s:%d cites §%s, which is no numbered heading of docs/envoy.md", rel, l.n, m[1]))
				}
			}
		}
	}
	return out
}

// documentNames are the relative paths in text that may name a document
// outside the repository: a Markdown file, a link's target, a path that goes
// up.
func documentNames(text string) []string {
	var names []string
	for _, m := range pathPattern.FindAllStringSubmatch(text, -1) {
		p := strings.TrimRight(m[1], ".") // a sentence's full stop
		markdown := strings.HasSuffix(p, ".md") && len(filepath.Base(p)) > len(".md")
		if markdown || strings.HasPrefix(p, "../") { // ../ may leave the repository, a document or not
			names = append(names, p)
		}
	}
	for _, m := range linkPattern.FindAllStringSubmatch(text, -1) {
		if !strings.Contains(m[1], ":") { // a URL's scheme, or mailto:
			names = append(names, m[1])
		}
	}
	slices.Sort(names)
	return slices.DeleteFunc(slices.Compact(names), func(name string) bool {
		// An absolute path is a container's; bin/ is what the build writes.
		return strings.HasPrefix(name, "/") || strings.HasPrefix(name, "bin/")
	})
}

// line is a piece of a file's text and the number of the line it is on.
type line struct {
	n    int
	text string
}

// prose is what of a file may name a document, line by line: a Go file's
// comments and string literals (an interpreted string on one line), any
// other file whole.
func prose(t *testing.T, rel string, src []byte) []line {
	t.Helper()
	var out []line
	if !strings.HasSuffix(rel, ".go") {
		for i, text := range strings.Split(string(src), "\n") {
			out = append(out, line{i + 1, text})
		}
		return out
	}
	file := token.NewFileSet().AddFile(rel, -1, len(src))
	var s scanner.Scanner
	s.Init(file, src, func(pos token.Position, msg string) { t.Errorf("%s: %s", pos, msg) }, scanner.ScanComments)
	for {
		pos, tok, lit := s.Scan()
		if tok == token.EOF {
			return out
		}
		if tok != token.COMMENT && tok != token.STRING {
			continue
		}
		if tok == token.STRING && lit[0] == '"' {
			u, err := strconv.Unquote(lit)
			if err != nil {
				t.Fatalf("%s: %v", file.Position(pos), err)
			}
			lit = strings.ReplaceAll(u, "\n", " ")
		}
		for i, text := range strings.Split(lit, "\n") {
			out = append(out, line{file.Line(pos) + i, text})
		}
	}
}

// The check itself, on a repository of its own (testdata/stray, which the
// check of this repository skips): what it must catch (testdata/stray.txt) in
// Markdown, Go comments of both kinds and string literals, YAML, a Makefile
// and a shell script; and what it must let be (Go code, URLs, a container's
// paths, build output, ./ paths, the root's own documents).
func TestStrayCitationsAreFound(t *testing.T) {
	got := strayCitations(t, filepath.Join("testdata", "stray"))
	want, err := os.ReadFile(filepath.Join("testdata", "stray.txt"))
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, g := range got {
		c, _, _ := strings.Cut(g, ", which")
		found = append(found, c)
	}
	for _, w := range strings.Split(strings.TrimSpace(string(want)), "\n") {
		if i := slices.Index(found, w); i >= 0 {
			found = slices.Delete(found, i, i+1)
		} else {
			t.Errorf("not found: %s", w)
		}
	}
	for _, f := range found {
		t.Errorf("found, not in testdata/stray.txt: %s", f)
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

// funcLines counts the lines of each function and method declared in src, from
// its func keyword to its closing brace.
func funcLines(t *testing.T, path string, src []byte) map[string]int {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, src, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, d := range f.Decls {
		if fd, ok := d.(*ast.FuncDecl); ok && fd.Body != nil {
			from := fset.Position(fd.Pos()).Line
			out[fmt.Sprintf("%s (line %d)", fd.Name.Name, from)] = fset.Position(fd.End()).Line - from + 1
		}
	}
	return out
}

// isConfigType: a config type mirrors a file's or a command line's keys, one
// field each, so its size is the user's, not a design choice.
func isConfigType(name string) bool {
	return strings.HasSuffix(name, "Config") || strings.HasSuffix(name, "Options") || name == "options"
}

// TestClientErrorsAreBuiltInOnePlace keeps rule 5 of docs/architecture.md true: every error a
// client gets from pd-extproc is built in pkg/pipeline/errors.go, where its status is chosen
// beside every other; no other non-test Go file writes a pipeline.Error literal.
func TestClientErrorsAreBuiltInOnePlace(t *testing.T) {
	root := testbed.MustRepoRoot(t)
	literal := regexp.MustCompile(`\bError\{\s*Status:`)
	for _, path := range repoFiles(t, root, func(rel string) bool {
		return strings.HasSuffix(rel, ".go") && !strings.HasSuffix(rel, "_test.go") && underAny(rel, []string{"pkg"})
	}) {
		rel, _ := filepath.Rel(root, path)
		if filepath.ToSlash(rel) == "pkg/pipeline/errors.go" {
			continue
		}
		if literal.Match(mustRead(t, path)) {
			t.Errorf("%s builds a client error itself; add a constructor to pkg/pipeline/errors.go", rel)
		}
	}
}
