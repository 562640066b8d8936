package response

import (
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
)

// vLLM's Messages stream (AnthropicServingMessages.message_stream_converter):
// message_start for the chat stream's role event, then a content block.
const (
	msgStart   = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"chatcmpl-1\",\"content\":[],\"model\":\"m\"}}\n\n"
	blockStart = "event: content_block_start\ndata: {\"index\":0,\"type\":\"content_block_start\",\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n"
	textDelta  = "event: content_block_delta\ndata: {\"index\":0,\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n"
)

// vLLM's Responses stream (OpenAIServingResponses.responses_stream_generator).
const (
	respCreated    = "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0}\n\n"
	respInProgress = "event: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"sequence_number\":1}\n\n"
)

func anthropicError(typ string) string {
	return "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"" + typ + "\",\"message\":\"x\"}}\n\n"
}

func TestOpeningTellsServedFromFailed(t *testing.T) {
	const (
		vllmError   = enginetest.StreamError
		sglangError = "data: {\"error\": {\"object\": \"error\", \"message\": \"Decode transfer failed for request rank=0 req.rid='a'\", \"type\": \"INTERNAL_SERVER_ERROR\", \"param\": null, \"code\": 500}}\n\n"
		done        = "data: [DONE]\n\n"
	)
	tests := []struct {
		name   string
		stream string
		want   Verdict
		n      int // the request's choices; 0: 1
		// leading: the data events before the tokens (api.API.Leading): 1
		// on chat, 0 on completions, 2 on Messages.
		leading int
	}{
		{"a whole answer", role + tok0 + tok1 + usageEv + done, Served, 0, 1},
		{"vLLM: the role, then the error (a KV load that failed)", role + vllmError + done, Failed, 0, 1},
		{"SGLang: the error first", sglangError + done, Failed, 0, 1},
		{"no space after data:, CRLF lines", strings.ReplaceAll("data:{\"error\":{\"message\":\"x\",\"code\":503}}\n\n", "\n", "\r\n"), Failed, 0, 1},
		{"an event: line before the error's data", "event: error\ndata: {\"error\": {\"code\": 500}}\n\n", Failed, 0, 1},
		{"the role alone: nothing yet", role, Pending, 0, 1},
		{"two choices' roles, then the error (n: 2)", role + strings.Replace(role, `"index":0`, `"index":1`, 1) + vllmError, Failed, 2, 1},
		{"two choices' roles, then a token (n: 2)", role + strings.Replace(role, `"index":0`, `"index":1`, 1) + tok0, Served, 2, 1},
		{"a token after the role: served, and what follows is not read", role + tok0 + vllmError, Served, 0, 1},
		{"a completions stream's first two tokens", strings.ReplaceAll(tok0+tok1, "chat.completion.chunk", "text_completion"), Served, 0, 1},
		{"a data line longer than an error event is held", "data: {\"choices\":[{\"text\":\"" + strings.Repeat("x", 2*maxErrorEvent) + "\"}]}\n\n" + done, Served, 0, 1},
		{"a 4xx error event is the request's own", "data: {\"error\": {\"message\": \"bad\", \"type\": \"BadRequestError\", \"code\": 400}}\n\n" + done, Served, 0, 1},
		{"an error event without a code tells nothing", "data: {\"error\": {\"message\": \"x\"}}\n\n" + done, Pending, 0, 1},
		{"a token that says {\"error\" in its text", "data: {\"choices\":[{\"delta\":{\"content\":\"data: {\\\"error\\\": {\\\"code\\\": 500}}\"}}]}\n\n" + done, Served, 0, 1},
		{"an error line cut short", "data: {\"error\": {\"code\": 50", Pending, 0, 1},
		{"a comment line", ": {\"error\": {\"code\": 500}}\n\n" + done, Pending, 0, 1},
		{"an error event longer than is read tells nothing", "data: {\"error\": {\"message\": \"" + strings.Repeat("x", maxErrorEvent) + "\", \"code\": 500}}\n\n", Pending, 0, 1},
		{"completions: a token, then the error: served", strings.ReplaceAll(tok0, "chat.completion.chunk", "text_completion") + vllmError + done, Served, 0, 0},
		{"completions: the error first", vllmError + done, Failed, 0, 0},
		{"Messages: message_start, then vLLM's error (a KV load that failed)", msgStart + anthropicError("internal_error") + done, Failed, 0, 2},
		{"Messages: message_start, a block, then its first token", msgStart + blockStart + textDelta + done, Served, 0, 2},
		{"Messages: the request's own error", msgStart + anthropicError("invalid_request_error") + done, Served, 0, 2},
		{"Messages: overloaded", anthropicError("overloaded_error"), Failed, 0, 2},
		{"Messages: message_start alone: nothing yet", msgStart, Pending, 0, 2},
		// vLLM's Responses stream sends these two before the engine has
		// anything; what comes next tells.
		{"Responses: created and in_progress, then the error", respCreated + respInProgress + vllmError + done, Failed, 0, 2},
		{"Responses: created and in_progress alone: nothing yet", respCreated + respInProgress, Pending, 0, 2},
		{"Responses: the first output item", respCreated + respInProgress + "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\"}\n\n", Served, 0, 2},
		{"a text that starts {\"type\":\"error\" is not an event", "data: {\"type\":\"errors\"}\n\n" + tok0, Served, 0, 1},
		// The SSE spec's framing: CR alone ends a line too, and an event's
		// data is its data lines' values joined by LF, judged as one.
		{"CR line ends: the role, then the error", strings.ReplaceAll(role+vllmError+done, "\n", "\r"), Failed, 0, 1},
		{"CR line ends: the role, then a token", strings.ReplaceAll(role+tok0, "\n", "\r"), Served, 0, 1},
		{"an error event's data on two lines", role + "data: {\"error\":\ndata: {\"message\": \"x\", \"code\": 500}}\n\n" + done, Failed, 0, 1},
		{"the role's data on two lines is one event", "data: {\"choices\":\ndata: [{\"delta\":{\"role\":\"assistant\"}}]}\n\n" + vllmError, Failed, 0, 1},
	}
	for _, tt := range tests {
		scanInChunks(t, tt.name, func() *Opening { return NewOpening(tt.n, tt.leading) }, tt.stream, tt.want)
		if tt.n <= 1 && tt.leading == 1 && StreamFailed([]byte(tt.stream)) != (tt.want == Failed) {
			t.Errorf("%s: StreamFailed = %v", tt.name, !(tt.want == Failed))
		}
	}
}

