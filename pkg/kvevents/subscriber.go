package kvevents

import (
	"context"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-zeromq/zmq4"
)

// Config is how a pool's engines publish their events.
type Config struct {
	// ConnectPort, when set, is the port each endpoint's host publishes on
	// (vLLM's tcp://*:5557): the subscriber dials every endpoint of the pool,
	// following it as endpoints come and go. Rank r of a data-parallel
	// engine publishes on ConnectPort+r.
	ConnectPort int
	// Bind, when set instead, is an address the subscriber listens on, that
	// the engines connect and publish to; each message's topic must name its
	// endpoint, kv@<ip>:<port>@<model>.
	Bind string
	// ReplayPort is the port of the engines' replay socket (vLLM's
	// replay_endpoint), asked for the batches a gap lost; 0: none.
	ReplayPort int
	// Ranks is the engines' data-parallel size (ConnectPort mode; 1 with Bind).
	Ranks int
	// StaleAfter bounds how long a view may go unconfirmed: one rebuilt after
	// a gap that could not be replayed is not used until it has followed its
	// stream this long, and one whose engine was sent work it had to store
	// but published nothing for this long is not used until it does.
	StaleAfter time.Duration
	// Resync is how long a connection may stay silent before it is made
	// anew (the ZeroMQ library can miss that a peer restarted, and then
	// delivers nothing); 0: never.
	Resync time.Duration
	// ReplayTimeout bounds one replay (0: 2 s).
	ReplayTimeout time.Duration
	// MaxMessageBytes bounds each message (its frames) read from a
	// publisher or a replay socket (transport.go); a longer one drops the
	// connection.
	MaxMessageBytes int
	// Handshake bounds the time a peer has to greet and say READY once
	// connected (transport.go; 0: 5 s).
	Handshake time.Duration
	// Counts are the totals to add to: a pool's, which outlive the
	// subscribers a reload replaces, so that its counters never go back;
	// nil: the subscriber's own.
	Counts *Counts
}

// Subscriber follows the engines' event streams into an Index.
type Subscriber struct {
	cfg   Config
	index *Index
	log   logr.Logger

	counts *Counts
	// handled, when set (by tests), is told of every message handled.
	handled func(p Publisher, seq int64)
}

// Counts are the subscriber's running totals, read by metrics.
type Counts struct {
	Batches, Gaps, Replayed, ReplayFailed, Restarts, UnknownTopics, Undecodable, TooLarge, Orphans, Skipped, UnknownEvents atomic.Int64
}

// NewSubscriber returns a subscriber that feeds index.
func NewSubscriber(cfg Config, index *Index, log logr.Logger) *Subscriber {
	if cfg.Ranks < 1 {
		cfg.Ranks = 1
	}
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = 2 * time.Second
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = defaultMaxMessage
	}
	s := &Subscriber{cfg: cfg, index: index, log: log, counts: cfg.Counts}
	if s.counts == nil {
		s.counts = new(Counts)
	}
	return s
}

// Counts are the totals the subscriber adds to (Config.Counts, or its own).
func (s *Subscriber) Counts() *Counts { return s.counts }

// bounded is ctx for a socket whose connections hang up on a message over
// MaxMessageBytes, counting each in TooLarge.
func (s *Subscriber) bounded(ctx context.Context) context.Context {
	return withMessageBound(ctx, messageBound{max: s.cfg.MaxMessageBytes, refused: func() { s.counts.TooLarge.Add(1) }, handshake: s.cfg.Handshake})
}

