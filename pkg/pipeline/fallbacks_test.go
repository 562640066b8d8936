package pipeline_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// TestAPullOfBlocksHandedOutIsOfferedItsPickAlone: under kv-nixl the decode
// engine reads the prefill engine's blocks by id, and the prefill engine
// frees them once one decode engine has read them (or its serving layer
// refused the request). A gateway retrying the same body on a fallback after
// that would have the fallback read blocks since given to other requests,
// and nothing tells it. So a decode leg carrying handed-out
// kv_transfer_params is offered its pick alone; decode-only requests, and
// connectors whose decode leg pulls nothing handed out, keep their fallbacks.
func TestAPullOfBlocksHandedOutIsOfferedItsPickAlone(t *testing.T) {
	tests := []struct {
		name, connector string
		prefill         http.HandlerFunc
		offered         int  // endpoints Envoy may send the decode leg to
		params          bool // the decode body carries kv_transfer_params
	}{
		{"kv-nixl, the prefill hands out its blocks", "kv-nixl", enginetest.JSON(200, `{"kv_transfer_params":`+prefillKV+`}`), 1, true},
		{"kv-nixl, the prefill fails: decode-only", "kv-nixl", enginetest.JSON(500, `{"error":"boom"}`), 2, false},
		{"kv-shared-storage: the KV is read from the store", "kv-shared-storage", enginetest.JSON(200, `{"choices":[]}`), 2, false},
		{"kv-shared-storage, kv_transfer_params in the prefill answer all the same", "kv-shared-storage",
			enginetest.JSON(200, `{"kv_transfer_params":`+prefillKV+`}`), 2, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			engine := enginetest.Start(t, tt.prefill)
			p, _, _ := newPipeline(t, fmt.Sprintf("connector: %s\npools: {prefill: {endpoints: [%q]}, "+
				"decode: {fallbacks: 1, endpoints: [\"10.1.1.1:8000\", \"10.1.1.2:8000\"]}}\n", tt.connector, engine.Addr()))
			t.Cleanup(p.Wait)
			d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: http.MethodPost, Path: "/v1/chat/completions",
				RequestID: "r1", Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)})
			if err != nil {
				t.Fatal(err)
			}
			d.Release()
			if got := strings.Contains(string(d.Body.Bytes()), `"kv_transfer_params"`); got != tt.params {
				t.Fatalf("decode body %s: kv_transfer_params %v, want %v", d.Body.Bytes(), got, tt.params)
			}
			if len(d.Endpoints) != tt.offered {
				t.Errorf("offered %q, want %d endpoints", d.Endpoints, tt.offered)
			}
		})
	}
}
