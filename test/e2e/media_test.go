package e2e

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// TestANewImageInALaterTurnGetsAPrefillLeg: under the cache rule, a later
// turn whose only new text is short goes decode-only, but one that brings
// a new image (a URL, or a data: URI) gets its prefill leg: the decode
// engine would encode the image and compute its tokens in its decode steps,
// which the image part's JSON does not tell. A later turn that only repeats
// the images seen goes decode-only.
func TestANewImageInALaterTurnGetsAPrefillLeg(t *testing.T) {
	type part map[string]any
	image := func(url string) part { return part{"type": "image_url", "image_url": part{"url": url}} }
	text := func(s string) part { return part{"type": "text", "text": s} }
	tests := []struct {
		name        string
		newParts    []part // turn 2's user parts, after its text
		wantPrefill int    // legs in all, over turns 1 to 3
	}{
		{name: "a new image URL", newParts: []part{image("https://images.example/b.png")}, wantPrefill: 2},
		{name: "a new data: URI", newParts: []part{image("data:image/png;base64,iVBORw0KGgoAAAANSUhEUg==")}, wantPrefill: 2},
		{name: "no new image", wantPrefill: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{decodes: 2, promptTokensDetails: true, decodePool: "policy: prefix-affinity",
				prefillPool: "policy: prefix-affinity", extra: "pd: {min_uncached_tokens: 100}"})
			marker := "[images " + tt.name + "]"
			history := []any{
				part{"role": "system", "content": strings.Repeat("You describe pictures as a careful assistant would. ", 30)},
				part{"role": "user", "content": []part{text(marker + " What is in this picture?"), image("https://images.example/a.png")}},
			}
			turns := [][]part{append([]part{text("And in this one?")}, tt.newParts...), {text("Which is brighter?")}}
			send := func(turn int) {
				t.Helper()
				b, err := json.Marshal(map[string]any{"model": "pdsim", "max_tokens": 4, "messages": history})
				if err != nil {
					t.Fatal(err)
				}
				if resp, got := r.must(t, "/v1/chat/completions", string(b), nil); resp.StatusCode != http.StatusOK {
					t.Fatalf("turn %d: status %d: %s", turn, resp.StatusCode, got)
				}
			}
			send(1)
			for i, user := range turns {
				history = append(history, part{"role": "assistant", "content": "A picture."}, part{"role": "user", "content": user})
				send(i + 2)
			}
			if n := sum(legsOn(r.prefill, marker)); n != tt.wantPrefill {
				t.Errorf("%d prefill legs over three turns, want %d", n, tt.wantPrefill)
			}
			if n := sum(legsOn(r.decode, marker)); n != 3 {
				t.Errorf("%d decode legs over three turns, want 3", n)
			}
			cached, err := r.replicas[0].Metric(t.Context(), `pd_extproc_pd_decisions_total{reason="cached_prefix"}`)
			if err != nil {
				t.Fatal(err)
			}
			if want := float64(3 - tt.wantPrefill); cached != want {
				t.Errorf("pd_decisions_total{reason=cached_prefix} = %v, want %v", cached, want)
			}
		})
	}
}
