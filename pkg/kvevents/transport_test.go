package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/go-logr/logr"
)

// TestSubscriberDropsAMessageOverItsBound: a message longer than
// max_message_bytes drops the connection before the ZeroMQ library makes a
// buffer for it. A peer whose header claims 2⁶² bytes (which the library
// would try to allocate) is hung up on, and a publisher's batch over the
// bound is not indexed; the stream goes on after it. Each is counted.
func TestSubscriberDropsAMessageOverItsBound(t *testing.T) {
	t.Run("a header claiming 2⁶² bytes", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		_, s, _ := followWith(t, Config{ConnectPort: l.Addr().(*net.TCPAddr).Port, StaleAfter: time.Minute})
		c, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		handshake(t, c)
		if _, err := c.Write([]byte{0x02, 0x40, 0, 0, 0, 0, 0, 0, 0}); err != nil { // a long frame of 2⁶²
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil { // the subscription, then EOF
			t.Errorf("the subscriber did not hang up: %v", err)
		}
		if got := s.Counts().TooLarge.Load(); got != 1 {
			t.Errorf("%d messages counted too large, want 1", got)
		}
	})
	t.Run("a batch over the bound", func(t *testing.T) {
		p := newTestPublisher(t, t.Context(), "", false)
		x, s, handled := followWith(t, Config{ConnectPort: p.port(), StaleAfter: time.Minute, MaxMessageBytes: 4096})
		warm(t, p, handled)
		big := make([]int64, 1024) // 5 bytes each in msgpack: a batch of 5 KiB
		for i := range big {
			big[i] = 100_000 + int64(i)
		}
		over := p.publish(false, map[string]any{"type": "BlockStored", "block_hashes": []uint64{7}, "parent_block_hash": nil,
			"token_ids": big, "block_size": 1024, "medium": "GPU"})
		deadline := time.After(10 * time.Second)
		for after := false; !after; { // the subscriber dials again: batches published since reach it
			seq := p.publish(false)
			select {
			case got := <-handled:
				if got == over {
					t.Fatalf("batch %d, over the bound, was handled", over)
				}
				after = got > over
			case <-time.After(50 * time.Millisecond):
			case <-deadline:
				t.Fatalf("no batch after %d was handled (last sent %d)", over, seq)
			}
		}
		if n, _ := held(x, endpoint, big); n != 0 {
			t.Errorf("%d tokens of the batch over the bound are held", n)
		}
		if got := s.Counts().TooLarge.Load(); got != 1 {
			t.Errorf("%d messages counted too large, want 1", got)
		}
	})
}

// handshake answers a ZeroMQ SUB's connection as a PUB would (ZMTP 3.0,
// NULL mechanism): greeting, then READY, reading the peer's.
func handshake(t *testing.T, c net.Conn) {
	t.Helper()
	greeting := make([]byte, greetingLen)
	greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
	copy(greeting[12:], "NULL")
	if _, err := c.Write(greeting); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, greetingLen)); err != nil {
		t.Fatal(err)
	}
	var ready bytes.Buffer
	ready.WriteString("\x05READY\x0bSocket-Type")
	ready.Write(binary.BigEndian.AppendUint32(nil, 3))
	ready.WriteString("PUB")
	if _, err := c.Write(append([]byte{0x04, byte(ready.Len())}, ready.Bytes()...)); err != nil { // a short command
		t.Fatal(err)
	}
	head := make([]byte, 2)
	if _, err := io.ReadFull(c, head); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, head[1])); err != nil {
		t.Fatal(err)
	}
}

