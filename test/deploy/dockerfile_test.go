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
		{"ARG GOEXPERIMENT=simd, as the Makefile builds (AVX2 body scanner)", slices.Contains(build.instructions, "ARG GOEXPERIMENT="+makefileVar(t, "GOEXPERIMENT"))},
		{"the build runs with the GOEXPERIMENT argument", strings.Contains(buildRun, "GOEXPERIMENT=$GOEXPERIMENT go build")},
		{"-trimpath", strings.Contains(buildRun, "-trimpath")},
		{`-ldflags "-s -w`, strings.Contains(buildRun, `-ldflags "-s -w`)},
		// The version make image passes reaches the binary (--version, pd_extproc_build_info).
		{"ARG VERSION and REVISION", slices.Contains(build.instructions, "ARG VERSION=dev") && slices.Contains(build.instructions, "ARG REVISION=")},
		{"the version stamped with -X", strings.Contains(buildRun, "-X "+versionPkg+".Version=$VERSION") && strings.Contains(buildRun, "-X "+versionPkg+".Revision=$REVISION")},
		{"OCI version and revision labels", slices.ContainsFunc(final.instructions, func(i string) bool {
			return strings.HasPrefix(i, "LABEL ") && strings.Contains(i, `org.opencontainers.image.version="$VERSION"`) &&
				strings.Contains(i, `org.opencontainers.image.revision="$REVISION"`) && strings.Contains(i, `org.opencontainers.image.licenses="Apache-2.0"`)
		})},
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

// versionPkg is where the version is stamped at link time.
const versionPkg = "github.com/pd-extproc/pd-extproc/pkg/version"

// makefileVar is the default a Makefile variable is given (VAR ?= value, or VAR := value).
func makefileVar(t *testing.T, name string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^(?:export )?` + name + `\s*[?:]?=\s*(\S*)`).FindStringSubmatch(string(mustRead(t, testbed.MustRepoPath(t, "Makefile"))))
	if m == nil {
		t.Fatalf("the Makefile does not set %s", name)
	}
	return m[1]
}

// make image builds the Dockerfile with the Makefile's GOEXPERIMENT, under the name the compose
// demo and the chart (installed from a checkout) run.
func TestMakeImage(t *testing.T) {
	mk := string(mustRead(t, testbed.MustRepoPath(t, "Makefile")))
	recipe := regexp.MustCompile(`(?m)^image:.*\n\t(.*)$`).FindStringSubmatch(mk)
	if recipe == nil {
		t.Fatal("the Makefile has no image target")
	}
	for _, want := range []string{"docker build", "--build-arg GOEXPERIMENT=$(GOEXPERIMENT)", "--build-arg VERSION=$(VERSION)", "--build-arg REVISION=$(REVISION)", "-t $(IMAGE)"} {
		if !strings.Contains(recipe[1], want) {
			t.Errorf("make image runs %q, which lacks %q", recipe[1], want)
		}
	}
	image := makefileVar(t, "IMAGE")
	dep := find(t, chartManifests(t, "defaults"), "Deployment", "pd-extproc")
	if got := digString(dig(dep, "spec", "template", "spec", "containers").([]any)[0], "image"); got != image {
		t.Errorf("the chart's pd-extproc Deployment runs %q by default, not %q, the image make image builds (kind load docker-image %s)", got, image, image)
	}
}

// The Makefile stamps every binary it builds with the version of the checkout (git describe),
// the one make image and make release-dry-run pass on.
func TestMakefileStampsTheVersion(t *testing.T) {
	mk := string(mustRead(t, testbed.MustRepoPath(t, "Makefile")))
	recipe := func(target string) string {
		m := regexp.MustCompile(`(?m)^` + target + `:.*\n((?:\t.*\n)+)`).FindStringSubmatch(mk)
		if m == nil {
			t.Fatalf("the Makefile has no %s target", target)
		}
		return m[1]
	}
	checks := []struct {
		what string
		ok   bool
	}{
		{"VERSION from git describe", strings.Contains(mk, "VERSION  ?= $(shell git describe --tags --always --dirty")},
		{"LDFLAGS stamp the version and revision", strings.Contains(mk, "-X "+versionPkg+".Version=$(VERSION)") && strings.Contains(mk, "-X "+versionPkg+".Revision=$(REVISION)")},
		{"make build links with LDFLAGS", strings.Contains(recipe("build"), `-ldflags "$(LDFLAGS)"`)},
		{"make release-dry-run builds linux/amd64 and linux/arm64 with LDFLAGS", strings.Contains(recipe("release-dry-run"), "for arch in amd64 arm64") &&
			strings.Contains(recipe("release-dry-run"), "GOOS=linux GOARCH=$$arch") && strings.Contains(recipe("release-dry-run"), "$(LDFLAGS)")},
		{"make release-dry-run prints the image tagged with VERSION", strings.Contains(recipe("release-dry-run"), "-t $(REGISTRY):$(VERSION)")},
		{"make release-dry-run packages the chart with VERSION", strings.Contains(recipe("release-dry-run"), "go run ./hack/release -version $(VERSION) -image $(REGISTRY)") ||
			strings.Contains(recipe("release-dry-run"), "$(GO) run ./hack/release -version $(VERSION) -image $(REGISTRY)")},
	}
	for _, c := range checks {
		if !c.ok {
			t.Errorf("Makefile: %s", c.what)
		}
	}
}
