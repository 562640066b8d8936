package kvevents

import (
	"context"
	"encoding/binary"
	"net"
	"strconv"

	"github.com/go-zeromq/zmq4"
)

// A publisher's replay socket (vLLM's replay_endpoint) is a ROUTER that
// answers a sequence number, 8 bytes big-endian, with every batch it still
// buffers from that number on, each as [seq, payload], then [-1, ""].

// endSeq ends a replay.
const endSeq = -1

// untilEnd asks replay for every batch the publisher still buffers.
const untilEnd = int64(^uint64(0) >> 1)

// replay asks st's publisher for the batches from st.next up to before seq
// and applies them; it reports whether it got them all. At the start of the
// stream (st.next 0) it takes what the publisher's buffer still holds, all
// of it when seq is untilEnd.
func (s *Subscriber) replay(ctx context.Context, st *stream, seq int64) bool {
	if s.cfg.ReplayPort == 0 {
		return false
	}
	host, _, err := net.SplitHostPort(st.pub.Endpoint)
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReplayTimeout)
	defer cancel()
	d := zmq4.NewDealer(s.bounded(ctx), zmq4.WithDialerMaxRetries(0), zmq4.WithTimeout(s.cfg.ReplayTimeout))
	defer d.Close()
	addr := boundedAddr(net.JoinHostPort(host, strconv.Itoa(s.cfg.ReplayPort+st.pub.Rank)))
	if err := d.Dial(addr); err != nil {
		s.log.V(1).Info("kv events: dialing the replay socket", "address", addr, "error", err.Error())
		return false
	}
	start := binary.BigEndian.AppendUint64(nil, uint64(st.next))
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, start)); err != nil {
		return false
	}
	initial := st.next == 0
	for st.next < seq {
		msg, err := d.Recv()
		if err != nil {
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
		case got > st.next && !initial:
			return false // the buffer no longer holds what was lost
		}
		st.next = got + 1
		s.apply(st.pub, payload)
	}
	s.counts.Replayed.Add(1)
	return true
}

// trimDelimiter drops the empty frame a ROUTER's reply starts with.
func trimDelimiter(msg [][]byte) [][]byte {
	if len(msg) > 0 && len(msg[0]) == 0 {
		return msg[1:]
	}
	return msg
}
