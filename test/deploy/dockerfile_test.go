package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// dockerStage is one FROM … block of the Dockerfile, its instructions joined across
// backslash continuations.
type dockerStage struct {
	from         string
	instructions []string
}

func parseDockerfile(t *testing.T) []dockerStage {
	t.Helper()
	data, err := os.ReadFile(testbed.MustRepoPath(t, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	var stages []dockerStage
	var cur strings.Builder
	flush := func() {
		ins := strings.Join(strings.Fields(cur.String()), " ")
		cur.Reset()
		if ins == "" {
			return
		}
		if from, ok := strings.CutPrefix(ins, "FROM "); ok {
			stages = append(stages, dockerStage{from: from})
			return
		}
		if len(stages) > 0 {
			stages[len(stages)-1].instructions = append(stages[len(stages)-1].instructions, ins)
		}
	}
	for _, line := range strings.Split(string(data), "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") {
			continue
		}
		if body, cont := strings.CutSuffix(trimmed, "\\"); cont {
			cur.WriteString(body + " ")
			continue
		}
		cur.WriteString(trimmed)
		flush()
	}
	flush()
	return stages
}

// The image contract compose and the Kubernetes manifests rely on: static binaries on
// distroless as a numeric non-root user, extproc as entrypoint, pdsim next to it.
func TestDockerfile(t *testing.T) {
	stages := parseDockerfile(t)
	if len(stages) < 2 {
		t.Fatalf("want a multi-stage build, got %d stages", len(stages))
	}
	build, final := stages[0], stages[len(stages)-1]
	buildRun := strings.Join(build.instructions, "\n")
	has := func(s dockerStage, prefix string) bool {
		return slices.ContainsFunc(s.instructions, func(i string) bool { return strings.HasPrefix(i, prefix) })
	}

	goVersion := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindStringSubmatch(string(mustRead(t, testbed.MustRepoPath(t, "go.mod"))))
	if goVersion == nil {
		t.Fatal("go.mod has no go directive")
	}
	cmds, err := filepath.Glob(filepath.Join(testbed.MustRepoRoot(t), "cmd", "*"))
	if err != nil {
		t.Fatal(err)
	}

	checks := []struct {
		what string
		ok   bool
	}{
		// The builder must run the Go release go.mod asks for.
		{"builder is golang:" + goVersion[1], strings.Contains(build.from, "golang:"+goVersion[1]+" ") || strings.HasSuffix(build.from, "golang:"+goVersion[1])},
		{"module cache mount", strings.Contains(buildRun, "--mount=type=cache,target=/go/pkg/mod")},
		{"build cache mount", strings.Contains(buildRun, "--mount=type=cache,target=/root/.cache/go-build")},
		{"CGO_ENABLED=0 (distroless/static has no libc)", strings.Contains(buildRun, "CGO_ENABLED=0")},
		{"GOEXPERIMENT=simd, as the Makefile builds (AVX2 body scanner)", strings.Contains(buildRun, "GOEXPERIMENT=simd")},
		{"-trimpath", strings.Contains(buildRun, "-trimpath")},
		{`-ldflags "-s -w"`, strings.Contains(buildRun, `-ldflags "-s -w"`)},
		{"final stage is distroless static nonroot", final.from == "gcr.io/distroless/static-debian12:nonroot"},
		{"numeric non-root USER (lets Kubernetes verify runAsNonRoot)", slices.Contains(final.instructions, "USER 65532:65532")},
		{"EXPOSE 9002 9090", slices.Contains(final.instructions, "EXPOSE 9002 9090")},
		{"ENTRYPOINT extproc", slices.Contains(final.instructions, `ENTRYPOINT ["/usr/local/bin/extproc"]`)},
		{"binaries copied to /usr/local/bin", has(final, "COPY --from=build /out/extproc /out/pdsim /usr/local/bin/")},
	}
	for _, c := range checks {
		if !c.ok {
			t.Errorf("Dockerfile: %s", c.what)
		}
	}
	for _, dir := range cmds {
		if !strings.Contains(buildRun, "./cmd/"+filepath.Base(dir)) {
			t.Errorf("Dockerfile does not build ./cmd/%s", filepath.Base(dir))
		}
	}
}

// .dockerignore must keep everything the build compiles or embeds in the context.
func TestDockerignoreKeepsBuildInputs(t *testing.T) {
	var patterns []string
	for _, line := range strings.Split(string(mustRead(t, testbed.MustRepoPath(t, ".dockerignore"))), "\n") {
		if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") {
			patterns = append(patterns, strings.TrimSuffix(l, "/"))
		}
	}
	needed := []string{"go.mod", "go.sum", "cmd/extproc/main.go", "cmd/pdsim/main.go", "config/embed.go", "config/extproc.yaml"}
	for _, dir := range []string{"pkg", "internal"} {
		if _, err := os.Stat(testbed.MustRepoPath(t, dir)); err == nil {
			needed = append(needed, dir+"/x.go")
		}
	}
	for _, path := range needed {
		for _, p := range patterns {
			if ignores(p, path) {
				t.Errorf(".dockerignore pattern %q drops %s, which the image build needs", p, path)
			}
		}
	}
}

// ignores approximates Docker's matching: a pattern drops a path when it matches the path or
// one of its parent directories; "**/" matches at any depth.
func ignores(pattern, path string) bool {
	parts := strings.Split(path, "/")
	for i := 1; i <= len(parts); i++ {
		prefix := strings.Join(parts[:i], "/")
		if ok, _ := filepath.Match(pattern, prefix); ok {
			return true
		}
		if rest, deep := strings.CutPrefix(pattern, "**/"); deep {
			if ok, _ := filepath.Match(rest, parts[i-1]); ok {
				return true
			}
		}
	}
	return false
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