// TestFrameGuardFollowsTheFraming: read a byte at a time, so that every
// header is split across reads, a stream passes whole while its frames are
// within the bound, and fails at the last byte of the first header over it:
// the size is never passed on whole.
func TestFrameGuardFollowsTheFraming(t *testing.T) {
	greeting := bytes.Repeat([]byte{0x02}, greetingLen) // the LONG flag's bit: to be passed as greeting
	long := func(n uint64) []byte {
		return append(binary.BigEndian.AppendUint64([]byte{0x02}, n), bytes.Repeat([]byte{0x02}, int(min(n, 1000)))...)
	}
	tests := []struct {
		name   string
		frames [][]byte
		passed int // bytes passed before the error; -1: the whole stream, no error
	}{
		{"short frames", [][]byte{{0x04, 3, 'a', 'b', 'c'}, {0x01, 0}, {0x00, 1, 0x02}}, -1},
		{"a long frame at the bound", [][]byte{{0x00, 1, 'x'}, long(1000 - frameCost)}, -1},
		{"a long frame over the bound", [][]byte{{0x00, 1, 'x'}, long(1001 - frameCost), {0x00, 0}}, greetingLen + 3 + 8},
		{"a long frame of 2⁶²", [][]byte{long(1 << 62)}, greetingLen + 8},
		{"many messages within the bound", slices.Repeat([][]byte{{0x01, 0}, {0x01, 0}, append([]byte{0x00, 200}, make([]byte, 200)...)}, 100), -1},
		{"a message of many empty frames", slices.Repeat([][]byte{{0x01, 0}}, 100), greetingLen + 2*31 + 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stream := bytes.Join(append([][]byte{greeting}, tt.frames...), nil)
			g := &frameGuard{Conn: cutConn{r: bytes.NewReader(stream)}, max: 1000, body: greetingLen}
			got, err := io.ReadAll(g)
			if tt.passed < 0 && (err != nil || !bytes.Equal(got, stream)) {
				t.Errorf("read %d of %d bytes, error %v", len(got), len(stream), err)
			}
			if tt.passed >= 0 && (err == nil || len(got) != tt.passed) {
				t.Errorf("read %d bytes, error %v; want an error after %d", len(got), err, tt.passed)
			}
		})
	}
}

// FuzzFrameGuard: however the stream is cut into reads, the guard passes
// what a parse of the whole stream says: all of it when every message is
// within the bound; else an error, and never the byte that completes the
// first header over it (the read that brings it is refused whole).
func FuzzFrameGuard(f *testing.F) {
	f.Add([]byte{0x01, 0, 0x00, 3, 'a', 'b', 'c', 0x02, 0, 0, 0, 0, 0, 0, 1, 0}, []byte{1, 2, 3})
	f.Add([]byte{0x02, 0x40, 0, 0, 0, 0, 0, 0, 0}, []byte{9})
	f.Fuzz(func(t *testing.T, frames, cuts []byte) {
		const max = 300
		stream := append(bytes.Repeat([]byte{0x02}, greetingLen), frames...)
		want, ok := len(stream), true
		for i, msg := greetingLen, uint64(0); i < len(stream); {
			head := 2
			if stream[i]&long != 0 {
				head = 9
			}
			if i+head > len(stream) {
				break
			}
			size := uint64(stream[i+1])
			if head == 9 {
				size = binary.BigEndian.Uint64(stream[i+1 : i+9])
			}
			if size > max || msg+size+frameCost > max {
				want, ok = i+head-1, false
				break
			}
			msg += size + frameCost
			if stream[i]&more == 0 {
				msg = 0
			}
			i += head + int(min(size, uint64(len(stream))))
		}
		g := &frameGuard{Conn: cutConn{bytes.NewReader(stream), cuts}, max: max, body: greetingLen}
		got, err := io.ReadAll(g)
		if (err == nil) != ok || ok && len(got) != want || len(got) > want || !bytes.Equal(got, stream[:len(got)]) {
			t.Errorf("passed %d bytes, error %v; want %d (at most, with an error: %v)", len(got), err, want, !ok)
		}
	})
}

// cutConn reads in the lengths cuts gives in turn (0 as 1), a byte at a
// time without cuts.
type cutConn struct {
	r    *bytes.Reader
	cuts []byte
}

