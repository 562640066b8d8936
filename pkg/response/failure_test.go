package response

import (
	"strings"
	"testing"
)

func TestFailureFindsTheErrorEventAfterA200(t *testing.T) {
	const (
		vllmError   = "data: {\"error\": {\"message\": \"Internal server error\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n"
		sglangError = "data: {\"error\": {\"object\": \"error\", \"message\": \"Decode transfer failed for request rank=0 req.rid='a'\", \"type\": \"INTERNAL_SERVER_ERROR\", \"param\": null, \"code\": 500}}\n\n"
		done        = "data: [DONE]\n\n"
	)
	tests := []struct {
		name   string
		stream string
		want   bool
	}{
		{"a whole answer", role + tok0 + tok1 + usageEv + done, false},
		{"vLLM: the role chunk, then the error (a KV load that failed)", role + vllmError + done, true},
		{"SGLang: the error first", sglangError + done, true},
		{"no space after data:, CRLF lines", strings.ReplaceAll("data:{\"error\":{\"message\":\"x\",\"code\":503}}\n\n", "\n", "\r\n"), true},
		{"a 4xx error event is the request's fault", "data: {\"error\": {\"message\": \"bad\", \"type\": \"BadRequestError\", \"code\": 400}}\n\n" + done, false},
		{"an error event without a code", "data: {\"error\": {\"message\": \"x\"}}\n\n" + done, false},
		{"a token that says {\"error\" inside its text", "data: {\"choices\":[{\"delta\":{\"content\":\"data: {\\\"error\\\": {\\\"code\\\": 500}}\"}}]}\n\n" + done, false},
		{"an error line cut short", "data: {\"error\": {\"code\": 50", false},
		{"a comment line", ": {\"error\": {\"code\": 500}}\n\n" + done, false},
		{"an error event longer than is read", "data: {\"error\": {\"message\": \"" + strings.Repeat("x", maxErrorEvent) + "\", \"code\": 500}}\n\n", false},
	}
	for _, tt := range tests {
		for _, size := range []int{len(tt.stream) + 1, 7, 1} { // whole, and cut across every boundary
			var f Failure
			for s := tt.stream; s != ""; {
				n := min(size, len(s))
				f.Scan([]byte(s[:n]))
				s = s[n:]
			}
			if f.Failed() != tt.want {
				t.Errorf("%s, in chunks of %d: Failed() = %v, want %v", tt.name, size, f.Failed(), tt.want)
			}
		}
	}
}
