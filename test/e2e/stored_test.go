package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// TestStoredResponseReturnsToItsEngine: among three decode engines taken in
// turn, a follow-up naming a stored response (previous_response_id) and its
// GET reach the engine that stored it, which answers them; behind several
// extproc replicas too, which share nothing. A DELETE passes through to the
// engine's 405: neither vLLM nor SGLang serves it.
func TestStoredResponseReturnsToItsEngine(t *testing.T) {
	tests := []struct {
		name, mode string
		replicas   int
	}{
		{"one replica", "full_duplex", 1},
		{"three replicas, buffered", "buffered", 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: tt.mode, replicas: tt.replicas, decodes: 3, decodePool: "policy: round-robin"})
			marker := "[stored " + tt.name + "]"
			resp, got := r.must(t, "/v1/responses", `{"model":"pdsim","input":"`+marker+` first","max_output_tokens":4}`, nil)
			var first struct{ ID string }
			if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(got), &first) != nil || first.ID == "" {
				t.Fatalf("first: status %d: %.300s", resp.StatusCode, got)
			}
			legs := legsOn(r.decode, marker+" first")
			stored := slices.Index(legs, 1)
			if sum(legs) != 1 || stored < 0 {
				t.Fatalf("first request's decode legs %v, want one", legs)
			}
			for i := range 4 {
				next := fmt.Sprintf("%s next %d", marker, i)
				body := fmt.Sprintf(`{"model":"pdsim","input":%q,"previous_response_id":%q,"max_output_tokens":4}`, next, first.ID)
				if resp, got := r.must(t, "/v1/responses", body, nil); resp.StatusCode != http.StatusOK {
					t.Errorf("follow-up %d: status %d (%.200s); decode legs %v, the response is on %d", i, resp.StatusCode, got, legsOn(r.decode, next), stored)
				}
			}
			for i := range 3 {
				if resp, got := r.get(t, "/v1/responses/"+first.ID); resp.StatusCode != http.StatusOK {
					t.Errorf("GET %d: status %d (%.200s)", i, resp.StatusCode, got)
				}
			}
			req, _ := http.NewRequest(http.MethodDelete, r.proxy.URL()+"/v1/responses/"+first.ID, nil)
			del, err := testbed.Client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			del.Body.Close()
			if del.StatusCode != http.StatusMethodNotAllowed || del.Header.Get("Allow") != "GET" {
				t.Errorf("DELETE: status %d (Allow %q), want the engine's 405 (Allow GET)", del.StatusCode, del.Header.Get("Allow"))
			}
			if resp, _ := r.get(t, "/v1/responses/"+first.ID); resp.StatusCode != http.StatusOK {
				t.Errorf("GET after DELETE: status %d, want 200: nothing was deleted", resp.StatusCode)
			}
		})
	}
}