func (c cutConn) Read(p []byte) (int, error) {
	n := 1
	if len(c.cuts) > 0 {
		n = max(1, int(c.cuts[c.r.Len()%len(c.cuts)]))
	}
	return c.r.Read(p[:min(len(p), n)])
}
func (cutConn) Write(p []byte) (int, error)      { return len(p), nil }
func (cutConn) Close() error                     { return nil }
func (cutConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (cutConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (cutConn) SetDeadline(time.Time) error      { return nil }
func (cutConn) SetReadDeadline(time.Time) error  { return nil }
func (cutConn) SetWriteDeadline(time.Time) error { return nil }

// TestASilentPeerHoldsNothing: a peer that connects and never greets (a
// frozen container, a port scanner) is given up after the handshake bound.
// Dialed, it neither holds the subscriber's dial, which tries again and
// stops when asked; bound, it does not keep the publishers that connect
// after it from being heard.
func TestASilentPeerHoldsNothing(t *testing.T) {
	const handshake = 100 * time.Millisecond
	t.Run("dialed", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		accepted := make(chan net.Conn, 10)
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted <- c // and never a byte
			}
		}()
		ctx, cancel := context.WithCancel(t.Context())
		s := NewSubscriber(Config{ConnectPort: l.Addr().(*net.TCPAddr).Port, StaleAfter: time.Minute, Handshake: handshake},
			NewIndex(Bounds{}, time.Minute, nil), logr.Discard())
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.Run(ctx, func() ([]string, <-chan struct{}) { return []string{endpoint}, ctx.Done() })
		}()
		for i := range 2 { // the second: the first dial gave up
			select {
			case c := <-accepted:
				defer c.Close()
			case <-time.After(10 * time.Second):
				t.Fatalf("connection %d did not come", i+1)
			}
		}
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("the subscriber did not stop")
		}
	})
	t.Run("bound", func(t *testing.T) {
		port := freePort(t)
		_, _, handled := followWith(t, Config{Bind: "tcp://127.0.0.1:" + strconv.Itoa(port), Handshake: handshake}, "10.0.0.1:8000")
		var silent net.Conn
		eventually(t, "the subscriber listening", func() bool {
			c, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port))
			silent = c
			return err == nil
		})
		defer silent.Close()
		p := newTestPublisher(t, t.Context(), "tcp://127.0.0.1:"+strconv.Itoa(port), false)
		p.topic = "kv@10.0.0.1:8000@pdsim"
		warm(t, p, handled)
	})
}

// TestTheHandshakeDeadlineEndsWithTheFirstFrame: the deadline guard sets on
// a connection stands until the greeting and the peer's READY have passed,
// and is then lifted: a publisher may be quiet for as long as it likes.
func TestTheHandshakeDeadlineEndsWithTheFirstFrame(t *testing.T) {
	ready := append([]byte{0x04, 6}, "\x05READY"...)
	stream := slices.Concat(bytes.Repeat([]byte{0x02}, greetingLen), ready, []byte{0x00, 1, 'x'})
	c := &deadlineConn{cutConn: cutConn{r: bytes.NewReader(stream)}}
	g := guard(withMessageBound(t.Context(), messageBound{handshake: time.Minute}), c)
	for read := 0; read < len(stream); read++ {
		if set := !c.deadline.IsZero(); set != (read < greetingLen+len(ready)) {
			t.Fatalf("after %d bytes the deadline is set: %v", read, set)
		}
		if _, err := g.Read(make([]byte, 1)); err != nil {
			t.Fatal(err)
		}
	}
}

// deadlineConn keeps the deadline last set.
type deadlineConn struct {
	cutConn
	deadline time.Time
}

func (c *deadlineConn) SetDeadline(d time.Time) error { c.deadline = d; return nil }

// TestAConnectionEndsWithItsSocket: a connection ends when its socket's
// context does. zmq4 may finish a handshake after the socket closed and
// keep the connection on it, read by no one: an engine connected to a
// bound subscriber that had just stopped stayed connected to nothing, and
// never reconnected.
func TestAConnectionEndsWithItsSocket(t *testing.T) {
	ctx, closed := context.WithCancel(t.Context())
	ours, peer := net.Pipe()
	defer peer.Close()
	guard(ctx, ours)
	closed()
	peer.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := peer.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the peer reads %v; want EOF: the connection outlived its socket", err)
	}
}
