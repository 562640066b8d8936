package deploy

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// yamlDocuments splits a multi-document YAML file and converts each non-empty document to a
// generic map (through JSON, as kubectl and Envoy do), so tests see what the tools see.
func yamlDocuments(t testing.TB, path string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var docs []map[string]any
	for i, part := range splitYAML(data) {
		var doc map[string]any
		if err := yaml.Unmarshal(part, &doc); err != nil {
			t.Fatalf("%s: document %d: %v", path, i, err)
		}
		if doc != nil {
			docs = append(docs, doc)
		}
	}
	return docs
}

// splitYAML cuts a YAML stream at "---" document separators.
func splitYAML(data []byte) [][]byte {
	var parts [][]byte
	var cur bytes.Buffer
	for _, line := range strings.SplitAfter(string(data), "\n") {
		if strings.TrimRight(line, " \t\r\n") == "---" {
			parts = append(parts, bytes.Clone(cur.Bytes()))
			cur.Reset()
			continue
		}
		cur.WriteString(line)
	}
	return append(parts, cur.Bytes())
}

// dig walks a generic YAML/JSON value along map keys; it returns nil when a key is missing.
func dig(v any, keys ...string) any {
	for _, k := range keys {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

// digString is dig for leaf strings.
func digString(v any, keys ...string) string {
	s, _ := dig(v, keys...).(string)
	return s
}

// toolTimeout bounds one tool run; egctl and docker-compose answer in seconds, so a run that
// takes longer is stuck (e.g. waiting on a network) and should fail rather than hang CI.
const toolTimeout = 2 * time.Minute

// runTool runs a command and returns stdout; on failure the error carries stderr, which is
// where docker-compose and egctl explain what is wrong with the input.
func runTool(t testing.TB, dir string, name string, args ...string) ([]byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), toolTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), errors.Join(err, errors.New(strings.TrimSpace(stderr.String())))
	}
	return stdout.Bytes(), nil
}
