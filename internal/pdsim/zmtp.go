package pdsim

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// The ZeroMQ sockets of the KV event publisher, over zmq4's ZMTP
// connections (zmq4.Open) rather than its sockets: zmq4's PUB socket
// leaves a goroutine behind when closed and writes to every subscriber from
// one goroutine, so one stalled subscriber would stall them all. Here each
// subscriber has its own queue that drops when full, as libzmq's high-water
// mark does, and a connecting publisher redials until it is closed.

// zmqEndpoint is a tcp:// endpoint and whether it is bound or dialled.
type zmqEndpoint struct {
	addr string // host:port
	bind bool
}

// parseEndpoint reads an endpoint as vLLM's ZmqEventPublisher does: bound
// when it has a "*" or "::", else connected to. A port of 0 (pick a free
// one) binds too, since nothing can be dialled there.
func parseEndpoint(ep string) (zmqEndpoint, error) {
	hostPort, ok := strings.CutPrefix(ep, "tcp://")
	host, port, err := net.SplitHostPort(hostPort)
	if !ok || err != nil {
		return zmqEndpoint{}, fmt.Errorf("%q: want tcp://host:port", ep)
	}
	bind := strings.Contains(ep, "*") || strings.Contains(ep, "::") || port == "0"
	if host == "*" {
		host = ""
	}
	return zmqEndpoint{net.JoinHostPort(host, port), bind}, nil
}

// redialEvery is how soon a connecting socket dials again, libzmq's
// default ZMQ_RECONNECT_IVL.
const redialEvery = 100 * time.Millisecond

// zmtpPeers runs one socket's connections: each is opened as a ZMTP
// connection of socket type typ and served by serve until it ends or the
// socket closes.
type zmtpPeers struct {
	ctx    context.Context
	cancel context.CancelFunc
	typ    zmq4.SocketType
	serve  func(*zmq4.Conn)
	wg     sync.WaitGroup
	addr   net.Addr // the bound address, nil when dialling
}

func newPeers(typ zmq4.SocketType, serve func(*zmq4.Conn)) *zmtpPeers {
	ctx, cancel := context.WithCancel(context.Background())
	return &zmtpPeers{ctx: ctx, cancel: cancel, typ: typ, serve: serve}
}

// listen binds addr and accepts peers in the background.
func (p *zmtpPeers) listen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	p.addr = ln.Addr()
	context.AfterFunc(p.ctx, func() { ln.Close() })
	p.wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				if wait(p.ctx, redialEvery) != nil {
					return
				}
				continue
			}
			p.wg.Go(func() { p.open(conn, true) })
		}
	})
	return nil
}

// dial connects to addr in the background, and again whenever the
// connection ends, until the socket closes.
func (p *zmtpPeers) dial(addr string) {
	p.wg.Go(func() {
		var d net.Dialer
		for p.ctx.Err() == nil {
			if conn, err := d.DialContext(p.ctx, "tcp", addr); err == nil {
				p.open(conn, false)
			}
			wait(p.ctx, redialEvery)
		}
	})
}

func (p *zmtpPeers) open(conn net.Conn, server bool) {
	stop := context.AfterFunc(p.ctx, func() { conn.Close() })
	defer stop()
	defer conn.Close()
	zc, err := zmq4.Open(conn, null.Security(), p.typ, nil, server, nil)
	if err != nil {
		return
	}
	p.serve(zc)
}

// close ends every connection and returns once their goroutines have.
func (p *zmtpPeers) close() {
	p.cancel()
	p.wg.Wait()
}

// pubSocket sends messages to the subscribers whose subscriptions start
// their first frame (the topic).
type pubSocket struct {
	*zmtpPeers
	mu   sync.Mutex
	subs map[*subscriber]bool
}

type subscriber struct {
	mu     sync.Mutex
	topics map[string]bool // subscribed prefixes
	out    chan zmq4.Msg
}

// subscriberHWM is how many messages wait for one subscriber before the
// next ones are dropped for it.
const subscriberHWM = 10_000

func newPubSocket() *pubSocket {
	p := &pubSocket{subs: map[*subscriber]bool{}}
	p.zmtpPeers = newPeers(zmq4.Pub, p.serveSubscriber)
	return p
}

// send queues msg for each subscriber to its topic; it never blocks.
func (p *pubSocket) send(msg zmq4.Msg) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for s := range p.subs {
		if s.wants(string(msg.Frames[0])) {
			select {
			case s.out <- msg:
			default:
			}
		}
	}
}

// subscribers counts the subscribers to topic.
func (p *pubSocket) subscribers(topic string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for s := range p.subs {
		if s.wants(topic) {
			n++
		}
	}
	return n
}

// serveSubscriber reads a subscriber's (un)subscriptions, single frames
// starting with 1 or 0, while another goroutine writes it its messages.
func (p *pubSocket) serveSubscriber(zc *zmq4.Conn) {
	s := &subscriber{topics: map[string]bool{}, out: make(chan zmq4.Msg, subscriberHWM)}
	p.mu.Lock()
	p.subs[s] = true
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.subs, s)
		p.mu.Unlock()
	}()

	done := make(chan struct{})
	var writer sync.WaitGroup
	writer.Go(func() {
		for {
			select {
			case msg := <-s.out:
				if zc.SendMsg(msg) != nil {
					zc.Close() // the reader below ends too
					return
				}
			case <-done:
				return
			}
		}
	})
	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			break
		}
		if len(msg.Frames) == 1 && len(msg.Frames[0]) > 0 && msg.Frames[0][0] <= 1 {
			s.mu.Lock()
			s.topics[string(msg.Frames[0][1:])] = msg.Frames[0][0] == 1
			s.mu.Unlock()
		}
	}
	close(done)
	writer.Wait()
}

func (s *subscriber) wants(topic string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for prefix, on := range s.topics {
		if on && strings.HasPrefix(topic, prefix) {
			return true
		}
	}
	return false
}
