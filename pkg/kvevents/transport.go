package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// The ZeroMQ library makes each frame's buffer as long as the frame's header
// says, up to 2⁶³-1 bytes, before it reads the frame (zmq4's Conn.read): one
// header from whatever answers on an event or replay port would exhaust the
// process's memory. So every socket here speaks "bounded+tcp", TCP whose
// connections read the ZMTP framing as it passes and fail the read that
// would hand the library a message longer than the socket's context allows
// (withMessageBound), before the library has seen the size that passes it.
const boundedTCP = "bounded+tcp"

func init() {
	if err := zmq4.RegisterTransport(boundedTCP, boundedTransport{transport.New("tcp")}); err != nil {
		panic(err)
	}
}

// defaultMaxMessage bounds a message when the socket's context sets no bound
// (config.DefaultKVEventsMaxMessage).
const defaultMaxMessage = 64 << 20

// boundedAddr is addr ("tcp://host:port", or "host:port") on the bounded transport.
func boundedAddr(addr string) string { return boundedTCP + "://" + strings.TrimPrefix(addr, "tcp://") }

// messageBound is what the sockets made with a context allow: max bytes a
// message (defaultMaxMessage when 0), refused, told of each connection hung
// up on, and handshake, the time a peer has to greet and say READY
// (defaultHandshake when 0).
type messageBound struct {
	max       int
	refused   func()
	handshake time.Duration
}

// defaultHandshake bounds a peer's handshake when the context sets no bound.
// zmq4 reads it with no deadline, in Dial and in its accept loop: a peer that
// connects and says nothing (a frozen container, a port scanner) would hold
// a subscriber's dial, or every later publisher's accept, for good.
const defaultHandshake = 5 * time.Second

type messageBoundKey struct{}

// withMessageBound gives the sockets made with ctx the bound b.
func withMessageBound(ctx context.Context, b messageBound) context.Context {
	return context.WithValue(ctx, messageBoundKey{}, b)
}

// guard wraps c in the bound of the sockets made with ctx.
func guard(ctx context.Context, c net.Conn) *frameGuard {
	b, _ := ctx.Value(messageBoundKey{}).(messageBound)
	if b.max <= 0 {
		b.max = defaultMaxMessage
	}
	if b.handshake <= 0 {
		b.handshake = defaultHandshake
	}
	c.SetDeadline(time.Now().Add(b.handshake))
	// The connection ends with its socket. zmq4 may finish a handshake after
	// the socket closed, and keep the connection open on it, read by no one:
	// a publisher connected to a bound socket would then never reconnect.
	stop := context.AfterFunc(ctx, func() { c.Close() })
	return &frameGuard{Conn: c, max: uint64(b.max), refused: b.refused, body: greetingLen, greeting: true, unhook: stop}
}

type boundedTransport struct{ transport.Transport }

func (t boundedTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.Transport.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return guard(ctx, c), nil
}

func (t boundedTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.Transport.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return guardedListener{l, ctx}, nil
}

type guardedListener struct {
	net.Listener
	ctx context.Context // the socket's, which carries its bound
}

func (l guardedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return guard(l.ctx, c), nil
}

// greetingLen is the ZMTP 3 greeting's length, which precedes the frames.
const greetingLen = 64

// frameGuard passes a ZMTP 3 stream through, following its framing: the
// greeting, then frames of a flags byte, a size (one byte, or eight big
// endian when the flags say long) and a body of that size. A message is its
// frames up to one without the MORE flag; the library holds them all, so
// the bound is on a message: its frames' sizes, and frameCost for each.
type frameGuard struct {
	net.Conn
	max  uint64
	body uint64  // bytes of the greeting or of a frame's body still to come
	head [9]byte // the current frame's flags and size, as far as read
	n    int     // bytes of head read
	msg  uint64  // the message's frames so far
	err  error

	refused func() // nil: none to tell
	// greeting: the handshake's deadline stands until the greeting and the
	// peer's first frame (its READY) have passed whole.
	greeting bool
	frames   int // headers read whole, while greeting
	// unhook stops closing the connection with its socket's context.
	unhook func() bool
}

func (g *frameGuard) Close() error {
	if g.unhook != nil {
		g.unhook()
	}
	return g.Conn.Close()
}

// frameCost is what the library keeps for a frame besides its body.
const frameCost = 32

func (g *frameGuard) Read(p []byte) (int, error) {
	if g.err != nil {
		return 0, g.err
	}
	n, err := g.Conn.Read(p)
	for b := p[:n]; len(b) > 0; {
		if g.body > 0 {
			k := min(g.body, uint64(len(b)))
			g.body -= k
			b = b[k:]
			continue
		}
		g.head[g.n] = b[0]
		g.n++
		b = b[1:]
		size, whole := g.size()
		if !whole {
			continue
		}
		if size > g.max || g.msg+size+frameCost > g.max {
			g.err = fmt.Errorf("kvevents: %s sent a message over the bound of %d bytes", g.RemoteAddr(), g.max)
			if g.refused != nil {
				g.refused() // before the peer can see the hang-up
			}
			g.Conn.Close()
			return 0, g.err
		}
		g.msg += size + frameCost
		if g.head[0]&more == 0 {
			g.msg = 0
		}
		g.body, g.n = size, 0
		if g.greeting {
			g.frames++
		}
	}
	if g.greeting && (g.frames > 1 || g.frames == 1 && g.body == 0) {
		g.greeting = false
		g.Conn.SetDeadline(time.Time{}) // greeted: from now on a peer may be quiet
	}
	return n, err
}

// ZMTP's frame flags.
const (
	more = 0x01
	long = 0x02
)

// size is the current frame's size, once its header is read whole.
func (g *frameGuard) size() (uint64, bool) {
	switch {
	case g.n < 2:
		return 0, false
	case g.head[0]&long == 0:
		return uint64(g.head[1]), true
	case g.n < 9:
		return 0, false
	}
	return binary.BigEndian.Uint64(g.head[1:]), true
}

// closeDrained closes sub and empties its queue. zmq4 (v0.17.0,
// qreader.listen in msgio.go) hands each message to a queue of ten with a
// send that nothing ends: a reader blocked on a full queue when the socket
// closes is stuck for good, with its connection's message. Taken from the
// queue after the close (which ends every connection, so nothing new comes),
// the last ones let it finish. A receive on the closed socket answers at
// once, with a queued message or the socket's end, whichever Go's select
// picks; so it is asked again, more often than the queue and the stuck
// readers' messages could take.
func closeDrained(sub zmq4.Socket) {
	sub.Close()
	for range 256 {
		sub.Recv()
	}
}
