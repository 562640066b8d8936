package kvevents

import (
	"context"
	"encoding/binary"
	"net"
	"strconv"

	"github.com/cespare/xxhash/v2"
	"github.com/go-zeromq/zmq4"
)

// A publisher's replay socket (vLLM's replay_endpoint) is a ROUTER that
// answers a sequence number, 8 bytes big-endian, with every batch it still
// buffers from that number on, each as [topic, seq, payload], then
// ["", -1, ""] (vLLM since vllm-project/vllm#45177), or without the first
// frames (older vLLM, SGLang): frames reads either.

// endSeq ends a replay.
const endSeq = -1

// untilEnd asks replay for every batch the publisher still buffers.
const untilEnd = int64(^uint64(0) >> 1)

// replay asks st's publisher for the batches from st.next up to before seq
// and applies them; it reports whether it got them all. At the start of the
// stream (st.next 0) it takes what the publisher's buffer still holds, all
// of it when seq is untilEnd.
//
// From the start of the stream, a batch left out past the first one given
// (vLLM's replay socket sends its whole buffer, 10,000 batches by default,
// at once, and a ZeroMQ ROUTER drops what passes its high-water mark of
// 1,000) may be a removal lost: the view starts over from the batch after
// it, the rest of the buffer, which can only find less than is cached. For
// the whole buffer, an end that does not come is the end of what came: the
// stream's own numbers then show what is missing (a gap).
func (s *Subscriber) replay(ctx context.Context, st *stream, seq int64) bool {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReplayTimeout)
	defer cancel()
	d := s.askReplay(ctx, st.pub, st.next)
	if d == nil {
		return false
	}
	defer closeDrained(d) // the rest of the buffer may still be coming: read up to seq alone
	initial, applied := st.next == 0, false
	for st.next < seq {
		msg, err := d.Recv()
		if err != nil {
			if seq == untilEnd && applied {
				s.counts.Replayed.Add(1)
				return true
			}
			return false
		}
		got, payload, err := frames(trimDelimiter(msg.Frames))
		switch {
		case err == nil && got == endSeq && seq == untilEnd:
			s.counts.Replayed.Add(1)
			return true
		case err != nil || got == endSeq:
			return false
		case got < st.next:
			continue
		case got >= seq:
			return false // the batches before seq left out: they would come after later ones
		case got > st.next && !initial:
			return false // the buffer no longer holds what was lost
		case got > st.next && applied:
			s.index.Reset(st.pub, true)
		}
		applied = true
		st.next = got + 1
		s.apply(st.pub, payload)
		st.last = xxhash.Sum64(payload)
	}
	s.counts.Replayed.Add(1)
	return true
}

// askReplay asks p's replay socket for its batches from seq on; nil when
// there is none, or it cannot be reached. The caller reads the answer and
// closes the socket with closeDrained: the replay sends its whole buffer from
// seq on, more than the caller may read.
func (s *Subscriber) askReplay(ctx context.Context, p Publisher, from int64) zmq4.Socket {
	if s.cfg.ReplayPort == 0 {
		return nil
	}
	host, _, err := net.SplitHostPort(p.Endpoint)
	if err != nil {
		return nil
	}
	d := zmq4.NewDealer(s.bounded(ctx), zmq4.WithDialerMaxRetries(0), zmq4.WithTimeout(s.cfg.ReplayTimeout))
	addr := boundedAddr(net.JoinHostPort(host, strconv.Itoa(s.cfg.ReplayPort+p.Rank)))
	if err := d.Dial(addr); err != nil {
		s.log.V(1).Info("kv events: dialing the replay socket", "address", addr, "error", err.Error())
		d.Close()
		return nil
	}
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, uint64(from)))); err != nil {
		d.Close()
		return nil
	}
	return d
}

// startedOver says whether st's publisher, reached on a connection made
// anew, holds another batch under the number of the one applied last: it
// restarted unseen (vLLM numbers each process's batches from 0, with no
// epoch) and has published as many since, so its numbers read as the old
// ones'. Its replay buffer tells; without one, or without that batch in it,
// it cannot be told, and false.
func (s *Subscriber) startedOver(ctx context.Context, st *stream) bool {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReplayTimeout)
	defer cancel()
	d := s.askReplay(ctx, st.pub, st.next-1)
	if d == nil {
		return false
	}
	defer closeDrained(d) // one batch read of the buffer that follows
	msg, err := d.Recv()
	if err != nil {
		return false
	}
	got, payload, err := frames(trimDelimiter(msg.Frames))
	return err == nil && got == st.next-1 && xxhash.Sum64(payload) != st.last
}

// replayOrRebuild replays st's publisher from the start of its stream (st.next
// 0) up to before seq. One that fails before giving a batch leaves the view
// without what came before, which finds less than is cached; one that fails
// part way may have lost removals, and the view starts anew (Index.Rebuild).
func (s *Subscriber) replayOrRebuild(ctx context.Context, st *stream, seq int64) {
	from := st.next
	if s.cfg.ReplayPort != 0 && !s.replay(ctx, st, seq) && st.next > from {
		s.counts.ReplayFailed.Add(1)
		s.index.Rebuild(st.pub)
	}
}

// trimDelimiter drops the empty frame a ROUTER's reply starts with.
func trimDelimiter(msg [][]byte) [][]byte {
	if len(msg) > 0 && len(msg[0]) == 0 {
		return msg[1:]
	}
	return msg
}
