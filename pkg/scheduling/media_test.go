package scheduling

import (
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// TestMediaTheDecodeEndpointLacksGoesPD: an image, audio or video part the
// decode endpoint is not estimated to hold sends the request P/D. Its tokens
// (hundreds to thousands an image, by the engine's processor) are not in
// the request, and its JSON (a URL, a short data: URI) reads as a few: the
// cache rule sent such a request decode-only (cached_prefix), where the
// decode engine runs the encoder and computes those tokens in its decode
// steps, and pd.min_prompt_tokens called a question about an image short.
// A held image (the same part again) stays decode-only, as the engine's
// prefix cache holds it (vLLM keys image blocks by the media's hash).
func TestMediaTheDecodeEndpointLacksGoesPD(t *testing.T) {
	image := func(url string) string { return `{"type":"image_url","image_url":{"url":"` + url + `"}}` }
	parts := func(p ...string) string { return "[" + strings.Join(p, ",") + "]" }
	text := func(s string) string { return `{"type":"text","text":"` + s + `"}` }
	quoted := func(s string) string { return `"` + s + `"` }
	message := func(role, content string) string { return `{"role":"` + role + `","content":` + content + `}` }
	system := message("system", quoted(strings.Repeat("s", 2000)))
	turn1 := []string{system, message("user", parts(text("Describe this."), image("https://example.com/a.png")))}
	later := func(user string) []string {
		return append(append([]string(nil), turn1...), message("assistant", quoted(strings.Repeat("b", 400))), message("user", user))
	}
	pd, cached := Split{PD: true, Reason: metrics.ReasonLongPrompt}, Split{Reason: metrics.ReasonCachedPrefix}
	tests := []struct {
		name      string
		minPrompt int
		seen      bool // this replica routed turn1
		messages  []string
		want      Split
	}{
		{name: "a held image, a new question", seen: true, messages: later(quoted(strings.Repeat("c", 200))), want: cached},
		{name: "another image after the same text", seen: true,
			messages: []string{system, message("user", parts(text("Describe this."), image("https://example.com/b.png")))}, want: pd},
		{name: "a new image in a later turn", seen: true, messages: later(parts(text("And this?"), image("https://example.com/b.png"))), want: pd},
		{name: "a new data: URI", seen: true, messages: later(parts(image("data:image/png;base64,iVBORw0KGgo="))), want: pd},
		{name: "new audio", seen: true, messages: later(parts(`{"type":"input_audio","input_audio":{"data":"UklGRg==","format":"wav"}}`)), want: pd},
		{name: "a new video", seen: true, messages: later(parts(`{"type":"video_url","video_url":{"url":"https://example.com/v.mp4"}}`)), want: pd},
		{name: "image embeddings", seen: true, messages: later(parts(`{"type":"image_embeds","image_embeds":"QUJD"}`)), want: pd},
		{name: "a new text part stays cached", seen: true, messages: later(parts(text("And the colours?"))), want: cached},
		{name: "a short question about an image is not short", minPrompt: 512,
			messages: []string{message("user", parts(text("What is this?"), image("https://example.com/a.png")))}, want: pd},
		{name: "a short question alone is", minPrompt: 512, messages: []string{message("user", quoted("What is this?"))},
			want: Split{Reason: metrics.ReasonShortPrompt}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ps := NewPools(Spec{
				Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000"}},
				Decode: PoolSpec{Endpoints: []string{"10.0.0.1:8000", "10.0.0.2:8000"},
					PoolScheduling: config.PoolScheduling{Policy: config.PolicyPrefixAffinity}},
				PD: config.PD{MinPromptTokens: tt.minPrompt},
			}, Deps{})
			if tt.seen {
				if _, err := ps.Decode.Select(chatMessages(turn1)); err != nil {
					t.Fatal(err)
				}
			}
			req := chatMessages(tt.messages)
			e, err := ps.Decode.Select(req)
			if err != nil {
				t.Fatal(err)
			}
			if got := ps.Decide(req, e); got.PD != tt.want.PD || got.Reason != tt.want.Reason {
				t.Fatalf("Decide() = %+v (estimated held %d of %d characters), want %+v", got, req.Held(e), len(req.Prompt()), tt.want)
			}
		})
	}
}

// chatMessages is a chat request with these messages (JSON each).
func chatMessages(messages []string) *Request {
	obj, err := body.Parse([]byte(`{"model":"m","messages":[` + strings.Join(messages, ",") + `]}`))
	if err != nil {
		panic(err)
	}
	return NewRequest(api.Chat.Prompt(obj))
}

// TestMediaIsNotHeldByTheEnginesKVEvents: with the prompt's token ids from
// the engine and the decode endpoint's hit read from its KV events, a new
// image still sends the request P/D: the hit stops before the image (its
// blocks carry the media's hash, which a lookup never gives), and whether
// the ids count the image's tokens is the engine's affair.
func TestMediaIsNotHeldByTheEnginesKVEvents(t *testing.T) {
	history := []string{`{"role":"system","content":"` + strings.Repeat("s", 2000) + `"}`, `{"role":"user","content":"Hi"}`,
		`{"role":"assistant","content":"Hello"}`}
	tests := []struct {
		name string
		last string // the last user message's content
		want Split
	}{
		{name: "a new image", last: `[{"type":"image_url","image_url":{"url":"https://example.com/b.png"}}]`, want: Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{name: "new text", last: `"And then?"`, want: Split{Reason: metrics.ReasonCachedPrefix}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ps := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000"}},
				Decode: PoolSpec{Endpoints: []string{"10.0.0.1:8000"}, PoolScheduling: config.PoolScheduling{Policy: config.PolicyPrefixAffinity}}}, Deps{})
			e := ps.Decode.Endpoints()[0]
			req := chatMessages(append(history, `{"role":"user","content":`+tt.last+`}`))
			req.SetTokens(make([]int64, 600))
			req.held = estimate{addr: e.Addr, tokens: 590, exact: true} // as the KV events' lookup sets it
			if got := ps.Decide(req, e); got.PD != tt.want.PD || got.Reason != tt.want.Reason {
				t.Fatalf("Decide() = %+v, want %+v", got, tt.want)
			}
		})
	}
}
