package response

import (
	"bytes"
	"cmp"
	"runtime"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// A vLLM decode engine's answers under P/D: cached_tokens counts the KV pulled
// from the prefill engine, so it equals prompt_tokens (12). The prefill
// engine's value is 8.
const (
	chatJSON = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"tok0 tok1"},"logprobs":null,"finish_reason":"length"}],` +
		`"usage":{"prompt_tokens":12,"total_tokens":14,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":12}},` +
		`"prompt_logprobs":null,"kv_transfer_params":null}`
	fixedJSON = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"tok0 tok1"},"logprobs":null,"finish_reason":"length"}],` +
		`"usage":{"prompt_tokens":12,"total_tokens":14,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}},` +
		`"prompt_logprobs":null,"kv_transfer_params":null}`
	role    = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"
	tok0    = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok0\"}}]}\n\n"
	tok1    = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok1\"},\"finish_reason\":\"length\"}]}\n\n"
	usageEv = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[]," +
		"\"usage\":{\"prompt_tokens\":12,\"total_tokens\":14,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":12}}}\n\n"
	fixedEv = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[]," +
		"\"usage\":{\"prompt_tokens\":12,\"total_tokens\":14,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n"
	done = "data: [DONE]\n\n"
	// vLLM's error event in a stream that fails after its 200, and older releases' one.
	errorEv      = "data: {\"error\":{\"message\":\"boom\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\n"
	olderErrorEv = "data: {\"object\":\"error\",\"message\":\"boom\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}\n\n"
)

// A decode engine's answers with nothing cached: vLLM leaves the details out.
var (
	coldJSON        = strings.Replace(chatJSON, `,"prompt_tokens_details":{"cached_tokens":12}`, "", 1)
	nullDetailsJSON = strings.Replace(chatJSON, `{"cached_tokens":12}`, "null", 1)
	nullUsageJSON   = chatJSON[:strings.Index(chatJSON, `"usage":`)] + `"usage":null,"prompt_logprobs":null,"kv_transfer_params":null}`
	coldEv          = strings.Replace(usageEv, `,"prompt_tokens_details":{"cached_tokens":12}`, "", 1)
)

var chatPath = Paths{JSON: api.Chat.Shape.CachedTokens}

type headers struct {
	status              int
	contentType, encode string
}

var (
	sseOK  = headers{200, "text/event-stream; charset=utf-8", ""}
	jsonOK = headers{200, "application/json", ""}
)

func TestRewriterChangesOnlyTheNumber(t *testing.T) {
	crlf := func(s string) string { return strings.ReplaceAll(s, "\n", "\r\n") }
	half := len(usageEv) / 2
	at := strings.Index(usageEv, "cached_tokens\":12") + len("cached_tokens\":1") // inside the number
	tests := []struct {
		name    string
		headers headers
		chunks  []string // the body as Envoy sends it; the last one ends it
		want    []string // what each chunk lets through, in order
		outcome string
		limit   int // 0: 1 MiB
	}{
		{name: "JSON in one chunk", headers: jsonOK, chunks: []string{chatJSON}, want: []string{fixedJSON}, outcome: metrics.UsageRewritten},
		{name: "JSON in chunks is held to its end", headers: jsonOK,
			chunks: []string{chatJSON[:10], chatJSON[10 : strings.Index(chatJSON, `":12}`)+3], chatJSON[strings.Index(chatJSON, `":12}`)+3:], ""},
			want:   []string{"", "", "", fixedJSON}, outcome: metrics.UsageRewritten},
		{name: "JSON with charset, upper case", headers: headers{200, "Application/JSON; charset=utf-8", ""}, chunks: []string{chatJSON},
			want: []string{fixedJSON}, outcome: metrics.UsageRewritten},
		{name: "JSON without prompt_tokens_details is passed on", headers: jsonOK,
			chunks: []string{`{"usage":{"prompt_tokens":12,"prompt_tokens_details":null}}`},
			want:   []string{`{"usage":{"prompt_tokens":12,"prompt_tokens_details":null}}`}, outcome: metrics.UsageAbsent},
		{name: "JSON over the limit goes on as it comes", headers: jsonOK, limit: 100,
			chunks: []string{chatJSON[:60], chatJSON[60:120], chatJSON[120:]},
			want:   []string{"", chatJSON[:120], chatJSON[120:]}, outcome: metrics.UsageTooLarge},
		{name: "invalid JSON is passed on", headers: jsonOK, chunks: []string{chatJSON[:len(chatJSON)-1]},
			want: []string{chatJSON[:len(chatJSON)-1]}, outcome: metrics.UsageAbsent},

		{name: "SSE: every event at once, the usage event fixed", headers: sseOK,
			chunks: []string{role, tok0, tok1, usageEv, done, ""},
			want:   []string{role, tok0, tok1, fixedEv, done, ""}, outcome: metrics.UsageRewritten},
		{name: "SSE: the usage event and [DONE] in one chunk", headers: sseOK,
			chunks: []string{tok0, usageEv + done},
			want:   []string{tok0, fixedEv + done}, outcome: metrics.UsageRewritten},
		{name: "SSE: an event cut across chunks is held until it is whole", headers: sseOK,
			chunks: []string{tok0 + usageEv[:half], usageEv[half:], done},
			want:   []string{tok0, fixedEv, done}, outcome: metrics.UsageRewritten},
		{name: "SSE: cut inside the number", headers: sseOK,
			chunks: []string{usageEv[:at], usageEv[at:] + done},
			want:   []string{"", fixedEv + done}, outcome: metrics.UsageRewritten},
		{name: "SSE: cut between the two line ends", headers: sseOK,
			chunks: []string{tok0[:len(tok0)-1], tok0[len(tok0)-1:] + usageEv[:5], usageEv[5:], done},
			want:   []string{"", tok0, fixedEv, done}, outcome: metrics.UsageRewritten},
		{name: "SSE with CRLF line ends", headers: sseOK,
			chunks: []string{crlf(tok0), crlf(usageEv)[:40], crlf(usageEv)[40:], crlf(done)},
			want:   []string{crlf(tok0), "", crlf(fixedEv), crlf(done)}, outcome: metrics.UsageRewritten},
		{name: "SSE: a last event without its blank line is none to a client: it goes at the end as it came", headers: sseOK,
			chunks: []string{tok0, strings.TrimSuffix(usageEv, "\n\n"), ""},
			want:   []string{tok0, "", strings.TrimSuffix(usageEv, "\n\n")}, outcome: metrics.UsageAbsent},
		{name: "SSE without usage is passed on", headers: sseOK,
			chunks: []string{role, tok0, tok1, done},
			want:   []string{role, tok0, tok1, done}, outcome: metrics.UsageAbsent},
		{name: "SSE: the name in text or in a comment line is left alone", headers: sseOK,
			chunks: []string{`data: {"choices":[{"delta":{"content":"\"cached_tokens\":3"}}]}` + "\n\n", `: "cached_tokens"` + "\n\n", done},
			want:   []string{`data: {"choices":[{"delta":{"content":"\"cached_tokens\":3"}}]}` + "\n\n", `: "cached_tokens"` + "\n\n", done}, outcome: metrics.UsageAbsent},
		{name: "SSE: an event over the limit gives the stream up", headers: sseOK, limit: 100,
			chunks: []string{tok0, usageEv[:90], usageEv[90:150], usageEv[150:], done},
			want:   []string{tok0, "", usageEv[:150], usageEv[150:], done}, outcome: metrics.UsageTooLarge},
		{name: "SSE: the events before one over the limit, in its chunk, are fixed", headers: sseOK, limit: 100,
			chunks: []string{tok0, usageEv + "data: " + strings.Repeat("x", 200), "\n\n" + done},
			want:   []string{tok0, fixedEv + "data: " + strings.Repeat("x", 200), "\n\n" + done}, outcome: metrics.UsageRewritten},

		{name: "an error status is passed on", headers: headers{500, "application/json", ""}, chunks: []string{chatJSON},
			want: []string{chatJSON}, outcome: metrics.UsageNotRewritable},
		{name: "a gzip body is passed on", headers: headers{200, "application/json", "gzip"}, chunks: []string{chatJSON[:50], chatJSON[50:]},
			want: []string{chatJSON[:50], chatJSON[50:]}, outcome: metrics.UsageNotRewritable},
		{name: "identity encoding is no encoding", headers: headers{200, "application/json", "identity"}, chunks: []string{chatJSON},
			want: []string{fixedJSON}, outcome: metrics.UsageRewritten},
		{name: "plain text is passed on", headers: headers{200, "text/plain", ""}, chunks: []string{usageEv},
			want: []string{usageEv}, outcome: metrics.UsageNotRewritable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := New(chatPath, []byte("8"), nil, cmp.Or(tt.limit, 1<<20))
			r.Start(tt.headers.status, tt.headers.contentType, tt.headers.encode)
			var all strings.Builder
			for i, c := range tt.chunks {
				got := string(r.Body([]byte(c), i == len(tt.chunks)-1).Bytes())
				if got != tt.want[i] {
					t.Errorf("chunk %d let through\n  %q\nwant\n  %q", i, got, tt.want[i])
				}
				all.WriteString(got)
			}
			if want := strings.Join(tt.want, ""); all.String() != want {
				t.Errorf("the client got\n  %q\nwant\n  %q", all.String(), want)
			}
			if r.Outcome() != tt.outcome {
				t.Errorf("outcome %q, want %q", r.Outcome(), tt.outcome)
			}
		})
	}
}

// Trailers end a body whose last chunk did not: the end then comes with no
// chunk of its own, and what is held goes with it.
func TestRewriterFlushesAtTrailers(t *testing.T) {
	r := New(chatPath, []byte("8"), nil, 1<<20)
	r.Start(sseOK.status, sseOK.contentType, "")
	if got := r.Body([]byte(tok0+usageEv[:20]), false).Bytes(); string(got) != tok0 {
		t.Fatalf("first chunk let through %q, want the complete event", got)
	}
	if got := r.Body(nil, true).Bytes(); string(got) != usageEv[:20] {
		t.Errorf("the end let through %q, want the held %q", got, usageEv[:20])
	}
}

func TestRewriterSkipped(t *testing.T) {
	r := New(chatPath, []byte("8"), nil, 1<<20)
	r.Skip(metrics.UsageNotFullDuplex)
	if got := r.Body([]byte(chatJSON), true).Bytes(); string(got) != chatJSON || r.Outcome() != metrics.UsageNotFullDuplex {
		t.Errorf("skipped rewriter let through %q, outcome %q", got, r.Outcome())
	}
}

// FuzzRewriterIgnoresChunking: however Envoy cuts a stream, the client gets
// the same bytes as from the stream in one piece, and the pieces of each
// reply never hold back a complete event.
func FuzzRewriterIgnoresChunking(f *testing.F) {
	f.Add([]byte(role+tok0+tok1+usageEv+done), []byte{7, 200, 3})
	f.Add([]byte(strings.ReplaceAll(tok0+usageEv+done, "\n", "\r\n")), []byte{1, 1, 1, 1, 90})
	f.Add([]byte("data: x\r\rdata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":1}}}\r\r"), []byte{9, 1})
	f.Add([]byte("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":0,\"cache_read_input_tokens\":41}}\n\n"), []byte{30, 40})
	f.Add([]byte("\ufeff"+usageEv+"\ufeff"+usageEv), []byte{1, 1, 1, 200})
	messages := Paths{JSON: api.Messages.Shape.CachedTokens, Uncached: api.Messages.Shape.UncachedTokens}
	f.Fuzz(func(t *testing.T, stream, cuts []byte) {
		for _, paths := range []Paths{chatPath, messages} {
			ignoresChunking(t, paths, stream, cuts)
		}
	})
}

// ignoresChunking checks that a rewriter of paths gives the client stream
// cut at cuts as it gives it whole.
func ignoresChunking(t *testing.T, paths Paths, stream, cuts []byte) {
	t.Helper()
	whole := New(paths, []byte("8"), []byte("9"), 1<<20)
	whole.Start(200, "text/event-stream", "")
	want := whole.Body(stream, true).Bytes()

	r := New(paths, []byte("8"), []byte("9"), 1<<20)
	r.Start(200, "text/event-stream", "")
	var got []byte
	rest := stream
	for _, c := range cuts {
		n := min(int(c), len(rest))
		out := r.Body(rest[:n], false).Bytes()
		got = append(got, out...)
		rest = rest[n:]
		// Without the name nothing changes, so what went on is the stream so
		// far but for a cut event: no more, and no less than the complete
		// events (blank lines between events may wait).
		sofar := stream[:len(stream)-len(rest)]
		heldBack := bytes.TrimLeft(sofar[min(len(got), len(sofar)):], "\r\n")
		if !bytes.Contains(stream, r.key) && (!bytes.HasPrefix(sofar, got) || eventsEnd(heldBack, 0) > 0) {
			t.Fatalf("of %q, %q went on; want every complete event and no more", sofar, got)
		}
	}
	got = append(got, r.Body(rest, true).Bytes()...)
	if !bytes.Equal(got, want) {
		t.Fatalf("cut at %v the client got\n  %q\nin one piece\n  %q", cuts, got, want)
	}
	if r.Outcome() != whole.Outcome() {
		t.Fatalf("outcome %q cut, %q whole", r.Outcome(), whole.Outcome())
	}
}

// TestReaderSeesTheNumberAndChangesNothing: a reader passes every byte on
// as it came (a JSON answer held to its end) and sees the number wherever a
// rewriter would write it.
func TestReaderSeesTheNumberAndChangesNothing(t *testing.T) {
	half := len(usageEv) / 2
	tests := []struct {
		name    string
		headers headers
		chunks  []string
		want    []string // what each chunk lets through
		seen    []string
		limit   int // 0: 1 MiB
	}{
		{name: "JSON", headers: jsonOK, chunks: []string{chatJSON[:40], chatJSON[40:]}, want: []string{"", chatJSON}, seen: []string{"12"}},
		{name: "events", headers: sseOK, chunks: []string{role + tok0, tok1 + usageEv[:half], usageEv[half:] + done},
			want: []string{role + tok0, tok1, usageEv + done}, seen: []string{"12"}},
		{name: "no usage", headers: sseOK, chunks: []string{role + tok0 + tok1 + done}, want: []string{role + tok0 + tok1 + done}},
		{name: "a cold JSON answer, without the details, reads as 0", headers: jsonOK, chunks: []string{coldJSON}, want: []string{coldJSON}, seen: []string{"0 (absent)"}},
		{name: "null details read as 0", headers: jsonOK, chunks: []string{nullDetailsJSON}, want: []string{nullDetailsJSON}, seen: []string{"0 (absent)"}},
		{name: "a null usage says nothing", headers: jsonOK, chunks: []string{nullUsageJSON}, want: []string{nullUsageJSON}},
		{name: "a cold stream reads as 0", headers: sseOK, chunks: []string{role + tok0, tok1 + coldEv + done}, want: []string{role + tok0, tok1 + coldEv + done}, seen: []string{"0 (absent)"}},
		{name: "a stream's usage in every event: the last one, once", headers: sseOK, chunks: []string{role + coldEv, usageEv + done},
			want: []string{role + coldEv, usageEv + done}, seen: []string{"12"}},
		{name: "a stream that fails after continuous usage says nothing", headers: sseOK,
			chunks: []string{role + coldEv, tok0 + errorEv + done}, want: []string{role + coldEv, tok0 + errorEv + done}},
		{name: "a stream that fails the older way says nothing", headers: sseOK,
			chunks: []string{role + coldEv + olderErrorEv + done}, want: []string{role + coldEv + olderErrorEv + done}},
		{name: "an error status is not read", headers: headers{500, "application/json", ""}, chunks: []string{chatJSON}, want: []string{chatJSON}},
		{name: "past the limit it passes unread", headers: jsonOK, limit: 40, chunks: []string{chatJSON[:30], chatJSON[30:]},
			want: []string{"", chatJSON}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var seen []string
			r := NewReader(chatPath, cmp.Or(tt.limit, 1<<20), func(raw []byte, stated bool) {
				if !stated {
					raw = append(raw, " (absent)"...)
				}
				seen = append(seen, string(raw))
			})
			r.Start(tt.headers.status, tt.headers.contentType, tt.headers.encode)
			for i, c := range tt.chunks {
				if got := string(bytes.Join(r.Body([]byte(c), i == len(tt.chunks)-1), nil)); got != tt.want[i] {
					t.Errorf("chunk %d lets through %q, want %q", i, got, tt.want[i])
				}
			}
			if strings.Join(seen, ",") != strings.Join(tt.seen, ",") || r.Outcome() != "" || r.Writes() {
				t.Errorf("seen %q, outcome %q, writes %v; want %q, no outcome, a reader", seen, r.Outcome(), r.Writes(), tt.seen)
			}
		})
	}
}

// TestRewriterFindsTheResponsesAPIsNumber: the Responses API answers with
// usage.input_tokens_details.cached_tokens, and streams it inside
// "response" of its response.completed event; both get the prefill
// engine's number, and the events without it pass as they came.
func TestRewriterFindsTheResponsesAPIsNumber(t *testing.T) {
	paths := Paths{JSON: api.Responses.Shape.CachedTokens, Event: api.Responses.Shape.CachedTokensInEvents}
	const (
		usage   = `"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":12},"output_tokens":2}`
		fixed   = `"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":8},"output_tokens":2}`
		created = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null}}\n\n"
		delta   = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"cached_tokens\"}\n\n"
	)
	completed := func(u string) string {
		return "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\"," + u + "}}\n\n"
	}
	tests := []struct {
		name    string
		headers headers
		in      string
		want    string
	}{
		{name: "JSON", headers: jsonOK, in: `{"id":"r","object":"response",` + usage + `}`, want: `{"id":"r","object":"response",` + fixed + `}`},
		{name: "events", headers: sseOK, in: created + delta + completed(usage), want: created + delta + completed(fixed)},
		{name: "a top-level usage in an event is not the Responses API's", headers: sseOK, in: "data: {" + usage + "}\n\n", want: "data: {" + usage + "}\n\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := New(paths, []byte("8"), nil, 1<<20)
			r.Start(tt.headers.status, tt.headers.contentType, tt.headers.encode)
			if got := string(r.Body([]byte(tt.in), true).Bytes()); got != tt.want {
				t.Errorf("got\n%s\nwant\n%s", got, tt.want)
			}
		})
	}
}

// TestRewriterWritesTheMessagesAPIsTwoNumbers: Anthropic's usage leaves the
// cached tokens out of input_tokens (vllm-project/vllm#40912), so both
// numbers get the prefill engine's, in a whole answer and in a stream's
// message_delta, in whichever order they come; where one of them is missing
// neither is written. The message_start event passes as it came: vLLM's
// states the whole prompt as input_tokens and no cached tokens
// (message_stream_converter, vllm/entrypoints/anthropic/serving.py
// @0001948b, pydantic's JSON without unset fields), and the usage inside its
// message is not read even where it states them. A reader reads
// cache_read_input_tokens, and an answer without it as telling nothing:
// vLLM before vllm-project/vllm#40912 never wrote it.
func TestRewriterWritesTheMessagesAPIsTwoNumbers(t *testing.T) {
	paths := Paths{JSON: api.Messages.Shape.CachedTokens, Uncached: api.Messages.Shape.UncachedTokens}
	const (
		pulled = `"usage":{"input_tokens":0,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":41}`
		fixed  = `"usage":{"input_tokens":9,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":32}`
		cold   = `"usage":{"input_tokens":41,"output_tokens":2}`
		start  = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"chatcmpl-1\",\"content\":[],\"model\":\"m\"," +
			"\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":41,\"output_tokens\":0}}}\n\n"
	)
	// Anthropic's own message_start states the cached tokens in its message.
	startCached := strings.Replace(start, `"output_tokens":0`, `"output_tokens":0,"cache_creation_input_tokens":0,"cache_read_input_tokens":41`, 1)
	whole := func(u string) string { return `{"id":"m","type":"message","role":"assistant",` + u + `}` }
	delta := func(u string) string {
		return "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"}," + u + "}\n\n"
	}
	tests := []struct {
		name     string
		headers  headers
		in, want string
		seen     string
	}{
		{name: "JSON", headers: jsonOK, in: whole(pulled), want: whole(fixed), seen: "41"},
		{name: "JSON, the cached count first", headers: jsonOK,
			in:   whole(`"usage":{"cache_read_input_tokens":41,"input_tokens":0}`),
			want: whole(`"usage":{"cache_read_input_tokens":32,"input_tokens":9}`), seen: "41"},
		{name: "JSON without the cached count", headers: jsonOK, in: whole(cold), want: whole(cold)},
		{name: "JSON without input_tokens", headers: jsonOK, in: whole(`"usage":{"cache_read_input_tokens":41}`),
			want: whole(`"usage":{"cache_read_input_tokens":41}`), seen: "41"},
		{name: "events", headers: sseOK, in: start + delta(pulled), want: start + delta(fixed), seen: "41"},
		{name: "events without the cached count", headers: sseOK, in: start + delta(cold), want: start + delta(cold)},
		{name: "message_start alone", headers: sseOK, in: start, want: start},
		{name: "a message_start stating cached tokens", headers: sseOK, in: startCached + delta(pulled), want: startCached + delta(fixed), seen: "41"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := New(paths, []byte("32"), []byte("9"), 1<<20)
			r.Start(tt.headers.status, tt.headers.contentType, tt.headers.encode)
			if got := string(r.Body([]byte(tt.in), true).Bytes()); got != tt.want {
				t.Errorf("got\n%s\nwant\n%s", got, tt.want)
			}
			var seen string
			reader := NewReader(paths, 1<<20, func(raw []byte, stated bool) {
				seen = string(raw) + map[bool]string{false: " (absent)"}[stated]
			})
			reader.Start(tt.headers.status, tt.headers.contentType, tt.headers.encode)
			if got := string(reader.Body([]byte(tt.in), true).Bytes()); got != tt.in || seen != tt.seen {
				t.Errorf("a reader let through\n%s\nand saw %q; want the answer unchanged and %q", got, seen, tt.seen)
			}
		})
	}
}

// TestAnEventCutIntoManyChunksCostsItsSize: an event that comes in many
// chunks is held in one buffer that grows, not copied again at each chunk:
// a 1 MiB event in 4 KiB chunks allocated some 256 MiB.
func TestAnEventCutIntoManyChunksCostsItsSize(t *testing.T) {
	const chunk = 4 << 10
	ev := "data: {\"choices\":[{\"text\":\"" + strings.Repeat("x", 1<<20) + "\"}]}\n\n"
	r := New(chatPath, []byte("8"), nil, 2<<20)
	r.Start(200, "text/event-stream", "")
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	out := 0
	for s := ev; s != ""; {
		n := min(chunk, len(s))
		out += r.Body([]byte(s[:n]), false).Len()
		s = s[n:]
	}
	out += r.Body(nil, true).Len()
	runtime.ReadMemStats(&after)
	if out != len(ev) {
		t.Fatalf("passed on %d bytes, want %d", out, len(ev))
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 8*uint64(len(ev)) {
		t.Errorf("a %d KiB event in %d-byte chunks allocated %d KiB, more than 8 times its size", len(ev)>>10, chunk, alloc>>10)
	}
}
