package response

import (
	"bytes"
	"slices"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// stream passes on every complete event of a server-sent event stream at
// once, fixing the number in the events that carry it, and holds back only an
// event cut across chunks until the rest of it comes. An event that outgrows
// the limit gives the stream up.
func (r *Rewriter) stream(chunk []byte, last bool) body.Spliced {
	data, fresh := chunk, 0 // fresh: where the bytes not yet looked at begin
	if len(r.held) > 0 {
		data, fresh = append(r.held, chunk...), len(r.held) // held is our own copy
		r.held = nil
	}
	cut := len(data)
	if !last {
		cut = eventsEnd(data, fresh)
	}
	if len(data)-cut > r.limit { // the events before the one that outgrows it are fixed still
		return append(r.events(data[:cut]), r.giveUp(data[cut:])...)
	}
	out := r.events(data[:cut])
	switch {
	case cut == len(data):
	case cut == 0 && fresh > 0:
		// Still one event, in our own buffer: it grows in place, so an
		// event cut across many chunks costs its size, not its square.
		r.held = data
	default:
		r.held = bytes.Clone(data[cut:]) // chunk's bytes are Envoy's message's, not ours to keep
	}
	if last {
		r.outcome = metrics.UsageAbsent
		if r.fixed {
			r.outcome = metrics.UsageRewritten
		}
		if r.read != nil && !r.broken {
			r.seen(r.read, r.stated)
		}
	}
	return out
}

// eventsEnd is where the last complete event of data ends: just after the
// blank line that ends it, 0 when none does. An event ends with two line
// ends in a row, each of them CRLF, LF or CR. Only a blank line finishing at
// or after data[from] is new, so the bytes before it are not read again.
func eventsEnd(data []byte, from int) int {
	for i := len(data) - 1; i >= max(from, 1); i-- {
		switch c, prev := data[i], data[i-1]; {
		case c == '\n' && prev == '\n', // LF LF, CRLF LF
			c == '\n' && prev == '\r' && i >= 2 && data[i-2] == '\n', // LF CRLF, CRLF CRLF
			c == '\r' && prev == '\r':                                // CR CR
			return i + 1
		}
	}
	return 0
}

// events fixes the number in the complete events of b. Only a line holding
// the quoted name is read: a "data:" line whose JSON has the path gets the
// value; every other byte is passed on as it is. A reader reads the lines
// that hold the usage, and keeps what the last of them said.
func (r *Rewriter) events(b []byte) body.Spliced {
	if !r.Writes() && !r.broken && bytes.Contains(b, errorKey) {
		r.broken = slices.ContainsFunc(bytes.FieldsFunc(b, isLineEnd), failed)
	}
	if !bytes.Contains(b, r.key) {
		return r.only(b)
	}
	var out body.Spliced
	kept := 0 // b[kept:] is still to be passed on
	for at := 0; ; {
		i := bytes.Index(b[at:], r.key)
		if i < 0 {
			break
		}
		lineStart := bytes.LastIndexAny(b[:at+i], "\r\n") + 1
		lineEnd := at + i + len(r.key)
		if j := bytes.IndexAny(b[lineEnd:], "\r\n"); j >= 0 {
			lineEnd += j
		} else {
			lineEnd = len(b)
		}
		if !r.Writes() {
			r.readData(b[lineStart:lineEnd])
		} else if off, ok := dataStart(b[lineStart:lineEnd]); ok {
			if fixed, ok := r.write(b[lineStart+off:lineEnd], r.event); ok {
				out = append(append(out, b[kept:lineStart+off]), fixed...)
				kept = lineEnd
				r.fixed = true
			}
		}
		at = lineEnd
	}
	if kept < len(b) {
		out = append(out, b[kept:])
	}
	return out
}

// readData keeps what an event line says of the number, for a reader: the
// number, "0" for a usage without its details (NoneCached), or nothing.
func (r *Rewriter) readData(line []byte) {
	off, ok := dataStart(line)
	if !ok {
		return
	}
	if start, end, ok := body.Locate(line[off:], r.event...); ok {
		r.read, r.stated = append(r.read[:0], line[off+start:off+end]...), true // the chunk is Envoy's message's
	} else if NoneCached(line[off:], r.event) {
		r.read, r.stated = append(r.read[:0], zero...), false
	}
}

var errorKey = []byte(`"error"`)

func isLineEnd(c rune) bool { return c == '\n' || c == '\r' }

// failed says whether an event line is an engine's error event. vLLM ends a
// stream that fails after its 200 with `data: {"error": {...}}` (older
// releases: {"object": "error", ...}) and [DONE], without the final usage
// event: what its continuous usage said before (no details, read as 0)
// says nothing of the cache.
func failed(line []byte) bool {
	off, ok := dataStart(line)
	if !ok {
		return false
	}
	o, err := body.Parse(line[off:])
	if err != nil {
		return false
	}
	kind, _ := o.String("object")
	return o.Has("error") || kind == "error"
}

// bom is the byte order mark a stream may start with, which a client skips
// (WHATWG HTML, "Interpreting an event stream"). It is skipped at the start
// of any line here: only the first can have one, and engines send none.
var bom = []byte("\ufeff")

// dataStart is where the value of a "data:" line begins.
func dataStart(line []byte) (int, bool) {
	const field = "data:"
	off := 0
	if bytes.HasPrefix(line, bom) {
		off = len(bom)
	}
	if !bytes.HasPrefix(line[off:], []byte(field)) {
		return 0, false
	}
	off += len(field)
	if off < len(line) && line[off] == ' ' { // one space after the colon is not part of the value
		off++
	}
	return off, true
}
