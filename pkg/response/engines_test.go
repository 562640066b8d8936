package response

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// TestRewriterOnEveryEngineShape: each API's answer, whole and streamed, as
// vLLM's decode engine prints it under P/D (testdata/usage/README.md names
// the upstream source of each), reaches the client with the prefill
// engine's count and every other byte as it came, however Envoy cuts it;
// a reader (a decode-only answer's) reads the decode engine's count, 41.
func TestRewriterOnEveryEngineShape(t *testing.T) {
	tests := []struct {
		file string
		api  *api.API
	}{
		{"chat", api.Chat},
		{"completions", api.Completions},
		{"generate", api.Generate},
		{"responses", api.Responses},
		{"messages", api.Messages},
	}
	types := map[string]string{"json": "application/json", "sse": "text/event-stream"}
	for _, tt := range tests {
		s := tt.api.Shape
		paths := Paths{JSON: s.CachedTokens, Event: s.CachedTokensInEvents, Uncached: s.UncachedTokens}
		var uncached []byte
		if paths.Uncached != nil {
			uncached = []byte("9")
		}
		for ext, contentType := range types {
			t.Run(tt.file+"."+ext, func(t *testing.T) {
				engine := readUsageFile(t, tt.file+".engine."+ext)
				want := readUsageFile(t, tt.file+".client."+ext)
				for cut := range len(engine) { // 0: in one chunk
					r := New(paths, []byte("32"), uncached, 1<<20)
					r.Start(200, contentType, "")
					got := string(r.Body([]byte(engine[:cut]), false).Bytes()) + string(r.Body([]byte(engine[cut:]), true).Bytes())
					if got != want || r.Outcome() != metrics.UsageRewritten {
						t.Fatalf("cut at %d the client got (outcome %q)\n%s\nwant\n%s", cut, r.Outcome(), got, want)
					}
					var seen string
					reader := NewReader(paths, 1<<20, func(raw []byte, stated bool) { seen = string(raw) })
					reader.Start(200, contentType, "")
					got = string(reader.Body([]byte(engine[:cut]), false).Bytes()) + string(reader.Body([]byte(engine[cut:]), true).Bytes())
					if got != engine || seen != "41" {
						t.Fatalf("cut at %d a reader let through\n%s\nand read %q; want the answer unchanged and 41", cut, got, seen)
					}
				}
			})
		}
	}
}

func readUsageFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "usage", name))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Clone(string(b))
}
