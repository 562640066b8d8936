package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
)

// TestUsageRewrite: with response.rewrite_usage on, a client of a P/D request
// sees the prefill engine's cached_tokens, not the decode engine's (which
// counts the KV it pulled: the whole prompt), streamed or not, whatever the
// request body mode, as long as Envoy sends response bodies in FULL_DUPLEX.
// The simulators report like vLLM: the first request's prefill finds nothing
// cached, the second, of the same prompt, its full blocks.
func TestUsageRewrite(t *testing.T) {
	prompt := strings.TrimSpace(strings.Repeat("word ", 40))
	// The 40 words, the two of the case's marker and the role, as the simulator
	// counts tokens; the prefill engine's full blocks of them are 32. The
	// marker comes first: the simulator caches block prefixes, as vLLM does,
	// so each case's prompt must differ from its first block on.
	const promptTokens = 43
	tests := []struct {
		mode, connector string
		envoy           func(*envoyemu.Config)
		want            [2]int // the cached_tokens the client sees for the first and the second request
		outcome         string
	}{
		{"full_duplex", "kv-nixl", nil, [2]int{0, 32}, "rewritten"},
		{"full_duplex", "kv-shared-storage", nil, [2]int{0, 32}, "rewritten"},
		{"buffered", "kv-nixl", fullDuplexResponses, [2]int{0, 32}, "rewritten"},
		// The shipped BUFFERED config sends no response body: the decode
		// engine's number reaches the client, and the case is counted.
		{"buffered", "kv-nixl", nil, [2]int{promptTokens, promptTokens}, "not_full_duplex"},
	}
	for _, tt := range tests {
		name := fmt.Sprintf("%s/%s/full-duplex-responses=%v", tt.mode, tt.connector, tt.mode == "full_duplex" || tt.envoy != nil)
		t.Run(name, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: tt.mode, connector: tt.connector, prefills: 1, decodes: 1, promptTokensDetails: true,
				extra: "response: {rewrite_usage: true}", envoy: tt.envoy})
			sent := 0
			for _, stream := range []bool{false, true} {
				marker := fmt.Sprintf("%s stream=%v", name, stream)
				for i, want := range tt.want {
					body := fmt.Sprintf(`{"model":"pdsim","messages":[{"role":"user","content":%q}],"stream":%v,"max_tokens":4%s}`,
						marker+" "+prompt, stream, map[bool]string{true: `,"stream_options":{"include_usage":true}`}[stream])
					resp, got := r.must(t, "/v1/chat/completions", body, nil)
					sent++
					if resp.StatusCode != http.StatusOK || resp.Header.Get("x-pdsim-kv") != "hit" {
						t.Fatalf("request %d: status %d, KV %q: %.300s", i, resp.StatusCode, resp.Header.Get("x-pdsim-kv"), got)
					}
					checkCompletion(t, stream, got)
					u := usageOf(t, stream, got)
					if u.CachedTokens != want || u.PromptTokens != promptTokens {
						t.Errorf("request %d, stream %v: usage %+v; want cached_tokens %d and the decode engine's prompt_tokens %d",
							i, stream, u, want, promptTokens)
					}
				}
			}
			series := fmt.Sprintf(`pd_extproc_usage_rewrites_total{outcome="%s"}`, tt.outcome)
			waitFor(t, 10*time.Second, series, func() bool { return r.metric(t, series) == float64(sent) })
		})
	}
}

// fullDuplexResponses makes Envoy send response bodies in FULL_DUPLEX, as a
// BUFFERED deployment that rewrites usage must.
func fullDuplexResponses(c *envoyemu.Config) {
	c.Modes.Response.Body = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	c.Modes.Response.Trailers = filterv3.ProcessingMode_SEND
}

type usage struct {
	PromptTokens int `json:"prompt_tokens"`
	CachedTokens int
}

// usageOf reads the usage of a completion, or of a stream's usage event.
func usageOf(t *testing.T, stream bool, body string) usage {
	t.Helper()
	var data []string
	if !stream {
		data = []string{body}
	}
	for line := range strings.SplitSeq(body, "\n") {
		if d, ok := strings.CutPrefix(line, "data: "); ok && stream && strings.Contains(d, `"usage"`) {
			data = append(data, d)
		}
	}
	if len(data) != 1 {
		t.Fatalf("%d answers with usage in %.500s", len(data), body)
	}
	var c struct {
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(data[0]), &c); err != nil {
		t.Fatalf("usage of %.300s: %v", data[0], err)
	}
	return usage{PromptTokens: c.Usage.PromptTokens, CachedTokens: c.Usage.PromptTokensDetails.CachedTokens}
}

