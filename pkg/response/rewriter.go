package response

import (
	"strings"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// kind is how an answer's body is read.
type kind uint8

const (
	passing  kind = iota // passed on as it comes, unread
	whole                // one JSON document: held until its end, then fixed
	events               // server-sent events: each complete event passed on at once
	unopened             // server-sent events before the first one ends: one byte order mark may lead
)

// Rewriter fixes one answer. Start it with the answer's headers, then give it
// every chunk of the body in order; what it returns is what the client gets.
// It is not safe for concurrent use: one stream's goroutine drives it.
type Rewriter struct {
	path  []string // where the number sits in the answer's JSON
	event []string // where it sits in a streamed answer's events
	value []byte   // what to write there: the prefill engine's raw number
	// uncached is the count written with the number (Paths.Uncached): where
	// it sits, in the answer's JSON and its events alike (nil: none), and
	// what to write there.
	uncached struct {
		path  []string
		value []byte
	}
	key   []byte // the path's last name, quoted: an event without it is not read
	limit int    // bytes held at most: a JSON answer, or one event
	kind  kind
	held  []byte    // a JSON answer so far, or the start of an event cut across chunks
	fixed bool      // the number has been written at least once
	one   [1][]byte // the list of what passes as it came (see only)
	// outcome is how the answer fared (a metrics.Usage* value), "" until known.
	outcome string
	seen    func(raw []byte, stated bool) // a reader's (NewReader), nil for a rewriter
	read    []byte                        // a reader's: the last number a streamed answer carried, told at its end
	stated  bool                          // read was in the answer, not its absence (NoneCached)
	broken  bool                          // a reader's: the stream carried an error event (failed)
}

// Paths are where an API's answer carries the number: in a JSON answer, and
// in the events of a streamed one (nil: the same). Uncached, where the API
// has one, is where the answer carries the prompt tokens not found cached,
// which the number is written with, at the same place in a JSON answer and
// in the events that carry the number: Anthropic's input_tokens, which
// leaves out the cache_read_input_tokens beside it.
type Paths struct{ JSON, Event, Uncached []string }

// New returns a rewriter that writes value (raw JSON) where p says in an
// answer, and uncached at p.Uncached (nil when p has none): both where both
// are found, else neither. It holds at most limit bytes of the answer back.
// The JSON and event paths end in the same name.
func New(p Paths, value, uncached []byte, limit int) *Rewriter {
	if p.Event == nil {
		p.Event = p.JSON
	}
	r := &Rewriter{path: p.JSON, event: p.Event, value: value, key: body.Quote(p.JSON[len(p.JSON)-1]), limit: limit}
	r.uncached.path, r.uncached.value = p.Uncached, uncached
	return r
}

// NewReader returns a Rewriter that changes nothing: at the answer's end it
// gives seen the raw number at path, the last one a stream carried, holding
// at most limit bytes of a JSON answer back to look, and stated true. An
// answer whose usage is there without the details object that would hold
// the number counts as "0" (NoneCached), with stated false: an engine that
// never writes the details (vLLM without --enable-prompt-tokens-details)
// answers so too. A number that sits in the usage itself has no such
// object, and its absence tells nothing: vLLM's Anthropic handler wrote no
// cache_read_input_tokens at all before vllm-project/vllm#40912, while the
// same engine states chat's. Its Outcome is always "".
func NewReader(p Paths, limit int, seen func(raw []byte, stated bool)) *Rewriter {
	r := New(p, nil, nil, limit)
	r.seen = seen
	r.key = body.Quote(r.event[max(len(r.event)-3, 0)]) // the usage: an event without it says nothing
	return r
}

// NoneCached reports whether an answer without the number at path says that
// nothing was cached: the usage (the object two levels up from the number)
// is there, and the details object that would hold the number is absent or
// null. Many vLLM releases write prompt_tokens_details only when the count
// is not zero (`if self.enable_prompt_tokens_details and
// final_res.num_cached_tokens:` in vLLM's serving_chat.py and
// serving_completion.py), so a cold prompt comes back without it; llm-d
// reads it as 0 too. Later ones write it whenever the count is known
// (_make_prompt_tokens_details,
// vllm/entrypoints/openai/chat_completion/serving.py). A details object with
// no count, or a placeholder, tells nothing.
func NoneCached(doc []byte, path []string) bool {
	if len(path) < 3 {
		return false
	}
	if s, e, ok := body.Locate(doc, path[:len(path)-2]...); !ok || body.IsNull(doc[s:e]) {
		return false
	}
	s, e, ok := body.Locate(doc, path[:len(path)-1]...)
	return !ok || body.IsNull(doc[s:e])
}

var zero = []byte("0")

// Writes reports whether r rewrites the answer, rather than reads it.
func (r *Rewriter) Writes() bool { return r.seen == nil }

// IsEventStream reports whether an answer with these headers is a stream of
// server-sent events that can be read as it comes: not compressed.
func IsEventStream(contentType, contentEncoding string) bool {
	return mediaType(contentType) == "text/event-stream" && !encoded(contentEncoding)
}

// encoded reports whether a Content-Encoding leaves the body unreadable.
func encoded(contentEncoding string) bool {
	return contentEncoding != "" && !strings.EqualFold(contentEncoding, "identity")
}

// mediaType is a Content-Type's media type, lowercase.
func mediaType(contentType string) string {
	t, _, _ := strings.Cut(contentType, ";")
	return strings.ToLower(strings.TrimSpace(t))
}

// Start reads what the answer's headers say of its body. An error status, an
// encoded body (gzip: the number cannot be found in it) and any body that is
// neither JSON nor an event stream pass on untouched.
func (r *Rewriter) Start(status int, contentType, contentEncoding string) {
	switch mediaType := mediaType(contentType); {
	case status < 200 || status > 299:
		r.Skip(metrics.UsageNotRewritable)
	case encoded(contentEncoding):
		r.Skip(metrics.UsageNotRewritable)
	case mediaType == "application/json":
		r.kind = whole
	case mediaType == "text/event-stream":
		r.kind = unopened
	default:
		r.Skip(metrics.UsageNotRewritable)
	}
}

// Skip passes the whole answer on unchanged; why is the outcome to report.
func (r *Rewriter) Skip(why string) {
	r.kind, r.outcome = passing, why
}

// Outcome is how the answer fared, a metrics.Usage* value, once its stream
// has ended: unseen when the answer's headers never came (Envoy sends none
// under response_header_mode SKIP), cancelled when its end never came (the
// client left) unless the number had gone out. A reader's is "".
func (r *Rewriter) Outcome() string {
	switch {
	case !r.Writes():
		return ""
	case r.outcome != "":
		return r.outcome
	case r.fixed:
		return metrics.UsageRewritten
	case r.kind == passing: // neither Start nor Skip: no headers
		return metrics.UsageUnseen
	}
	return metrics.UsageCancelled
}

// Body takes the next chunk of the answer, last when it is the end (the final
// chunk, or the trailers after it), and returns what to pass on now, in order:
// nothing while a JSON answer or a cut event is held, everything held at the
// end. The pieces may share chunk's bytes, and the list is valid until the
// next call: send it first.
func (r *Rewriter) Body(chunk []byte, last bool) body.Spliced {
	switch r.kind {
	case whole:
		return r.document(chunk, last)
	case events, unopened:
		return r.stream(chunk, last)
	}
	return r.only(chunk)
}

// document collects a JSON answer and fixes it at its end; past the limit it
// gives up and passes on what it has.
func (r *Rewriter) document(chunk []byte, last bool) body.Spliced {
	if len(r.held)+len(chunk) > r.limit {
		return r.giveUp(chunk)
	}
	if r.held == nil && last {
		return r.fix(chunk) // the whole answer in one chunk: no copy
	}
	r.held = append(r.held, chunk...)
	if !last {
		return nil
	}
	doc := r.held
	r.held = nil
	return r.fix(doc)
}

// fix writes the value into a whole JSON answer, or tells a reader what it
// says.
func (r *Rewriter) fix(doc []byte) body.Spliced {
	r.outcome = metrics.UsageAbsent
	if !r.Writes() {
		if start, end, ok := body.Locate(doc, r.path...); ok {
			r.seen(doc[start:end], true)
		} else if NoneCached(doc, r.path) {
			r.seen(zero, false)
		}
		return r.only(doc)
	}
	spots, ok := r.spots(doc, r.path)
	if !ok {
		return r.only(doc)
	}
	r.outcome = metrics.UsageRewritten
	out, from := splice(nil, doc, 0, spots)
	return append(out, doc[from:])
}

// spot is where a number sits in a document, and what goes there.
type spot struct {
	start, end int
	value      []byte
}

// spots are where the value and the uncached count sit in doc, a JSON
// answer or one event's data, in order: false when one of them is not there.
func (r *Rewriter) spots(doc []byte, path []string) ([]spot, bool) {
	o, err := body.Parse(doc) // once for both numbers: a JSON answer may run to megabytes
	if err != nil {
		return nil, false
	}
	start, end, ok := o.Locate(path...)
	if !ok {
		return nil, false
	}
	number := spot{start, end, r.value}
	if r.uncached.path == nil {
		return []spot{number}, true
	}
	s, e, ok := o.Locate(r.uncached.path...)
	switch {
	case !ok:
		return nil, false
	case s < start:
		return []spot{{s, e, r.uncached.value}, number}, true
	}
	return []spot{number, {s, e, r.uncached.value}}, true
}

// splice appends to out doc from doc[from] up to the last spot, each
// spot's value in its place, and returns where doc goes on.
func splice(out body.Spliced, doc []byte, from int, spots []spot) (body.Spliced, int) {
	for _, s := range spots {
		out = append(out, doc[from:s.start], s.value)
		from = s.end
	}
	return out, from
}

// Held is how many bytes of the answer the rewrite holds back now.
func (r *Rewriter) Held() int { return len(r.held) }

// Drop gives the rewrite up, as for an answer past its limit: what it holds
// is to be passed on now, and the rest of the answer as it comes.
func (r *Rewriter) Drop() body.Spliced { return r.giveUp(nil) }

// giveUp passes on what is held and chunk, and the rest of the answer as it
// comes: it is larger than the service holds for a rewrite.
func (r *Rewriter) giveUp(chunk []byte) body.Spliced {
	var out body.Spliced
	for _, b := range [][]byte{r.held, chunk} {
		if len(b) > 0 {
			out = append(out, b)
		}
	}
	r.held = nil
	r.kind = passing
	r.outcome = metrics.UsageTooLarge
	if r.fixed {
		r.outcome = metrics.UsageRewritten
	}
	return out
}

// only is b as the only piece, or no piece for no bytes. Almost every chunk
// passes as it came, so the list is the rewriter's own, not a new one.
func (r *Rewriter) only(b []byte) body.Spliced {
	if len(b) == 0 {
		return nil
	}
	r.one[0] = b
	return r.one[:]
}
