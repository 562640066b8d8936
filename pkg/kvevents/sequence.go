package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/cespare/xxhash/v2"
)

// A publisher numbers its batches; this file is how the subscriber reads one
// publisher's sequence: in order, a gap replayed or the view rebuilt, a
// restart told from a late batch.

// stream is what the subscriber knows of one publisher's sequence.
type stream struct {
	pub  Publisher
	next int64 // the sequence number expected next; -1 before the first
	// live is the last sequence number the connection delivered, -1 before
	// its first; ahead says a replay at its start may have read past it.
	live  int64
	ahead bool
	// last is a hash of the batch applied last, numbered next-1: a
	// connection made anew asks the replay socket whether it still holds
	// that batch under that number (startedOver).
	last uint64
}

// restarted says whether seq, delivered now, is from a publisher that
// started over since st.next was set: numbered at or below the last batch
// of this connection (a stream delivers in order), or below what was read
// before on a connection made anew, which cannot deliver batches published
// before it, unless a replay at its start read ahead of it. vLLM numbers
// its batches from 0 in each process, with no epoch to tell.
func (st *stream) restarted(seq int64) bool {
	switch {
	case st.next <= 0 || seq >= st.next:
		return false
	case st.live < 0:
		return !st.ahead
	}
	return seq <= st.live
}

// frames splits a message into its sequence number and payload: vLLM sends
// [topic, seq, payload], and some releases [seq, payload].
func frames(msg [][]byte) (seq int64, payload []byte, err error) {
	switch len(msg) {
	case 2, 3:
		raw := msg[len(msg)-2]
		if len(raw) != 8 {
			return 0, nil, fmt.Errorf("a sequence number of %d bytes", len(raw))
		}
		return int64(binary.BigEndian.Uint64(raw)), msg[len(msg)-1], nil
	}
	return 0, nil, fmt.Errorf("a message of %d frames", len(msg))
}

// handle applies one message in order: a gap is filled from the replay
// socket, or the view starts anew; a sequence starting over is a restarted
// engine, whose cache starts empty.
func (s *Subscriber) handle(ctx context.Context, st *stream, msg [][]byte) {
	seq, payload, err := frames(msg)
	if err != nil {
		s.counts.Undecodable.Add(1)
		return
	}
	restarted := st.restarted(seq) || st.live < 0 && st.next > 0 && seq >= st.next && s.startedOver(ctx, st)
	st.live = seq
	switch {
	case st.next < 0:
		// The first batch seen: with a replay socket, what the engine
		// published before (as far as its buffer goes) is asked for too, so
		// that a router that starts late still knows what was cached.
		if seq > 0 && s.cfg.ReplayPort != 0 {
			st.next = 0
			s.replayOrRebuild(ctx, st, seq)
		}
	case restarted:
		// Its cache starts empty; what it published before seq, as far as
		// its buffer goes.
		s.counts.Restarts.Add(1)
		s.index.Reset(st.pub, true)
		if st.next = 0; seq > 0 {
			s.replayOrRebuild(ctx, st, seq)
		}
	case seq == st.next:
	case seq < st.next:
		return // a batch seen already
	default:
		s.counts.Gaps.Add(1)
		s.index.SetFresh(st.pub, false)
		if s.replay(ctx, st, seq) {
			s.index.SetFresh(st.pub, true)
		} else {
			s.counts.ReplayFailed.Add(1)
			s.index.Rebuild(st.pub)
		}
	}
	st.next = seq + 1
	s.apply(st.pub, payload)
	st.last = xxhash.Sum64(payload)
	if s.handled != nil {
		s.handled(st.pub, seq)
	}
}

// apply applies a batch to p's view. One that cannot be read is a batch
// lost, which a replay would give as it is: the view starts anew
// (Index.Rebuild).
func (s *Subscriber) apply(p Publisher, payload []byte) {
	b, err := DecodeBatch(payload)
	if err != nil {
		s.counts.Undecodable.Add(1)
		s.index.Rebuild(p)
		return
	}
	s.counts.Batches.Add(1)
	skipped := s.index.Apply(p, b.Events)
	s.counts.Orphans.Add(int64(skipped.Orphans))
	s.counts.Skipped.Add(int64(skipped.Other))
	s.counts.UnknownEvents.Add(int64(skipped.Unknown + b.Unknown))
}
