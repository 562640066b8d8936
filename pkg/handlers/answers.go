package handlers

import (
	"slices"
	"sync/atomic"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// answerState is what an exchange knows of its answer, the decode engine's
// response, on its way to the client.
type answerState struct {
	done bool // the response body has ended
	// held is what the usage rewrite holds of the answer, counted against
	// the body budget (limits.max_buffered_bytes).
	held int64
	// begun: the decode engine has answered, or begun to, as far as a
	// call-back (watchLeg) is concerned: anything but a 2xx event stream
	// whose body Envoy sends and has not sent yet.
	begun atomic.Bool
}

func (x *exchange) onResponseBody(b *extprocv3.HttpBody) reply {
	if x.answer.done {
		return reply{}
	}
	x.answer.done = b.GetEndOfStream()
	x.answer.begun.Store(true)
	x.decision.Watch(b.GetBody())
	if x.responseMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return answer(continueResponseBody())
	}
	if x.rewriting() {
		return reply{chunks: x.passResponse(b.GetBody(), b.GetEndOfStream(), b.GetEndOfStream()), eos: b.GetEndOfStream()}
	}
	// Echo at once: SSE tokens must keep streaming to the client.
	return answer(streamedChunk(false, b.GetBody(), b.GetEndOfStream()))
}

// onResponseTrailers answers the response's trailers. In FULL_DUPLEX they end
// the body, so what a rewrite still holds goes before their reply.
func (x *exchange) onResponseTrailers() reply {
	r := reply{last: continueResponseTrailers()}
	if x.rewriting() && !x.answer.done && x.responseMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		x.answer.done = true
		r.chunks = x.passResponse(nil, true, false)
	}
	return r
}

// passResponse gives the rewrite a response chunk (last: the body ends with
// it, or with the trailers that came) and returns the chunks it lets through,
// for FULL_DUPLEX replies. While it holds a partial event there is nothing to
// send, and Envoy needs no reply per chunk (docs/envoy.md §2.6); when the
// reply ends the body (eos), there is always a chunk for it, empty or not.
func (x *exchange) passResponse(chunk []byte, last, eos bool) [][]byte {
	out := x.holdAnswer(x.decision.Rewrite.Body(chunk, last))
	chunks := [][]byte(out) // almost always the chunk itself, one piece
	if len(out) > 1 || out.Len() > maxStreamedChunk {
		chunks = out.Chunks(maxStreamedChunk) // a fixed event or answer, joined; a long answer, cut
	}
	empty := func(c []byte) bool { return len(c) == 0 }
	if n := len(chunks); n > 0 && !slices.ContainsFunc(chunks[:n-1], empty) && (eos || !empty(chunks[n-1])) {
		return chunks // nothing to drop: the usual case, allocation-free
	}
	var kept [][]byte
	for i, c := range chunks {
		if !empty(c) || eos && i == len(chunks)-1 {
			kept = append(kept, c)
		}
	}
	if eos && len(kept) == 0 {
		kept = append(kept, nil)
	}
	return kept
}

// holdAnswer counts what the rewrite holds of the answer (a whole JSON
// answer, or an event cut across chunks) against the body budget, which
// request bodies share: when it has no room, the rewrite is given up and
// what it held passes on at once, after out.
func (x *exchange) holdAnswer(out body.Spliced) body.Spliced {
	held := int64(x.decision.Rewrite.Held())
	switch more := held - x.answer.held; {
	case more > 0 && !x.body.budget.take(more):
		out = append(out, x.decision.Rewrite.Drop()...)
		x.body.budget.give(x.answer.held)
		held = 0
	case more < 0:
		x.body.budget.give(-more)
	}
	x.answer.held = held
	return out
}

// rewriting reports whether the decision rewrites the response (the
// pipeline's Decision.Rewrite).
func (x *exchange) rewriting() bool { return x.decision != nil && x.decision.Rewrite != nil }
