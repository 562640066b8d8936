package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// TestANewImageInALaterTurnGetsAPrefillLeg: under the cache rule, a later
// turn whose only new text is short goes decode-only, but one that brings
// a new image (a URL, or a data: URI) gets its prefill leg: the decode
// engine would encode the image and compute its tokens in its decode steps,
// which the image part's JSON does not tell. A later turn that only repeats
// the images seen goes decode-only, with kv_events too: such requests go by
// the estimates, as the engines' events never show an image's blocks held.
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
		for _, events := range [][]string{nil, {}} {
			t.Run(fmt.Sprintf("%s/kv_events=%v", tt.name, events != nil), func(t *testing.T) {
				r := startRig(t, rigOptions{decodes: 2, promptTokensDetails: true, decodePool: "policy: prefix-affinity",
					prefillPool: "policy: prefix-affinity", extra: "pd: {min_uncached_tokens: 100}", kvEvents: events})
				if events != nil {
					subscribed(t, append(r.prefill, r.decode...), 1)
				}
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
}

// TestARequestWithMediaAsksNoTokenIDs: with kv_events, a request with an
// image or audio part is not sent to an engine's render endpoint or
// /tokenize before it is routed. vLLM answers those only after fetching
// every media URL and running the model's processor (and the render
// endpoint's answer carries the processed media), while the ids' blocks
// from the first media part on never match the engines' events, and the
// request goes P/D whatever they say. It goes by the estimates; a request
// of text alone is still asked for its ids.
func TestARequestWithMediaAsksNoTokenIDs(t *testing.T) {
	type part map[string]any
	system := part{"role": "system", "content": strings.Repeat("You describe what you are shown as a careful assistant would. ", 12)}
	chat := func(content any) string {
		b, _ := json.Marshal(part{"model": "pdsim", "max_tokens": 2, "messages": []part{system, {"role": "user", "content": content}}})
		return string(b)
	}
	responses := func(content any) string {
		b, _ := json.Marshal(part{"model": "pdsim", "max_output_tokens": 2, "instructions": system["content"],
			"input": []part{{"role": "user", "content": content}}})
		return string(b)
	}
	tests := []struct {
		name, path, body string
		asked            [2]int // round trips for its ids: with the render endpoints, and without (/tokenize)
	}{
		{name: "an image URL", path: "/v1/chat/completions",
			body: chat([]part{{"type": "text", "text": "[image url] What is this?"}, {"type": "image_url", "image_url": part{"url": "https://images.example/a.png"}}})},
		{name: "an image data: URI", path: "/v1/chat/completions",
			body: chat([]part{{"type": "image_url", "image_url": part{"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="}}, {"type": "text", "text": "[data uri] And this?"}})},
		{name: "audio", path: "/v1/chat/completions",
			body: chat([]part{{"type": "text", "text": "[audio] Who speaks?"}, {"type": "input_audio", "input_audio": part{"data": "UklGRg==", "format": "wav"}}})},
		{name: "a Responses input_image", path: "/v1/responses",
			body: responses([]part{{"type": "input_text", "text": "[input image] What is this?"}, {"type": "input_image", "image_url": "https://images.example/a.png"}})},
		{name: "text alone", path: "/v1/chat/completions", body: chat("[text] What is this?"), asked: [2]int{1, 1}},
		{name: "Responses text alone", path: "/v1/responses", body: responses("[responses text] What is this?"), asked: [2]int{1, 0}},
	}
	for i, noRender := range []bool{false, true} {
		r := startRig(t, rigOptions{prefills: 1, decodes: 1, noRender: noRender, decodePool: "policy: prefix-affinity",
			prefillPool: "policy: prefix-affinity", kvEvents: []string{"stale_after: 1m"}})
		subscribed(t, append(r.prefill, r.decode...), 1)
		for _, tt := range tests {
			t.Run(fmt.Sprintf("%s/render=%v", tt.name, !noRender), func(t *testing.T) {
				before := askedOf(r)
				if resp, got := r.must(t, tt.path, tt.body, nil); resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d: %s", resp.StatusCode, got)
				}
				if n, want := askedOf(r)-before, tt.asked[i]; n != want {
					t.Errorf("the engines were asked for its token ids %d times, want %d", n, want)
				}
			})
		}
	}
}

// askedOf is how many requests the rig's engines got on the paths a
// request's token ids are asked on (askedTokens).
func askedOf(r *rig) int {
	n := 0
	for _, s := range append(append([]*pdsim.Server{}, r.prefill...), r.decode...) {
		for _, rec := range s.Requests() {
			if askedTokens(rec.Path) {
				n++
			}
		}
	}
	return n
}
