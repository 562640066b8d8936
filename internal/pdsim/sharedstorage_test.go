package pdsim

import (
	"path/filepath"
	"strings"
	"testing"
)

func TestSharedStorage(t *testing.T) {
	dir := t.TempDir()
	p := start(t, Config{Role: RolePrefill, Protocol: ProtocolSharedStorage, SharedDir: dir})
	d := start(t, Config{Role: RoleDecode, Protocol: ProtocolSharedStorage, SharedDir: dir})
	prompt := chat("shared storage prompt", `,"max_tokens":3`)

	steps := []struct {
		name      string
		s         *Server
		body, kv  string
		requestID string // KV's origin the decode reports
	}{
		{"decode before any prefill recomputes", d, prompt, kvMiss, ""},
		{"prefill saves the KV", p, chat("shared storage prompt", `,"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}`), kvIssued, ""},
		{"decode loads it", d, prompt, kvHit, "req-P"},
		{"decode of another prompt misses", d, chat("another prompt", ""), kvMiss, ""},
	}
	for _, st := range steps {
		r := post(t, st.s, "/v1/chat/completions", st.body, "req-P")
		if r.status != 200 || r.header.Get("x-pdsim-kv") != st.kv || r.header.Get("x-pdsim-kv-request-id") != st.requestID {
			t.Fatalf("%s: %d %v %s", st.name, r.status, r.header, r.body)
		}
		if strings.Contains(string(r.body), "remote_block_ids") {
			t.Errorf("%s: kv_transfer_params in answer %s", st.name, r.body)
		}
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.kv"))
	hit := d.Requests()[1]
	if len(files) != 1 || hit.KVSource != files[0] {
		t.Errorf("files %v, hit record %+v", files, hit)
	}
}
