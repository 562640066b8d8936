package e2e

import (
	"bytes"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// What an operator sees of the binary before any request: the build it is, and how it treats
// the config it is given (or not given).
func TestBinaryStartup(t *testing.T) {
	// Built as the Makefile and the Dockerfile build it: the version stamped at link time.
	const stamped = "v1.2.3-4-gabcdef0"
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "extproc")
	build := exec.Command("go", "build", "-o", bin,
		"-ldflags", "-X github.com/pd-extproc/pd-extproc/pkg/version.Version="+stamped+" -X github.com/pd-extproc/pd-extproc/pkg/version.Revision=abcdef0123",
		"./cmd/extproc")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	noConnector := filepath.Join(t.TempDir(), "extproc.yaml")
	if err := os.WriteFile(noConnector, []byte(`pools: {decode: {endpoints: ["10.1.1.1:8000"]}}`), 0o600); err != nil {
		t.Fatal(err)
	}

	exits := []struct {
		name     string
		args     []string
		wantCode int
		want     []string // in its output
	}{
		{"--version", []string{"--version"}, 0, []string{"extproc " + stamped + " (revision abcdef0123, go1."}},
		{"a config without connector", []string{"--config", noConnector, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, 1,
			[]string{"connector: not set", "kv-nixl", "kv-shared-storage", "kv-sglang"}},
	}
	for _, tc := range exits {
		t.Run(tc.name, func(t *testing.T) {
			out, err := exec.Command(bin, tc.args...).CombinedOutput()
			code := 0
			if ee, ok := err.(*exec.ExitError); ok {
				code = ee.ExitCode()
			} else if err != nil {
				t.Fatal(err)
			}
			if code != tc.wantCode {
				t.Errorf("exit code %d, want %d\n%s", code, tc.wantCode, out)
			}
			for _, w := range tc.want {
				if !bytes.Contains(out, []byte(w)) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
		})
	}

	// Without --config it runs, not ready, and says which build it is.
	x := testbed.MustStartExtproc(t, testbed.ExtprocConfig{Bin: bin, Wait: testbed.WaitStarted})
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + x.AdminAddr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz without --config = %d %q, want 503", code, body)
	}
	_, metrics := get("/metrics")
	if want := `pd_extproc_build_info{goversion="go1.`; !strings.Contains(metrics, want) ||
		!strings.Contains(metrics, `revision="abcdef0123",version="`+stamped+`"} 1`) {
		t.Errorf("/metrics lacks the build_info series of %s:\n%s", stamped, grepLines(metrics, "build_info"))
	}
}

// grepLines keeps the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
