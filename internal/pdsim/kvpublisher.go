package pdsim

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// publisher is vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py):
// the cache's changes go through a bounded queue to one goroutine that
// numbers, encodes and sends them as [topic, seq, payload] on a PUB socket,
// and keeps the last batches for a ROUTER socket that replays them.
type publisher struct {
	wire     kvWire
	endpoint zmqEndpoint
	queue    chan kvBatch
	buffer   replayBuffer
	log      *slog.Logger
	topic    []byte // set before run starts

	mu     sync.Mutex
	next   uint64     // the next batch's sequence number
	pub    *pubSocket // nil while stopped
	replay *zmtpPeers
	addrs  publisherAddrs
	drop   dropping
	counts publisherCounts

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// publisherAddrs are where a publisher's sockets are.
type publisherAddrs struct {
	pub    string // where the PUB socket binds (its first port, kept on a restart) or dials
	replay string // where the ROUTER binds; "" for none
}

// dropping is Faults.DropKVEventsEvery as it stands.
type dropping struct {
	every   int
	counted int // batches since every was set
}

// publisherCounts are what KVEventsStats reports.
type publisherCounts struct {
	sent, dropped, unsent, overflowed atomic.Uint64
}

// queueSize bounds the batches waiting to be sent; more are lost, their
// sequence numbers a gap no replay fills.
const queueSize = 10_000

func newPublisher(cfg KVEvents, log *slog.Logger) (*publisher, error) {
	ep, err := parseEndpoint(cfg.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("pdsim: kv events endpoint %w", err)
	}
	ep.bind = ep.bind || cfg.Bind
	p := &publisher{
		wire:     newKVWire(cfg.Encoding, cfg.IntHashes),
		endpoint: ep,
		queue:    make(chan kvBatch, queueSize),
		buffer:   replayBuffer{size: cfg.BufferSteps},
		log:      log,
		addrs:    publisherAddrs{pub: ep.addr},
	}
	if cfg.ReplayEndpoint != "" {
		rep, err := parseEndpoint(cfg.ReplayEndpoint)
		if err != nil {
			return nil, fmt.Errorf("pdsim: kv events replay endpoint %w", err)
		}
		p.addrs.replay = rep.addr // a ROUTER always binds
	}
	return p, nil
}

// add numbers a change and queues it without blocking. Whether it is to be
// sent is decided now, so a change made while stopped is never sent, even
// if the goroutine gets to it after a restart.
func (p *publisher) add(events []kvEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	b := kvBatch{seq: p.next, ts: time.Now(), events: events}
	p.next++
	p.drop.counted++
	dropped := p.drop.every > 0 && p.drop.counted%p.drop.every == 0
	b.send = !dropped && p.pub != nil
	select {
	case p.queue <- b:
	default:
		p.counts.overflowed.Add(1)
		return
	}
	switch {
	case dropped:
		p.counts.dropped.Add(1)
	case !b.send:
		p.counts.unsent.Add(1)
	}
}

// start opens the sockets and sends the queued batches under topic.
func (p *publisher) start(topic string) error {
	p.topic = []byte(topic)
	if err := p.open(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	p.wg.Go(func() {
		for {
			select {
			case b := <-p.queue:
				p.publish(b)
			case <-ctx.Done():
				return
			}
		}
	})
	return nil
}

// open opens the PUB socket and the replay socket, if they are closed.
func (p *publisher) open() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pub != nil {
		return nil
	}
	pub := newPubSocket()
	if !p.endpoint.bind {
		pub.dial(p.addrs.pub)
	} else if err := pub.listen(p.addrs.pub); err != nil {
		return fmt.Errorf("pdsim: kv events endpoint: %w", err)
	} else {
		p.addrs.pub = pub.addr.String()
	}
	if p.addrs.replay != "" {
		replay := newPeers(zmq4.Router, p.serveReplay)
		if err := replay.listen(p.addrs.replay); err != nil {
			pub.close()
			return fmt.Errorf("pdsim: kv events replay endpoint: %w", err)
		}
		p.replay, p.addrs.replay = replay, replay.addr.String()
	}
	p.pub = pub
	return nil
}

// closeSockets closes both sockets; batches are still numbered and kept
// for replay, but not sent.
func (p *publisher) closeSockets() {
	p.mu.Lock()
	pub, replay := p.pub, p.replay
	p.pub, p.replay = nil, nil
	p.mu.Unlock()
	if pub != nil {
		pub.close()
	}
	if replay != nil {
		replay.close()
	}
}

func (p *publisher) close() {
	p.closeSockets()
	if p.cancel != nil {
		p.cancel()
	}
	p.wg.Wait()
}

func (p *publisher) publish(b kvBatch) {
	payload, err := p.wire.encode(b)
	if err != nil {
		p.log.Error("kv events: encoding", "seq", b.seq, "err", err)
		return
	}
	p.buffer.add(b.seq, payload)
	if !b.send {
		return
	}
	p.mu.Lock()
	pub := p.pub
	p.mu.Unlock()
	if pub == nil { // stopped since
		p.counts.unsent.Add(1)
		return
	}
	p.counts.sent.Add(1)
	pub.send(zmq4.NewMsgFrom(p.topic, binary.BigEndian.AppendUint64(nil, b.seq), payload))
}

func (p *publisher) setDropEvery(n int) {
	p.mu.Lock()
	p.drop.every, p.drop.counted = n, 0
	p.mu.Unlock()
}

// endOfReplay is the sequence number that ends a replay: -1, 8 bytes signed.
var endOfReplay = binary.BigEndian.AppendUint64(nil, math.MaxUint64)

// serveReplay answers each request [empty, start_seq] (a ROUTER sees the
// client's identity before them) with every buffered batch from start_seq
// on, [empty, topic, seq, payload], then [empty, empty, -1, empty], as vLLM
// does since vllm-project/vllm#45177 (before, without the topic frames).
func (p *publisher) serveReplay(zc *zmq4.Conn) {
	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			return
		}
		if len(msg.Frames) != 2 {
			p.log.Warn("kv events: invalid replay request", "frames", len(msg.Frames))
			continue
		}
		for _, e := range p.buffer.since(bigEndian(msg.Frames[1])) {
			if zc.SendMsg(zmq4.NewMsgFrom(nil, p.topic, binary.BigEndian.AppendUint64(nil, e.seq), e.payload)) != nil {
				return
			}
		}
		if zc.SendMsg(zmq4.NewMsgFrom(nil, nil, endOfReplay, nil)) != nil {
			return
		}
	}
}

// bigEndian reads an unsigned big-endian integer, as Python's
// int.from_bytes(b, "big") does; one too large for 64 bits is the largest.
func bigEndian(b []byte) uint64 {
	if len(b) > 8 {
		return math.MaxUint64
	}
	var n uint64
	for _, c := range b {
		n = n<<8 | uint64(c)
	}
	return n
}

// replayBuffer keeps the last size batches sent, vLLM's buffer_steps.
type replayBuffer struct {
	size    int
	mu      sync.Mutex
	entries []replayEntry // by seq
}

type replayEntry struct {
	seq     uint64
	payload []byte
}

func (r *replayBuffer) add(seq uint64, payload []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.entries = append(r.entries, replayEntry{seq, payload})
	if len(r.entries) > r.size {
		r.entries = r.entries[len(r.entries)-r.size:]
	}
}

func (r *replayBuffer) since(seq uint64) []replayEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	i := sort.Search(len(r.entries), func(i int) bool { return r.entries[i].seq >= seq })
	return append([]replayEntry(nil), r.entries[i:]...)
}
