package response

import (
	"bytes"
	"strconv"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// maxErrorEvent is as much of an error event as Failure holds to read its
// code; vLLM's and SGLang's are a few hundred bytes.
const maxErrorEvent = 4 << 10

// Failure watches a streamed answer for the error event an engine sends
// when a request fails after its 200 went out. vLLM ends a chat or
// completions stream that way when the request finishes with an error (a
// KV load that failed, under kv_load_failure_policy "fail"):
//
//	data: {"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}
//
// then data: [DONE] (vllm/entrypoints/generate/base/serving.py,
// _raise_if_error; chat_completion/serving.py). SGLang does the same with
// its own message, "Decode transfer failed for request ..." on a decode
// server (disaggregation/decode.py, entrypoints/openai/serving_chat.py).
// Such an answer failed as a 500 would, though its status said 200.
//
// A data line is JSON on one line, so a line that starts {"error" is such an
// event and nothing else: inside a JSON string the quotes are escaped. The
// zero Failure is ready; give it every chunk in order.
type Failure struct {
	line   []byte // the start of the current line, while it may be an error event
	inLine bool   // past the start of a line that is not one
	failed bool
}

// errorData is how an error event's line starts, after "data:" and any spaces.
var errorData = []byte(`{"error"`)

// Scan reads the next chunk of the answer.
func (f *Failure) Scan(chunk []byte) {
	for len(chunk) > 0 && !f.failed {
		end := bytes.IndexByte(chunk, '\n')
		part := chunk
		if end >= 0 {
			part, chunk = chunk[:end], chunk[end+1:]
		} else {
			chunk = nil
		}
		if !f.inLine && len(f.line)+len(part) <= maxErrorEvent {
			f.line = append(f.line, part...)
			f.inLine = !f.maybe()
		} else {
			f.line, f.inLine = f.line[:0], true
		}
		if end >= 0 {
			if !f.inLine {
				f.failed = f.serverError()
			}
			f.line, f.inLine = f.line[:0], false
		}
	}
}

// maybe reports whether the line so far may still be an error event.
func (f *Failure) maybe() bool {
	l := bytes.TrimSuffix(f.line, []byte("\r"))
	const data = "data:"
	if len(l) < len(data) {
		return bytes.HasPrefix([]byte(data), l)
	}
	if !bytes.HasPrefix(l, []byte(data)) {
		return false
	}
	l = bytes.TrimLeft(l[len(data):], " ")
	n := min(len(l), len(errorData))
	return bytes.Equal(l[:n], errorData[:n])
}

// serverError reports whether the whole line read is an error event with a
// 5xx code: the engine's failure, not the request's.
func (f *Failure) serverError() bool {
	l, ok := bytes.CutPrefix(bytes.TrimSuffix(f.line, []byte("\r")), []byte("data:"))
	if l = bytes.TrimLeft(l, " "); !ok || !bytes.HasPrefix(l, errorData) {
		return false
	}
	s, e, ok := body.Locate(l, "error", "code")
	if !ok {
		return false
	}
	code, err := strconv.Atoi(string(l[s:e]))
	return err == nil && code >= 500
}

// Failed reports whether an error event with a 5xx code has been read.
func (f *Failure) Failed() bool { return f.failed }