// However an answer is cut into chunks, its opening's verdict is the same.
func FuzzOpeningIgnoresChunking(f *testing.F) {
	f.Add([]byte(role+tok0), uint8(6))
	f.Add([]byte("data: {\"error\": {\"code\": 500}}\r\n\r\ndata: [DONE]\n\n"), uint8(0))
	f.Add([]byte(": c\nevent: e\ndata:{\"error\":{\"code\":400}}\n"), uint8(2))
	f.Add([]byte(sglangChunk(`""`, `[]`, `{"type":"abort","status_code":500}`)+"data: [DONE]\n\n"), uint8(4))
	f.Add([]byte(sglangChunk(`"a"`, `[1]`, `null`)), uint8(8))
	f.Add([]byte("\ufeff"+errorEv+"\ufeff"+errorEv), uint8(0))
	openings := map[string]func() *Opening{
		"chat":     func() *Opening { return NewOpening(1, 1) },
		"generate": func() *Opening { return NewGenerateOpening(1) },
	}
	f.Fuzz(func(t *testing.T, stream []byte, cut uint8) {
		for name, open := range openings {
			whole, chunked := open(), open()
			want := whole.Scan(stream)
			size := int(cut) + 1
			var got Verdict
			for s := stream; len(s) > 0; {
				n := min(size, len(s))
				got = chunked.Scan(s[:n])
				s = s[n:]
			}
			if got != want && len(stream) > 0 {
				t.Errorf("%s, in chunks of %d: %v, whole: %v", name, size, got, want)
			}
		}
	})
}

// SGLang's /generate stream says a scheduler's abort in an ordinary chunk,
// meta_info.finish_reason {"type": "abort", "status_code": 500}, then
// [DONE] (_handle_abort_finish_reason in SGLang's
// managers/tokenizer_manager.py): a prefill leg so answered failed. An
// abort a client asked for has no status_code, and a 4xx is the request's own.
func TestStreamFailedSGLangGenerateAbort(t *testing.T) {
	for _, tt := range []struct {
		name, finish string
		want         bool
	}{
		{"a 500 abort", `{"type":"abort","message":"Prefill bootstrap failed for request 1","status_code":500,"err_type":null}`, true},
		{"a 503 abort", `{"type":"abort","message":"busy","status_code":503}`, true},
		{"a 400 abort", `{"type":"abort","message":"bad","status_code":400}`, false},
		{"an abort without status", `{"type":"abort","message":"Aborted","status_code":null}`, false},
		{"a length finish", `{"type":"length","length":1}`, false},
	} {
		stream := `data: {"text":"","output_ids":[],"meta_info":{"id":"1","finish_reason":` + tt.finish + `,"prompt_tokens":3}}` + "\n\ndata: [DONE]\n\n"
		for _, end := range []string{"\n", "\r\n", "\r"} { // the line ends of server-sent events
			if got := StreamFailed([]byte(strings.ReplaceAll(stream, "\n", end))); got != tt.want {
				t.Errorf("%s, lines ending %q: StreamFailed = %v, want %v", tt.name, end, got, tt.want)
			}
		}
	}
}

// sglangChunk is one chunk of SGLang's /generate stream as its HTTP server
// writes it (orjson, no spaces): text, then output_ids, then meta_info
// (TokenizerManager._handle_batch_output, managers/tokenizer_manager.py
// @001067ff).
func sglangChunk(text, ids, finish string) string {
	return `data: {"text":` + text + `,"output_ids":` + ids + `,"meta_info":{"id":"r1","finish_reason":` + finish +
		`,"prompt_tokens":5,"weight_version":"default","num_retractions":0,"reasoning_tokens":0,"completion_tokens":1,"cached_tokens":0}}` + "\n\n"
}

