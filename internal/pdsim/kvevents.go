package pdsim

import (
	"fmt"
	"net"
)

// KVEvents makes the engine publish its prefix cache's changes as vLLM does
// with --kv-events-config (KVEventsConfig: endpoint, replay_endpoint, topic,
// buffer_steps): a BlockStored for the blocks a request newly caches (a run
// of them with the block before as parent; a prompt's first block has none),
// a BlockRemoved for each block evicted, AllBlocksCleared when the cache is
// reset. Each change is one batch (vLLM batches a scheduler step's changes).
type KVEvents struct {
	// Endpoint is the PUB socket: "tcp://*:5557" binds (vLLM's default),
	// "tcp://host:port" connects to a subscriber that binds, and a port of
	// 0 binds a free port (KVEventsAddr). Empty: no events.
	Endpoint string
	// ReplayEndpoint is where a ROUTER socket binds to resend the buffered
	// batches from a sequence number on ("tcp://*:5558"). Empty: no replay.
	ReplayEndpoint string
	// Topic is every message's first frame; default "kv@<Addr()>@<Model>",
	// the engine's advertised host and HTTP port and its model.
	Topic string
	// Encoding is KVEncodingMap (current vLLM, the default),
	// KVEncodingMapEvents or KVEncodingArray (older vLLM's).
	Encoding string
	// IntHashes sends each block hash as the int of its low 64 bits
	// (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) instead of its 32 sha256 bytes.
	IntHashes bool
	// BufferSteps is how many batches the replay socket keeps; default
	// 10,000, vLLM's.
	BufferSteps int
	// Bind binds Endpoint even when it names a host: simulators on one
	// machine, each on a loopback IP of its own, then publish on one port
	// as engines on their own hosts do on tcp://*:5557.
	Bind bool
}

func (k KVEvents) withDefaults() (KVEvents, error) {
	if k.Encoding == "" {
		k.Encoding = KVEncodingMap
	}
	switch k.Encoding {
	case KVEncodingMap, KVEncodingMapEvents, KVEncodingArray:
	default:
		return k, fmt.Errorf("pdsim: kv events encoding %q: want %s, %s or %s", k.Encoding, KVEncodingMap, KVEncodingMapEvents, KVEncodingArray)
	}
	if k.BufferSteps <= 0 {
		k.BufferSteps = 10_000
	}
	return k, nil
}

// startKVEvents starts publishing once the HTTP listener has its address,
// which names the default topic.
func (s *Server) startKVEvents() error {
	if s.kvpub == nil {
		return nil
	}
	topic := s.cfg.KVEvents.Topic
	if topic == "" {
		topic = "kv@" + s.Addr() + "@" + s.cfg.Model
	}
	s.kvpub.setDropEvery(s.cfg.DropKVEventsEvery)
	if err := s.kvpub.start(topic); err != nil {
		return err
	}
	s.log.Info("pdsim publishing KV events", "endpoint", s.cfg.KVEvents.Endpoint, "addr", s.KVEventsAddr(),
		"replay_addr", s.KVReplayAddr(), "topic", topic, "encoding", s.cfg.KVEvents.Encoding)
	return nil
}

// KVEventsAddr is the ip:port the KV event PUB socket is bound to ("" when
// it connects or there are no events), for a subscriber to dial. It stays
// the same across StopKVEvents and StartKVEvents.
func (s *Server) KVEventsAddr() string {
	if s.kvpub == nil || !s.kvpub.endpoint.bind {
		return ""
	}
	s.kvpub.mu.Lock()
	defer s.kvpub.mu.Unlock()
	return s.advertised(s.kvpub.addrs.pub)
}

// KVReplayAddr is the ip:port of the replay socket ("" without one).
func (s *Server) KVReplayAddr() string {
	if s.kvpub == nil {
		return ""
	}
	s.kvpub.mu.Lock()
	defer s.kvpub.mu.Unlock()
	return s.advertised(s.kvpub.addrs.replay)
}

func (s *Server) advertised(addr string) string {
	a, err := net.ResolveTCPAddr("tcp", addr)
	if addr == "" || err != nil {
		return addr
	}
	return advertise(a, s.cfg.AdvertiseHost)
}

// StopKVEvents closes the KV event sockets, as if the publisher died while
// the engine goes on serving: subscribers lose the connection and hear
// nothing more. The cache's changes from now on still take sequence numbers
// and go to the replay buffer, but are never sent, even after StartKVEvents.
func (s *Server) StopKVEvents() {
	if s.kvpub != nil {
		s.kvpub.closeSockets()
	}
}

// StartKVEvents opens the sockets StopKVEvents closed, at the same
// addresses; the next batch's sequence number shows subscribers what they
// missed, which the replay socket still holds.
func (s *Server) StartKVEvents() error {
	if s.kvpub == nil {
		return fmt.Errorf("pdsim: no KV events configured")
	}
	return s.kvpub.open()
}

// KVEventsStats counts the batches of KV events, for tests.
type KVEventsStats struct {
	Sent       uint64 // handed to the PUB socket (a subscriber's full queue may still drop one)
	Dropped    uint64 // not sent by Faults.DropKVEventsEvery, kept for replay
	Unsent     uint64 // not sent while stopped (StopKVEvents), kept for replay
	Overflowed uint64 // lost in a full queue, not even kept for replay
	// Subscribers are the connected subscribers to the topic.
	Subscribers int
}

// KVEventsStats is what the publisher has done so far.
func (s *Server) KVEventsStats() KVEventsStats {
	p := s.kvpub
	if p == nil {
		return KVEventsStats{}
	}
	st := KVEventsStats{Sent: p.counts.sent.Load(), Dropped: p.counts.dropped.Load(), Unsent: p.counts.unsent.Load(), Overflowed: p.counts.overflowed.Load()}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pub != nil {
		st.Subscribers = p.pub.subscribers(string(p.topic))
	}
	return st
}