// TestUsageRewriteOnGenerateAndResponses: vLLM's token-in generate (JSON,
// and the last event of a stream), the Responses API (JSON, and the
// response.completed event of a stream) and Anthropic's Messages API (JSON,
// and the message_delta event of a stream: cache_read_input_tokens, and
// input_tokens with it) get the prefill engine's cached tokens too: 0 for a cold prompt
// (whose prefill answer has no details), then its full blocks, where the
// decode engine says the whole prompt, whatever the request body mode; under
// the shipped BUFFERED config, which sends Envoy no response body, the
// decode engine's figure reaches the client.
func TestUsageRewriteOnGenerateAndResponses(t *testing.T) {
	rigs := []struct {
		mode      string
		envoy     func(*envoyemu.Config)
		rewritten bool
	}{
		{"full_duplex", nil, true},
		{"buffered", fullDuplexResponses, true},
		{"buffered", nil, false},
	}
	ids := make([]string, 40)
	for i := range ids {
		ids[i] = fmt.Sprint(100 + i)
	}
	words := strings.TrimSpace(strings.Repeat("word ", 40))
	tests := []struct {
		name, path string
		body       func(marker string) string
		read       func(t *testing.T, body string) (prompt, cached int)
	}{
		{name: "generate", path: "/inference/v1/generate",
			body: func(m string) string {
				return `{"model":"pdsim","token_ids":[` + m + `,` + strings.Join(ids, ",") + `],"sampling_params":{"max_tokens":4}}`
			},
			read: func(t *testing.T, b string) (int, int) {
				u := usageOf(t, false, b)
				return u.PromptTokens, u.CachedTokens
			}},
		{name: "generate, streamed", path: "/inference/v1/generate", // newer vLLM streams it, its usage last
			body: func(m string) string {
				return `{"model":"pdsim","token_ids":[` + m + `,` + strings.Join(ids, ",") + `],"sampling_params":{"max_tokens":4},` +
					`"stream":true,"stream_options":{"include_usage":true}}`
			},
			read: func(t *testing.T, b string) (int, int) {
				u := usageOf(t, true, b)
				return u.PromptTokens, u.CachedTokens
			}},
		// With continuous_usage_stats every chunk has a usage, without the
		// cached tokens (vLLM's chat_completion/serving.py @ 006c49d4,
		// completion/serving.py @ 030ea52e, serve/disagg/serving.py @
		// 0001948b): they pass as they came, and the last one gets the number.
		{name: "chat, streamed with continuous usage", path: "/v1/chat/completions",
			body: func(m string) string {
				return fmt.Sprintf(`{"model":"pdsim","messages":[{"role":"user","content":"%s %s"}],"max_tokens":4,"stream":true,`+
					`"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`, m, words)
			},
			read: func(t *testing.T, b string) (int, int) { return continuousUsage(t, b, 5) }},
		{name: "completions, streamed with continuous usage", path: "/v1/completions",
			body: func(m string) string {
				return fmt.Sprintf(`{"model":"pdsim","prompt":"%s %s","max_tokens":4,"stream":true,`+
					`"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`, m, words)
			},
			read: func(t *testing.T, b string) (int, int) { return continuousUsage(t, b, 4) }},
		{name: "generate, streamed with continuous usage", path: "/inference/v1/generate",
			body: func(m string) string {
				return `{"model":"pdsim","token_ids":[` + m + `,` + strings.Join(ids, ",") + `],"sampling_params":{"max_tokens":4},` +
					`"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`
			},
			read: func(t *testing.T, b string) (int, int) { return continuousUsage(t, b, 4) }},
		{name: "messages", path: "/v1/messages",
			body: func(m string) string {
				return fmt.Sprintf(`{"model":"pdsim","messages":[{"role":"user","content":"%s %s"}],"max_tokens":4}`, m, words)
			},
			read: func(t *testing.T, b string) (int, int) { return messagesUsage(t, b) }},
		{name: "messages, streamed", path: "/v1/messages",
			body: func(m string) string {
				return fmt.Sprintf(`{"model":"pdsim","messages":[{"role":"user","content":"%s %s"}],"max_tokens":4,"stream":true}`, m, words)
			},
			read: func(t *testing.T, b string) (int, int) {
				for line := range strings.SplitSeq(b, "\n") {
					if d, ok := strings.CutPrefix(line, "data: "); ok && strings.Contains(d, `"message_delta"`) {
						return messagesUsage(t, d)
					}
				}
				t.Fatalf("no message_delta event in %.500s", b)
				return 0, 0
			}},
		{name: "responses", path: "/v1/responses",
			body: func(m string) string {
				return fmt.Sprintf(`{"model":"pdsim","input":"%s %s","max_output_tokens":4}`, m, words)
			},
			read: func(t *testing.T, b string) (int, int) { return responsesUsage(t, b) }},
		{name: "responses, streamed", path: "/v1/responses",
			body: func(m string) string {
				return fmt.Sprintf(`{"model":"pdsim","input":"%s %s","max_output_tokens":4,"stream":true}`, m, words)
			},
			read: func(t *testing.T, b string) (int, int) {
				for line := range strings.SplitSeq(b, "\n") {
					if d, ok := strings.CutPrefix(line, "data: "); ok && strings.Contains(d, `"response.completed"`) {
						var e struct {
							Response json.RawMessage `json:"response"`
						}
						if err := json.Unmarshal([]byte(d), &e); err != nil {
							t.Fatal(err)
						}
						return responsesUsage(t, string(e.Response))
					}
				}
				t.Fatalf("no response.completed event in %.500s", b)
				return 0, 0
			}},
	}
	for _, rg := range rigs {
		t.Run(fmt.Sprintf("%s/rewritten=%v", rg.mode, rg.rewritten), func(t *testing.T) {
			r := startRig(t, rigOptions{mode: rg.mode, envoy: rg.envoy, prefills: 1, decodes: 1, promptTokensDetails: true,
				extra: "response: {rewrite_usage: true}"})
			for i, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					for turn := range 2 {
						resp, got := r.must(t, tt.path, tt.body(fmt.Sprint(7000+i)), nil)
						if resp.StatusCode != http.StatusOK || resp.Header.Get("x-pdsim-kv") != "hit" {
							t.Fatalf("status %d, KV %q: %.300s", resp.StatusCode, resp.Header.Get("x-pdsim-kv"), got)
						}
						prompt, cached := tt.read(t, got)
						want := prompt // the decode engine's figure: the KV it pulled
						switch {
						case rg.rewritten && turn == 0:
							want = 0
						case rg.rewritten:
							want = (prompt - 1) / 16 * 16 // the prefill engine's full blocks
						}
						if cached != want || prompt < 40 {
							t.Errorf("request %d: cached_tokens %d of %d, want %d (the decode engine says %d)", turn, cached, prompt, want, prompt)
						}
					}
				})
			}
		})
	}
}

