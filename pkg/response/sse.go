package response

import (
	"bytes"
	"iter"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// stream passes on every complete event of a server-sent event stream at
// once, fixing the number in the events that carry it, and holds back only an
// event cut across chunks until the rest of it comes. An event that outgrows
// the limit gives the stream up. One the stream's end cuts is none to a
// client: it passes as it came.
func (r *Rewriter) stream(chunk []byte, last bool) body.Spliced {
	data, fresh := chunk, 0 // fresh: where the bytes not yet looked at begin
	if len(r.held) > 0 {
		data, fresh = append(r.held, chunk...), len(r.held) // held is our own copy
		r.held = nil
	}
	cut := eventsEnd(data, fresh)
	if !last && len(data)-cut > r.limit { // the events before the one that outgrows it are fixed still
		return append(r.events(data[:cut]), r.giveUp(data[cut:])...)
	}
	out := r.events(data[:cut])
	switch {
	case cut == len(data):
	case last:
		out = append(out, data[cut:])
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
		before := i - 1 // the byte before the line end that ends at data[i]
		if data[i] == '\n' && data[before] == '\r' {
			before--
		}
		if isLineEnd(data[i]) && before >= 0 && isLineEnd(data[before]) {
			return i + 1
		}
	}
	return 0
}

// events fixes the number in the complete events of b. Only an event
// holding the quoted name is read: its data (its data lines' values joined
// by LF, as a client reads them) gets the value where its JSON has the path;
// every other byte is passed on as it is. A reader reads the events that
// hold the usage, and keeps what the last of them said.
func (r *Rewriter) events(b []byte) body.Spliced {
	if r.kind == unopened && len(b) > 0 { // b is the stream's start
		r.kind = events
		if bytes.HasPrefix(b, bom) {
			return append(body.Spliced{b[:len(bom)]}, r.events(b[len(bom):])...)
		}
	}
	if !r.Writes() && !r.broken {
		for start, end := range eventsWith(b, errorKey) {
			if doc, _ := eventData(b[start:end]); failed(doc) {
				r.broken = true
				break
			}
		}
	}
	if !bytes.Contains(b, r.key) {
		return r.only(b)
	}
	var out body.Spliced
	kept := 0 // b[kept:] is still to be passed on
	for start, end := range eventsWith(b, r.key) {
		doc, values := eventData(b[start:end])
		if !r.Writes() {
			r.readData(doc)
		} else if spots, ok := r.spots(doc, r.event); ok {
			for k := range spots { // into b: a number lies within one line's value
				shift := start + dataOffset(values, spots[k].start)
				spots[k].start += shift
				spots[k].end += shift
			}
			out, kept = splice(out, b, kept, spots)
			r.fixed = true
		}
	}
	if kept < len(b) {
		out = append(out, b[kept:])
	}
	return out
}

// eventsWith yields the bounds of each event of b that holds key.
func eventsWith(b, key []byte) iter.Seq2[int, int] {
	return func(yield func(start, end int) bool) {
		for at := 0; ; {
			i := bytes.Index(b[at:], key)
			if i < 0 {
				return
			}
			start, end := max(eventsEnd(b[:at+i], at), at), eventEnd(b, at+i)
			if !yield(start, end) {
				return
			}
			at = end
		}
	}
}

// eventEnd is where the event that b[i] is in ends: just after the blank
// line that ends it, or at the end of b.
func eventEnd(b []byte, i int) int {
	empty := false // the line now starting is empty so far
	for i < len(b) {
		c := b[i]
		i++
		if c != '\n' && c != '\r' {
			empty = false
			continue
		}
		if c == '\r' && i < len(b) && b[i] == '\n' {
			i++
		}
		if empty {
			return i
		}
		empty = true
	}
	return len(b)
}

// eventData is an event's data, its data lines' values joined by LF, and
// where each value lies in ev; the value of a single data line is ev's own.
func eventData(ev []byte) ([]byte, [][2]int) {
	var values [][2]int
	for i := 0; i < len(ev); {
		n := bytes.IndexAny(ev[i:], "\r\n")
		if n < 0 {
			n = len(ev) - i
		}
		if off, ok := dataStart(ev[i : i+n]); ok {
			values = append(values, [2]int{i + off, i + n})
		}
		if i += n + 1; i < len(ev) && ev[i-1] == '\r' && ev[i] == '\n' {
			i++
		}
	}
	if len(values) == 1 {
		return ev[values[0][0]:values[0][1]], values
	}
	var doc []byte
	for k, v := range values {
		if k > 0 {
			doc = append(doc, '\n')
		}
		doc = append(doc, ev[v[0]:v[1]]...)
	}
	return doc, values
}

// dataOffset is what to add to pos, an offset in an event's data, to find
// it in the event: the start of its value less the start of that value in
// the data.
func dataOffset(values [][2]int, pos int) int {
	at := 0
	for _, v := range values {
		if pos <= at+v[1]-v[0] {
			return v[0] - at
		}
		at += v[1] - v[0] + 1
	}
	return 0
}

// readData keeps what an event's data says of the number, for a reader: the
// number, "0" for a usage without its details (NoneCached), or nothing.
func (r *Rewriter) readData(doc []byte) {
	if start, end, ok := body.Locate(doc, r.event...); ok {
		r.read, r.stated = append(r.read[:0], doc[start:end]...), true // the chunk is Envoy's message's
	} else if NoneCached(doc, r.event) {
		r.read, r.stated = append(r.read[:0], zero...), false
	}
}

var errorKey = []byte(`"error"`)

func isLineEnd(c byte) bool { return c == '\n' || c == '\r' }

// failed says whether an event's data is an engine's error event. vLLM ends a
// stream that fails after its 200 with `data: {"error": {...}}` (older
// releases: {"object": "error", ...}) and [DONE], without the final usage
// event: what its continuous usage said before (no details, read as 0)
// says nothing of the cache.
func failed(data []byte) bool {
	o, err := body.Parse(data)
	if err != nil {
		return false
	}
	kind, _ := o.String("object")
	return o.Has("error") || kind == "error"
}

// bom is the byte order mark a stream may start with, which a client skips
// there only (WHATWG HTML, "Interpreting an event stream"): elsewhere it is
// part of its line, "\ufeffdata" a field a client ignores. Engines send none.
var bom = []byte("\ufeff")

// dataStart is where the value of a data line begins: "data:", or a bare
// "data", whose value is empty (a line without a colon is a field's name).
func dataStart(line []byte) (int, bool) {
	const field = "data:"
	if string(line) == field[:4] {
		return len(line), true
	}
	if !bytes.HasPrefix(line, []byte(field)) {
		return 0, false
	}
	off := len(field)
	if off < len(line) && line[off] == ' ' { // one space after the colon is not part of the value
		off++
	}
	return off, true
}