// Run follows the streams until ctx is done. endpoints returns the pool's
// endpoints now and a channel closed when they change.
func (s *Subscriber) Run(ctx context.Context, endpoints func() ([]string, <-chan struct{})) {
	if s.cfg.Bind != "" {
		s.runBound(ctx, endpoints)
		return
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	// following: each publisher's follower, and how to stop it and wait for
	// its end, so that a batch it is applying (or a replay it is asking for)
	// cannot bring back a view forgotten with its endpoint.
	following := map[Publisher]func(){}
	for {
		addrs, changed := endpoints()
		want := map[Publisher]bool{}
		for _, p := range publishers(addrs, s.cfg.Ranks) {
			want[p] = true
		}
		for p, stop := range following {
			if !want[p] {
				stop()
				delete(following, p)
				s.index.Forget(p)
			}
		}
		for p := range want {
			if following[p] == nil {
				pctx, stop := context.WithCancel(ctx)
				done := make(chan struct{})
				following[p] = func() { stop(); <-done }
				s.index.Reset(p, true) // an empty view: it can only find less than is cached
				wg.Go(func() { defer close(done); s.follow(pctx, p) })
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}

// publishers are the publishers of the endpoints' engines: every rank of an
// endpoint alone on its host (one server of ranks data-parallel ranks), and
// rank i alone of the endpoint on the i-th lowest port of its host (a server
// per rank, each on its own port, as an InferencePool's targetPorts expose
// them). Rank i publishes on ConnectPort + i (vLLM's offset_endpoint_port).
func publishers(addrs []string, ranks int) []Publisher {
	ports := map[string][]netip.AddrPort{} // by host, of the endpoints that parse
	for _, a := range addrs {
		if ap, err := netip.ParseAddrPort(a); err == nil {
			ports[ap.Addr().String()] = append(ports[ap.Addr().String()], ap)
		}
	}
	var out []Publisher
	for _, a := range addrs {
		ap, err := netip.ParseAddrPort(a)
		same := ports[ap.Addr().String()]
		if err != nil || len(same) == 1 {
			for r := range ranks {
				out = append(out, Publisher{a, r})
			}
			continue
		}
		rank := 0
		for _, o := range same {
			if o.Port() < ap.Port() {
				rank++
			}
		}
		out = append(out, Publisher{a, rank})
	}
	return out
}

// follow dials one publisher and reads its stream, dialing again after a
// failure and after Resync of silence.
func (s *Subscriber) follow(ctx context.Context, p Publisher) {
	host, _, err := net.SplitHostPort(p.Endpoint)
	if err != nil {
		s.log.Info("kv events: an endpoint without a host", "endpoint", p.Endpoint)
		return
	}
	addr := boundedAddr(net.JoinHostPort(host, strconv.Itoa(s.cfg.ConnectPort+p.Rank)))
	st := &stream{pub: p, next: -1}
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		if err := s.read(ctx, addr, st); err != nil && ctx.Err() == nil {
			s.log.V(1).Info("kv events: reading a publisher", "publisher", addr, "error", err.Error())
			if !sleep(ctx, backoff) {
				return
			}
			backoff = min(2*backoff, 5*time.Second)
			continue
		}
		backoff = 100 * time.Millisecond
	}
}

// read reads one connection to a publisher until it fails, ctx is done or
// it has been silent for Resync (nil then). A connection that delivers is
// kept: one made anew loses what is published while it joins (a PUB socket
// drops what no subscriber has joined for yet), which without a replay
// socket starts a busy engine's view over.
func (s *Subscriber) read(ctx context.Context, addr string, st *stream) error {
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sub := zmq4.NewSub(s.bounded(cctx), zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(time.Second))
	defer closeDrained(sub)
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		return err
	}
	if err := sub.Dial(addr); err != nil {
		return err
	}
	// What this connection has delivered: a batch numbered at or below the
	// last one (or below what was read before, on a connection made anew)
	// is from an engine that started over.
	st.live, st.ahead = -1, false
	s.catchUp(ctx, st)
	var quiet *time.Timer // fires after Resync without a message
	if s.cfg.Resync > 0 {
		quiet = time.AfterFunc(s.cfg.Resync, cancel)
		defer quiet.Stop()
	}
	for {
		msg, err := sub.Recv()
		if err != nil {
			if cctx.Err() != nil {
				return nil
			}
			return err
		}
		if quiet != nil {
			quiet.Reset(s.cfg.Resync)
		}
		s.handle(ctx, st, msg.Frames)
	}
}

// catchUp reads, once subscribed to a publisher not read before, what its
// engine cached before from its replay buffer, as far as it goes: what it
// publishes from now on is numbered after, and its first batches here may be
// some the replay gave already. A replay that gave nothing (an engine that
// has published nothing, a replay socket out of reach) leaves the stream
// unstarted: its first batch starts it, as without a replay socket, rather
// than reading as a gap after batch -1.
func (s *Subscriber) catchUp(ctx context.Context, st *stream) {
	if st.next >= 0 || s.cfg.ReplayPort == 0 {
		return
	}
	st.next, st.ahead = 0, true
	s.replayOrRebuild(ctx, st, untilEnd)
	if st.next == 0 {
		st.next, st.ahead = -1, false
	}
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