// continuousUsage reads a stream whose chunks, running ones of which there
// are as many as running, each carry a usage without the cached tokens, the
// last one the final usage; it returns the last one's prompt and cached tokens.
func continuousUsage(t *testing.T, body string, running int) (prompt, cached int) {
	t.Helper()
	var usages []string
	for line := range strings.SplitSeq(body, "\n") {
		if d, ok := strings.CutPrefix(line, "data: "); ok && strings.Contains(d, `"usage":{`) {
			usages = append(usages, d)
		}
	}
	if len(usages) != running+1 {
		t.Fatalf("%d chunks with a usage, want %d running ones and the final one: %.800s", len(usages), running, body)
	}
	for _, d := range usages[:running] {
		if strings.Contains(d, "cached_tokens") {
			t.Errorf("a running usage states cached tokens: %s", d)
		}
	}
	u := usageOf(t, false, usages[running])
	return u.PromptTokens, u.CachedTokens
}

// messagesUsage reads the prompt's tokens and the cached ones from an
// Anthropic Messages answer, or its message_delta event, whose input_tokens
// leave out the cache_read_input_tokens.
func messagesUsage(t *testing.T, body string) (prompt, cached int) {
	t.Helper()
	var a struct {
		Usage struct {
			InputTokens int `json:"input_tokens"`
			CacheRead   int `json:"cache_read_input_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(body), &a); err != nil {
		t.Fatalf("usage of %.300s: %v", body, err)
	}
	return a.Usage.InputTokens + a.Usage.CacheRead, a.Usage.CacheRead
}

// responsesUsage reads a Responses API answer's input tokens and cached ones.
// The per-turn counts beside them (vllm/entrypoints/openai/responses/serving.py
// @ 4d89a999, one turn without built-in tools) stay the decode engine's:
// the whole prompt, cached.
func responsesUsage(t *testing.T, body string) (prompt, cached int) {
	t.Helper()
	var a struct {
		Usage struct {
			InputTokens        int `json:"input_tokens"`
			InputTokensDetails struct {
				CachedTokens        int   `json:"cached_tokens"`
				InputTokensPerTurn  []int `json:"input_tokens_per_turn"`
				CachedTokensPerTurn []int `json:"cached_tokens_per_turn"`
			} `json:"input_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(body), &a); err != nil {
		t.Fatalf("usage of %.300s: %v", body, err)
	}
	u := a.Usage
	if whole := []int{u.InputTokens}; !slices.Equal(u.InputTokensDetails.InputTokensPerTurn, whole) ||
		!slices.Equal(u.InputTokensDetails.CachedTokensPerTurn, whole) {
		t.Errorf("input_tokens_details %+v: want the per-turn counts the decode engine's, %v", u.InputTokensDetails, whole)
	}
	return u.InputTokens, u.InputTokensDetails.CachedTokens
}
