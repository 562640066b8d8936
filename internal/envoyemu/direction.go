package envoyemu

import (
	"errors"
	"fmt"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
)

// sink is what sits after the filter in a direction: the router for the
// request, the downstream connection for the response.
type sink interface {
	headers(h *headerMap, endStream bool)
	data(b []byte, endStream bool)
	trailers(t *headerMap)
}

// errSpurious marks a reply Envoy rejects with FailedPrecondition (§7.3):
// status_on_error, or fail-open when failure_mode_allow applies.
var errSpurious = errors.New("spurious message")

func spurious(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errSpurious, fmt.Sprintf(format, args...))
}

// direction is one half of the ext_proc filter: the decoder (request) or the
// encoder (response) (§1.7: they share the gRPC stream but keep separate
// states). What Envoy sent and waits for, hence which replies are spurious,
// is its rules' (§10); the direction itself buffers and forwards.
type direction struct {
	x        *exchange
	response bool
	sink     sink
	rules    *rules.Direction

	// Effective modes; CONTINUE_AND_REPLACE changes them (§3.1).
	sendHeaders  bool
	bodyMode     extprocfilterv3.ProcessingMode_BodySendMode
	sendTrailers bool

	src   source
	buf   buffer
	out   output
	timer loopTimer // the message timer (§5)
}

// source is what the client or upstream delivered so far.
type source struct {
	headers      *headerMap
	noBody       bool // headers carried end_of_stream (§2.1)
	bodyComplete bool // the body is over (end_of_stream data or trailers)
	trailers     *headerMap
}

// buffer is the body held inside the filter.
type buffer struct {
	held            []byte        // not yet sent to the server nor passed on
	inflight        []byte        // sent as one buffered message, awaiting its reply
	inflightEnd     bool          // end_of_stream of that message
	chunks          []queuedChunk // STREAMED: sent, awaiting their reply (FIFO, §2.4)
	partialDone     bool          // BUFFERED_PARTIAL answered: the rest passes through (§2.5)
	replaced        bool          // CONTINUE_AND_REPLACE: later source body is dropped (§3.1)
	trailersPending bool          // received, waiting for earlier callbacks (§2.8)
}

type queuedChunk struct {
	data []byte
	end  bool
}

// output is what leaves the filter: everything waits until the headers
// continue.
type output struct {
	headersContinued bool
	data             []byte
	end              bool
	trailers         *headerMap
	ended            bool
}

func (d *direction) name() string { return d.rules.Name() }

func (d *direction) fullDuplex() bool { return isFullDuplex(d.bodyMode) }

func (d *direction) dir() envoymsg.Direction { return envoymsg.Direction(d.response) }

// expect logs a message the rules say Envoy would not send: an emulator bug.
func (d *direction) expect(f rules.Fit) {
	if f != rules.Expected {
		d.x.logf("%s: a message Envoy would not send (%v): %s", d.name(), f, d.rules.Off())
	}
}

// shouldRemoveContentLength is ProcessorState::shouldRemoveContentLength (§3.5).
func (d *direction) shouldRemoveContentLength() bool {
	if d.x.cfg.Mutations.AllowContentLengthHeader {
		return false
	}
	switch d.bodyMode {
	case extprocfilterv3.ProcessingMode_STREAMED,
		extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL:
		return true
	case extprocfilterv3.ProcessingMode_BUFFERED:
		return !d.sendHeaders
	}
	return false
}

// continueHeaders hands the headers to the sink (the routing point of §2.11
// for the request), then whatever body was produced while they were held.
func (d *direction) continueHeaders() {
	if d.out.headersContinued || d.src.headers == nil || d.x.finished {
		return
	}
	d.out.headersContinued = true
	if d.src.noBody {
		d.out.ended = true
		d.sink.headers(d.src.headers, true)
		return
	}
	d.sink.headers(d.src.headers, false)
	data, end, tr := d.out.data, d.out.end, d.out.trailers
	d.out.data, d.out.end, d.out.trailers = nil, false, nil
	if len(data) > 0 || end {
		d.emitData(data, end)
	}
	if tr != nil {
		d.emitTrailers(tr)
	}
}

func (d *direction) emitData(b []byte, end bool) {
	if d.out.ended || d.x.finished {
		return
	}
	if !d.out.headersContinued {
		d.out.data = append(d.out.data, b...)
		d.out.end = d.out.end || end
		return
	}
	if len(b) == 0 && !end {
		return
	}
	if end {
		d.out.ended = true
	}
	d.sink.data(b, end)
}

func (d *direction) emitTrailers(t *headerMap) {
	if d.out.ended || d.x.finished {
		return
	}
	if !d.out.headersContinued {
		d.out.trailers = t
		return
	}
	d.out.ended = true
	d.sink.trailers(t)
}
