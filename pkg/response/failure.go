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
	Failed                 // an error event with a 5xx code (or SGLang's abort chunk) came first
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
// An event is read as a client reads it (eventData): its data is its data
// lines' values joined by LF, judged as one. Engines send it on one line,
// JSON, so data that starts {"error" (past white space) is such an event and
// nothing else: inside a JSON string the quotes are escaped. Only an event
// that may be an error event is held, up to maxErrorEvent bytes; the others
// are told from their start. Give it every chunk in order until it has a
// verdict.
//
// SGLang's /generate stream (NewGenerateOpening) has no error event: a
// request its scheduler aborts, as a decode server does whose KV transfer
// failed (prepare_abort, disaggregation/decode.py), ends its stream with a
// chunk like the others whose meta_info.finish_reason is the abort, then
// data: [DONE] (_handle_abort_finish_reason, managers/tokenizer_manager.py
// @001067ff):
//
//	data: {"text":"","output_ids":[],"meta_info":{"id":"...","finish_reason":{"type":"abort","message":"Decode transfer failed ...","status_code":500,"err_type":null},...}}
//
// So there a chunk's data is held too, as much as an error event's, until
// it tells: one with output (text, or token ids) is a token; one without,
// whose finish_reason is an abort with a 5xx status_code, is the engine's
// failure, and with a 4xx the request's own. SGLang writes a chunk's text,
// then its output_ids, first (TokenizerManager._handle_batch_output), so
// a chunk with output is told from its start and is not held further,
// however long its meta_info (logprobs); one too long to read otherwise
// tells nothing, like an error event.
type Opening struct {
	// held is the event not yet ended: whole while it is not told, then
	// only its last two bytes, where the blank line that ends it may begin.
	held     []byte
	told     eventKind // data (it counts) or other (it tells nothing) once told before its end
	events   int       // complete data events that are not error events
	served   int       // the events that tell the request was served
	verdict  Verdict
	generate bool // the stream is SGLang's /generate: its chunks are read too
	begun    bool // the byte order mark one stream may start with is behind
}

// NewOpening reads the opening of a stream of the given number of choices
// (a request's n), whose data events before the tokens are leading: 1 for a
// chat stream (its role event), none for completions and generate, whose
// first event carries a token.
func NewOpening(choices, leading int) *Opening { return &Opening{served: max(choices, 1) + leading} }

// NewGenerateOpening reads the opening of SGLang's /generate stream of the
// given number of choices, whose chunks carry its tokens or its abort.
func NewGenerateOpening(choices int) *Opening {
	return &Opening{served: max(choices, 1), generate: true}
}

type eventKind uint8

const (
	unknown    eventKind = iota // too little of it yet
	other                       // an error event (or chunk) too long to read: it tells nothing
	data                        // an event that is not an error event
	errorEvent                  // held until its end
	chunk                       // a /generate chunk not yet told: held until its end
)

// errorStarts are how an error event's data starts: the OpenAI API's (chat,
// completions), and the Anthropic API's that vLLM's Messages stream sends,
// {"type":"error","error":{"type":"internal_error",...}}
// (AnthropicServingMessages.message_stream_converter,
// vllm/entrypoints/anthropic/serving.py @82df3f49), pydantic's JSON without
// spaces.
var errorStarts = [][]byte{[]byte(`{"error"`), []byte(`{"type":"error"`)}

// Scan reads the next chunk of the answer and returns the verdict so far.
func (o *Opening) Scan(chunk []byte) Verdict {
	if o.verdict != Pending {
		return o.verdict
	}
	b, fresh := chunk, 0
	if len(o.held) > 0 {
		b, fresh = append(o.held, chunk...), len(o.held)
	}
	if !o.begun {
		if len(b) < len(bom) && bytes.HasPrefix(bom, b) {
			o.held = bytes.Clone(b)
			return Pending
		}
		b, fresh, o.begun = bytes.TrimPrefix(b, bom), 0, true // what is held has no line end
	}
	cut, at := eventsEnd(b, fresh), 0
	if cut > 0 && o.told != unknown { // the told event ends first
		at = eventEnd(b[:cut], 0)
		o.count(o.told == data)
		o.told = unknown
	}
	for at < cut && o.verdict == Pending {
		end := eventEnd(b[:cut], at)
		o.judge(b[at:end])
		at = end
	}
	o.held = nil
	if o.verdict == Pending {
		o.hold(b[cut:])
	}
	return o.verdict
}

// Verdict is the verdict so far.
func (o *Opening) Verdict() Verdict { return o.verdict }

// judge reads a complete event.
func (o *Opening) judge(ev []byte) {
	kind, doc := o.tell(ev)
	switch kind {
	case errorEvent:
		o.verdict = errorVerdict(doc)
	case chunk:
		var token bool
		o.verdict, token = chunkVerdict(doc)
		o.count(token)
	case data, unknown: // data, "[DONE]", and a few bytes that cannot be an error
		o.count(kind == data || len(doc) > 0)
	}
}

// hold keeps rest, the start of an event not yet ended, until it is told.
func (o *Opening) hold(rest []byte) {
	if o.told == unknown {
		if kind, _ := o.tell(rest); kind == data || kind == other {
			o.told = kind
		}
	}
	if o.told != unknown {
		rest = rest[max(len(rest)-2, 0):]
	}
	o.held = bytes.Clone(rest) // chunk's bytes are Envoy's message's
}

