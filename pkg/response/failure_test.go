package response

import (
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
)

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
		// tokensFirst: a completions or generate stream, whose first event
		// carries a token (no role event).
		tokensFirst bool
	}{
		{"a whole answer", role + tok0 + tok1 + usageEv + done, Served, 0, false},
		{"vLLM: the role, then the error (a KV load that failed)", role + vllmError + done, Failed, 0, false},
		{"SGLang: the error first", sglangError + done, Failed, 0, false},
		{"no space after data:, CRLF lines", strings.ReplaceAll("data:{\"error\":{\"message\":\"x\",\"code\":503}}\n\n", "\n", "\r\n"), Failed, 0, false},
		{"an event: line before the error's data", "event: error\ndata: {\"error\": {\"code\": 500}}\n\n", Failed, 0, false},
		{"the role alone: nothing yet", role, Pending, 0, false},
		{"two choices' roles, then the error (n: 2)", role + strings.Replace(role, `"index":0`, `"index":1`, 1) + vllmError, Failed, 2, false},
		{"two choices' roles, then a token (n: 2)", role + strings.Replace(role, `"index":0`, `"index":1`, 1) + tok0, Served, 2, false},
		{"a token after the role: served, and what follows is not read", role + tok0 + vllmError, Served, 0, false},
		{"a completions stream's first two tokens", strings.ReplaceAll(tok0+tok1, "chat.completion.chunk", "text_completion"), Served, 0, false},
		{"a data line longer than an error event is held", "data: {\"choices\":[{\"text\":\"" + strings.Repeat("x", 2*maxErrorEvent) + "\"}]}\n\n" + done, Served, 0, false},
		{"a 4xx error event is the request's own", "data: {\"error\": {\"message\": \"bad\", \"type\": \"BadRequestError\", \"code\": 400}}\n\n" + done, Served, 0, false},
		{"an error event without a code tells nothing", "data: {\"error\": {\"message\": \"x\"}}\n\n" + done, Pending, 0, false},
		{"a token that says {\"error\" in its text", "data: {\"choices\":[{\"delta\":{\"content\":\"data: {\\\"error\\\": {\\\"code\\\": 500}}\"}}]}\n\n" + done, Served, 0, false},
		{"an error line cut short", "data: {\"error\": {\"code\": 50", Pending, 0, false},
		{"a comment line", ": {\"error\": {\"code\": 500}}\n\n" + done, Pending, 0, false},
		{"an error event longer than is read tells nothing", "data: {\"error\": {\"message\": \"" + strings.Repeat("x", maxErrorEvent) + "\", \"code\": 500}}\n\n", Pending, 0, false},
		{"completions: a token, then the error: served", strings.ReplaceAll(tok0, "chat.completion.chunk", "text_completion") + vllmError + done, Served, 0, true},
		{"completions: the error first", vllmError + done, Failed, 0, true},
	}
	for _, tt := range tests {
		for _, size := range []int{len(tt.stream) + 1, 7, 1} { // whole, and cut across every boundary
			leading := 1
			if tt.tokensFirst {
				leading = 0
			}
			o := NewOpening(tt.n, leading)
			var got Verdict
			for s := tt.stream; s != ""; {
				n := min(size, len(s))
				got = o.Scan([]byte(s[:n]))
				s = s[n:]
			}
			if got != tt.want || o.Verdict() != tt.want {
				t.Errorf("%s, in chunks of %d: %v, want %v", tt.name, size, got, tt.want)
			}
		}
		if tt.n <= 1 && !tt.tokensFirst && StreamFailed([]byte(tt.stream)) != (tt.want == Failed) {
			t.Errorf("%s: StreamFailed = %v", tt.name, !(tt.want == Failed))
		}
	}
}

// However an answer is cut into chunks, its opening's verdict is the same.
func FuzzOpeningIgnoresChunking(f *testing.F) {
	f.Add([]byte(role+tok0), uint8(6))
	f.Add([]byte("data: {\"error\": {\"code\": 500}}\r\n\r\ndata: [DONE]\n\n"), uint8(0))
	f.Add([]byte(": c\nevent: e\ndata:{\"error\":{\"code\":400}}\n"), uint8(2))
	f.Fuzz(func(t *testing.T, stream []byte, cut uint8) {
		whole, chunked := NewOpening(1, 1), NewOpening(1, 1)
		want := whole.Scan(stream)
		size := int(cut) + 1
		var got Verdict
		for s := stream; len(s) > 0; {
			n := min(size, len(s))
			got = chunked.Scan(s[:n])
			s = s[n:]
		}
		if got != want && len(stream) > 0 {
			t.Errorf("in chunks of %d: %v, whole: %v", size, got, want)
		}
	})
}