// A decode engine whose KV transfer failed aborts the request (prepare_abort,
// disaggregation/decode.py), and its /generate stream, already answered 200,
// says so in an ordinary chunk whose finish_reason is the abort, then
// [DONE] (_handle_abort_finish_reason, managers/tokenizer_manager.py). The
// opening of such a stream tells that chunk, before any token, from the
// first token.
func TestGenerateOpeningTellsAnAbortFromTheFirstToken(t *testing.T) {
	const done = "data: [DONE]\n\n"
	var (
		abort500  = sglangChunk(`""`, `[]`, `{"type":"abort","message":"Decode transfer failed for request rank=0 req.rid='r1' req.bootstrap_room=3 with exception KVTransferError","status_code":500,"err_type":null}`)
		abort503  = sglangChunk(`""`, `[]`, `{"type":"abort","message":"busy","status_code":503,"err_type":null}`)
		abort400  = sglangChunk(`""`, `[]`, `{"type":"abort","message":"The input is too long","status_code":400,"err_type":"BadRequestError"}`)
		aborted   = sglangChunk(`""`, `[]`, `{"type":"abort","message":"Aborted","status_code":null,"err_type":null}`) // a client's abort
		tok       = sglangChunk(`" Hello"`, `[22557]`, `null`)
		tokNoText = sglangChunk(`""`, `[22557]`, `null`) // a token whose text is not whole yet
		empty     = sglangChunk(`""`, `[]`, `null`)
		idsOnly   = strings.Replace(tok, `"text":" Hello",`, "", 1) // skip_tokenizer_init
		// A first chunk that carries the prompt's logprobs is longer than
		// an error event is held: it leads with its text.
		logprobs   = strings.Replace(tok, `"cached_tokens":0`, `"input_token_logprobs":[`+strings.Repeat(`[-1.5,42,null],`, maxErrorEvent/10)+`[-1.5,42,null]]`, 1)
		longAbort  = strings.Replace(abort500, `"cached_tokens":0`, `"input_token_logprobs":[`+strings.Repeat(`[null,1,null],`, maxErrorEvent/10)+`[null,1,null]]`, 1)
		errorEvent = "data: {\"error\": {\"message\": \"x\"}}\n\n" // http_server.py's ValueError: no code
	)
	tests := []struct {
		name   string
		stream string
		want   Verdict
	}{
		{"a 500 abort first", abort500 + done, Failed},
		{"a 503 abort first", abort503 + done, Failed},
		{"a 500 abort after a chunk without output", empty + abort500 + done, Failed},
		{"a token first, then an abort: the first token came", tok + abort500 + done, Served},
		{"a token with the abort in one chunk (coalesced)", sglangChunk(`" Hello"`, `[22557]`, `{"type":"abort","message":"x","status_code":500}`) + done, Served},
		{"a 400 abort is the request's own", abort400 + done, Served},
		{"a client's abort, no status_code, tells nothing", aborted, Pending},
		{"a whole answer", tok + sglangChunk(`" world"`, `[1917]`, `{"type":"length","length":2}`) + done, Served},
		{"token ids whose text is not whole yet", tokNoText, Served},
		{"token ids alone (skip_tokenizer_init)", idsOnly, Served},
		{"a chunk without output tells nothing", empty, Pending},
		{"a first chunk longer than an error event, text first", logprobs, Served},
		{"an abort longer than is read tells nothing", longAbort, Pending},
		{"an error event without a code tells nothing", errorEvent, Pending},
		{"an error event with a 5xx code", enginetest.StreamError + done, Failed},
		{"an abort cut short", abort500[:len(abort500)/2], Pending},
		{"CRLF line ends", strings.ReplaceAll(abort500+done, "\n", "\r\n"), Failed},
		{"CR line ends", strings.ReplaceAll(abort500+done, "\n", "\r"), Failed},
		{"the abort's data on two lines", strings.Replace(abort500, `"meta_info":`, "\ndata: \"meta_info\":", 1) + done, Failed},
		{"an event: line before the abort", "event: message\n" + abort500, Failed},
	}
	for _, tt := range tests {
		scanInChunks(t, tt.name, func() *Opening { return NewGenerateOpening(1) }, tt.stream, tt.want)
	}
}

// scanInChunks feeds stream to a new Opening whole, and cut across every
// boundary, and checks each way ends in want.
func scanInChunks(t *testing.T, name string, open func() *Opening, stream string, want Verdict) {
	t.Helper()
	for _, size := range []int{len(stream) + 1, 7, 1} {
		o := open()
		var got Verdict
		for s := stream; s != ""; {
			n := min(size, len(s))
			got = o.Scan([]byte(s[:n]))
			s = s[n:]
		}
		if got != want || o.Verdict() != want {
			t.Errorf("%s, in chunks of %d: %v, want %v", name, size, got, want)
		}
	}
}