// count counts an event, when it tells the request was served.
func (o *Opening) count(served bool) {
	if !served {
		return
	}
	if o.events++; o.events >= o.served {
		o.verdict = Served
	}
}

// tell is what an event, or the start of one, is, and its data past the
// white space a client's JSON parser skips (a bare "data" line's LF, a
// second space after "data:"). One that is held (unknown, errorEvent,
// chunk) past maxErrorEvent bytes is read no further and tells nothing
// (other), unless its start tells it is data. Blank lines before it carry
// nothing, and whether the line end before them was cut across chunks does
// not change what it is.
func (o *Opening) tell(ev []byte) (eventKind, []byte) {
	ev = bytes.TrimLeft(ev, "\r\n")
	doc, _ := eventData(ev[:min(len(ev), maxErrorEvent)])
	doc = bytes.TrimLeft(doc, " \t\n")
	switch kind := o.classify(doc); {
	case len(ev) <= maxErrorEvent:
		return kind, doc
	case kind == data:
		return data, nil
	}
	return other, nil
}

// classify tells what an event's data is from its start, v.
func classify(v []byte) eventKind {
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

// classify is classify on a /generate stream too: there a JSON object that
// is not an error event is a chunk, held until it tells, unless its start
// shows output.
func (o *Opening) classify(v []byte) eventKind {
	kind := classify(v)
	if kind != data || !o.generate || len(v) == 0 || v[0] != '{' || outputLeads(v) {
		return kind
	}
	return chunk
}

var (
	textLead = []byte(`{"text":"`)
	idsAfter = []byte(`","output_ids":[`) // after an empty text
	idsLead  = []byte(`{"output_ids":[`)  // without text (skip_tokenizer_init)
)

// outputLeads reports whether the start of a /generate chunk, v, shows
// output as SGLang writes it (orjson, no spaces): a text that is not
// empty, or a first token id.
func outputLeads(v []byte) bool {
	rest, ok := bytes.CutPrefix(v, textLead)
	switch {
	case ok && len(rest) > 0 && rest[0] != '"':
		return true
	case ok:
		rest, ok = bytes.CutPrefix(rest, idsAfter)
	default:
		rest, ok = bytes.CutPrefix(v, idsLead)
	}
	return ok && len(rest) > 0 && rest[0] >= '0' && rest[0] <= '9'
}

// chunkVerdict judges a whole /generate chunk, v: one with output (a text
// that is not empty, or token ids) is a token; one without, whose
// meta_info.finish_reason is an abort, is the engine's failure with a 5xx
// status_code and the request's own (served) with another; anything else
// (an abort a client asked for has no status_code) tells nothing.
func chunkVerdict(v []byte) (verdict Verdict, token bool) {
	obj, err := body.Parse(v)
	if err != nil {
		return Pending, false
	}
	if text, ok := obj.Raw("text"); ok && len(text) > 2 && text[0] == '"' {
		return Pending, true
	}
	if ids, ok := obj.Raw("output_ids"); ok {
		for range body.Items(ids) {
			return Pending, true
		}
	}
	b := obj.Bytes()
	s, e, ok := obj.Locate("meta_info", "finish_reason", "type")
	if !ok || string(b[s:e]) != `"abort"` {
		return Pending, false
	}
	s, e, ok = obj.Locate("meta_info", "finish_reason", "status_code")
	code, err := strconv.Atoi(string(b[s:e]))
	switch {
	case !ok || err != nil:
		return Pending, false
	case code >= 500:
		return Failed, false
	}
	return Served, false
}

// errorVerdict judges a whole error event: a 5xx code, or one of the
// Anthropic API's server-side types, is the engine's failure; a 4xx (or
// another type) is the request's own, which the engine served; an event
// whose code or type cannot be read tells nothing.
func errorVerdict(v []byte) Verdict {
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

// StreamFailed reports whether a whole streamed answer (a prefill leg that
// keeps the client's stream) failed before its first token (Opening), or is
// SGLang's /generate stream of a request its scheduler aborted with a 5xx:
// that stream has no error event, the abort is a chunk like the others,
// with meta_info.finish_reason {"type": "abort", "status_code": 500}
// (_handle_abort_finish_reason in SGLang's managers/tokenizer_manager.py).
// Unlike NewGenerateOpening's, this abort counts wherever it comes: a leg
// whose KV handoff failed fails its decode, token or not.
func StreamFailed(answer []byte) bool {
	if NewOpening(1, 1).Scan(answer) == Failed {
		return true
	}
	answer = bytes.TrimPrefix(answer, bom)
	ended := answer[:eventsEnd(answer, 0)] // an event the stream does not end is none
	for start, end := range eventsWith(ended, statusCode) {
		doc, _ := eventData(ended[start:end])
		s, e, ok := body.Locate(doc, "meta_info", "finish_reason", "status_code")
		if code, err := strconv.Atoi(string(doc[s:e])); ok && err == nil && code >= 500 {
			return true
		}
	}
	return false
}

var statusCode = []byte(`"status_code"`)
