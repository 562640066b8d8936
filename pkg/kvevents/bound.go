package kvevents

import (
	"context"
	"errors"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
)

// runBound listens for publishers that connect, each naming its endpoint in
// its topic. Each endpoint's batches are handled in order by a goroutine of
// its own (engine), so that one waiting on its replay socket holds up no
// other's.
func (s *Subscriber) runBound(ctx context.Context, endpoints func() ([]string, <-chan struct{})) {
	var (
		mu      sync.Mutex
		known   map[string]bool
		engines = map[string]*engine{}
		wg      sync.WaitGroup
	)
	defer wg.Wait()
	wg.Go(func() {
		for {
			addrs, changed := endpoints()
			mu.Lock()
			known = map[string]bool{}
			for _, a := range addrs {
				known[a] = true
			}
			var leaving []*engine
			for a, e := range engines {
				if !known[a] {
					delete(engines, a)
					leaving = append(leaving, e)
				}
			}
			mu.Unlock()
			// Forgotten once its goroutine is done, so that a batch it is
			// applying (or a replay it is asking for) cannot bring it back.
			for _, e := range leaving {
				e.stop()
				s.index.Forget(e.pub)
			}
			select {
			case <-ctx.Done():
				return
			case <-changed:
			}
		}
	})
	for ctx.Err() == nil {
		if err := s.listen(ctx, func(frames [][]byte) {
			endpoint, ok := topicEndpoint(frames)
			mu.Lock()
			defer mu.Unlock()
			if !ok || !known[endpoint] {
				s.counts.UnknownTopics.Add(1)
				return
			}
			e := engines[endpoint]
			if e == nil {
				e = s.startEngine(ctx, &wg, Publisher{Endpoint: endpoint})
				engines[endpoint] = e
			}
			e.hold(frames, s.cfg.MaxMessageBytes)
		}); err != nil && ctx.Err() == nil {
			s.log.Info("kv events: listening", "address", s.cfg.Bind, "error", err.Error())
			if !sleep(ctx, time.Second) {
				return
			}
		}
	}
}

// engine is one endpoint's stream in bind mode, and its batches that wait
// for its goroutine (drain).
type engine struct {
	stream
	stop func() // ends the goroutine and waits for its end

	mu    sync.Mutex
	queue [][][]byte
	bytes int  // the queue's, as the transport counts a message's
	lost  bool // batches before the queue's first were dropped
	// giveUp ends the replay of the batch being handled, if any.
	giveUp context.CancelFunc
	wake   chan struct{}
}

// startEngine starts following p's stream; ctx's end stops it.
func (s *Subscriber) startEngine(ctx context.Context, wg *sync.WaitGroup, p Publisher) *engine {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	e := &engine{stream: stream{pub: p, next: -1}, stop: func() { cancel(); <-done }, giveUp: func() {}, wake: make(chan struct{}, 1)}
	s.index.Reset(p, true) // an empty view: it can only find less than is cached
	wg.Go(func() { defer close(done); s.drain(ctx, e) })
	return e
}

// hold queues msg for e's goroutine. The queue holds at most bound bytes
// (max_message_bytes), the most one message may take: an engine waiting on
// its replay holds at most that again besides what its connection may,
// however long the replay and fast the engine. Past it, e's goroutine is
// stuck on a replay (or far behind): the replay is given up and the batches
// held dropped, a stretch lost, which the next batch finds as a gap not to
// replay (drain).
func (e *engine) hold(msg [][]byte, bound int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := cost(msg)
	if e.bytes+n > bound {
		e.giveUp()
		clear(e.queue)
		e.queue, e.bytes, e.lost = e.queue[:0], 0, true
	}
	e.queue = append(e.queue, msg)
	e.bytes += n
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// drain handles e's batches in order until ctx is done.
func (s *Subscriber) drain(ctx context.Context, e *engine) {
	for ctx.Err() == nil {
		e.mu.Lock()
		if len(e.queue) == 0 {
			e.mu.Unlock()
			select {
			case <-ctx.Done():
			case <-e.wake:
			}
			continue
		}
		msg := e.queue[0]
		e.queue[0] = nil // not kept by the queue's array
		e.queue, e.bytes = e.queue[1:], e.bytes-cost(msg)
		hctx, giveUp := context.WithCancel(ctx)
		if e.lost { // handled as a gap whose replay failed: Gaps, ReplayFailed, Rebuild
			giveUp()
			e.lost = false
		}
		e.giveUp = giveUp
		e.mu.Unlock()
		s.handle(hctx, &e.stream, msg)
		giveUp()
	}
}

// cost is what msg takes, as the transport counts it (frameGuard).
func cost(msg [][]byte) int {
	n := 0
	for _, f := range msg {
		n += len(f) + frameCost
	}
	return n
}

func (s *Subscriber) listen(ctx context.Context, handle func([][]byte)) error {
	sub := zmq4.NewSub(s.bounded(ctx))
	defer closeDrained(sub)
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		return err
	}
	if err := sub.Listen(boundedAddr(s.cfg.Bind)); err != nil {
		return err
	}
	failed := 0 // Recv fails each time one of the publishers' connections drops: the others go on
	for failed < maxRecvFailures {
		msg, err := sub.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			failed++
			continue
		}
		failed = 0
		handle(msg.Frames)
	}
	return errors.New("the socket keeps failing")
}

// maxRecvFailures in a row make a listening socket start anew.
const maxRecvFailures = 100

// topicEndpoint reads the endpoint of a topic kv@<ip>:<port>@<model>, in the
// one spelling of its IP that the pool's endpoints have. An IPv6 address may
// come unbracketed: kv@$(POD_IP):8000@... is so on an IPv6 pod.
func topicEndpoint(frames [][]byte) (string, bool) {
	if len(frames) != 3 {
		return "", false
	}
	rest, ok := strings.CutPrefix(string(frames[0]), "kv@")
	if !ok {
		return "", false
	}
	endpoint, _, _ := strings.Cut(rest, "@")
	i := strings.LastIndexByte(endpoint, ':')
	if i < 0 {
		return "", false
	}
	ip, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(endpoint[:i], "["), "]"))
	port, perr := strconv.ParseUint(endpoint[i+1:], 10, 16)
	if err != nil || perr != nil || ip.Zone() != "" {
		return "", false
	}
	return netip.AddrPortFrom(ip.Unmap(), uint16(port)).String(), true
}
