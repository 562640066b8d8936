package pipeline_test

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"testing"

	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/server/assemble"
)

// TestManySmallElementsCostLittle: a body within limits.max_body_bytes
// whose arrays hold millions of tiny elements is routed for a few times its
// size in memory, as limits.max_buffered_bytes counts on (4 bytes a body
// byte, 8 at most). Each element was kept, decoded or indexed on its own:
// 100 to 500 times the body's size allocated, gigabytes for one 32 MiB body,
// and seconds of CPU.
func TestManySmallElementsCostLittle(t *testing.T) {
	const size = 1 << 20
	tests := []struct {
		name, connector, policy, path, head, elem, tail string
	}{
		{"a completions batch of empty strings", "kv-nixl", "least-load", "/v1/completions", `{"model":"m","prompt":[`, `"",`, `""]}`},
		{"SGLang's generate with a list of sampling_params", "kv-sglang", "least-load", "/generate", `{"text":"a","sampling_params":[`, `{},`, `{}]}`},
		{"chat messages that are numbers, under prefix-affinity", "kv-nixl", "prefix-affinity", "/v1/chat/completions", `{"model":"m","messages":[`, `0,`, `0]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			engine := enginetest.Start(t, enginetest.JSON(200, `{}`))
			cfg, err := config.Parse(fmt.Appendf(nil, "connector: %s\npd: {mode: %s}\npools: {prefill: {endpoints: [%q]}, decode: {policy: %s, endpoints: [\"10.1.1.1:8000\"]}}\n",
				tt.connector, map[bool]string{true: "always", false: "never"}[tt.connector == "kv-sglang"], engine.Addr(), tt.policy))
			if err != nil {
				t.Fatal(err)
			}
			p, err := assemble.Pipeline(cfg, logr.Discard())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Wait(); pipeline.CloseIdle(p) })
			var b bytes.Buffer
			b.WriteString(tt.head)
			for b.Len() < size {
				b.WriteString(tt.elem)
			}
			b.WriteString(tt.tail)
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: tt.path, RequestID: "r", Body: b.Bytes()})
			runtime.ReadMemStats(&after)
			if err != nil {
				t.Fatal(err)
			}
			d.Release()
			// The prompt's rendering and the prefix index take some 7 times
			// the body; the race detector's instrumentation twice that.
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 20*uint64(b.Len()) {
				t.Errorf("routing a body of %d KiB allocated %d KiB (%.0f times its size), want at most 20 times", b.Len()>>10, alloc>>10, float64(alloc)/float64(b.Len()))
			}
		})
	}
}
