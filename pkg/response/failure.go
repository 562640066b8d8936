package response

import (
	"bytes"
	"strconv"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// maxErrorEvent is as much of an error event as Opening holds to read its
// code; vLLM's and SGLang's are a few hundred bytes.
const maxErrorEvent = 4 << 10

// Verdict is what the opening of a streamed answer says of its request.
type Verdict uint8

const (
	Pending Verdict = iota // nothing yet
	Served                 // its first token came (or an error that is the request's own)
	Failed                 // an error event with a 5xx code came first
)

// Opening reads the start of a streamed answer until it tells whether the
// engine served the request: its status says nothing of it, as vLLM and
// SGLang send a stream's 200 before the request has a token. A request that
// fails after it ends the stream with an error event, then data: [DONE].
// vLLM does so when the request finishes with an error (a KV load that
// failed, under kv_load_failure_policy "fail"), after a chat stream's first
// event, which only names the role:
//
//	data: {"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}
//
// (vllm/entrypoints/generate/base/serving.py, _raise_if_error;
// chat_completion/serving.py). SGLang sends it first, with its own message,
// "Decode transfer failed for request ..." on a decode server
// (disaggregation/decode.py, entrypoints/openai/serving_chat.py). So the
// request was served once a data event that is not an error has come for
// each choice, and, on a chat stream, one more (vLLM's chat sends each
// choice's role first, then tokens), and failed when an error event with a
// 5xx code comes before.
//
// A data line is JSON on one line, so a line that starts {"error" is such an
// event and nothing else: inside a JSON string the quotes are escaped. Only
// such a line is held; the others are read where they lie. Give it every
// chunk in order until it has a verdict.
type Opening struct {
	kind    lineKind
	held    []byte // the line so far, while it is unknown or an error event
	events  int    // complete data lines that are not error events
	served  int    // the events that tell the request was served
	verdict Verdict
}

// NewOpening reads the opening of a stream of the given number of choices
// (a request's n), whose data events before the tokens are leading: 1 for a
// chat stream (its role event), none for completions and generate, whose
// first event carries a token.
func NewOpening(choices, leading int) *Opening { return &Opening{served: max(choices, 1) + leading} }

type lineKind uint8

const (
	unknown lineKind = iota // too little of the line yet
	other                   // not a data line: a comment, event:, id:, a blank line
	data                    // a data line that is not an error event
	errorEvent
)

var (
	dataField = []byte("data:")
	// errorStarts are how an error event's data starts: the OpenAI API's
	// (chat, completions), and the Anthropic API's that vLLM's Messages
	// stream sends, {"type":"error","error":{"type":"internal_error",...}}
	// (AnthropicServingMessages.message_stream_converter,
	// vllm/entrypoints/anthropic/serving.py @82df3f49), pydantic's JSON
	// without spaces.
	errorStarts = [][]byte{[]byte(`{"error"`), []byte(`{"type":"error"`)}
)

// Scan reads the next chunk of the answer and returns the verdict so far.
func (o *Opening) Scan(chunk []byte) Verdict {
	for len(chunk) > 0 && o.verdict == Pending {
		end := bytes.IndexByte(chunk, '\n')
		part := chunk
		if end >= 0 {
			part, chunk = chunk[:end], chunk[end+1:]
		} else {
			chunk = nil
		}
		o.read(part)
		if end >= 0 {
			o.endLine()
		}
	}
	return o.verdict
}

// Verdict is the verdict so far.
func (o *Opening) Verdict() Verdict { return o.verdict }

// read takes the next part of the current line.
func (o *Opening) read(part []byte) {
	if o.kind == unknown && len(o.held) == 0 {
		if o.kind = classify(part); o.kind != unknown && o.kind != errorEvent {
			return // decided in place, nothing held
		}
	}
	if o.kind != unknown && o.kind != errorEvent {
		return
	}
	if len(o.held)+len(part) > maxErrorEvent {
		o.kind, o.held = other, o.held[:0] // an error event too long to read tells nothing
		return
	}
	o.held = append(o.held, part...)
	o.kind = classify(o.held)
}

// endLine judges the line that just ended.
func (o *Opening) endLine() {
	line := bytes.TrimSuffix(o.held, []byte("\r"))
	kind := o.kind
	if kind == unknown {
		if kind = classify(line); kind == unknown && bytes.HasPrefix(line, dataField) {
			kind = data // "data:" and a few bytes that cannot be an error
		}
	}
	switch kind {
	case data:
		if o.events++; o.events >= o.served {
			o.verdict = Served
		}
	case errorEvent:
		o.verdict = errorVerdict(line)
	}
	o.kind, o.held = unknown, o.held[:0]
}

// classify tells what a line is from its start, b.
func classify(b []byte) lineKind {
	off, ok := dataStart(b)
	switch {
	case !ok && bytes.HasPrefix(dataField, b): // "dat", so far
		return unknown
	case !ok:
		return other
	case off == len(b): // "data:" or "data: ", so far
		return unknown
	}
	v := b[off:]
	kind := data
	for _, start := range errorStarts {
		n := min(len(v), len(start))
		switch {
		case !bytes.Equal(v[:n], start[:n]):
		case n == len(start):
			return errorEvent
		default:
			kind = unknown
		}
	}
	return kind
}

// errorVerdict judges a whole error event: a 5xx code, or one of the
// Anthropic API's server-side types, is the engine's failure; a 4xx (or
// another type) is the request's own, which the engine served; an event
// whose code or type cannot be read tells nothing.
func errorVerdict(line []byte) Verdict {
	off, _ := dataStart(line)
	v := line[off:]
	s, e, ok := body.Locate(v, "error", "code")
	if !ok {
		if s, e, ok = body.Locate(v, "error", "type"); !ok || !bytes.HasPrefix(v, errorStarts[1]) {
			return Pending
		}
		switch string(v[s:e]) {
		case `"internal_error"`, `"api_error"`, `"overloaded_error"`, `"timeout_error"`:
			return Failed
		}
		return Served
	}
	code, err := strconv.Atoi(string(v[s:e]))
	switch {
	case err != nil:
		return Pending
	case code >= 500:
		return Failed
	}
	return Served
}

// StreamFailed reports whether a whole streamed answer failed before its
// first token (Opening).
func StreamFailed(answer []byte) bool {
	return NewOpening(1, 1).Scan(answer) == Failed
}
