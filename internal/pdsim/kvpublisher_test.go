package pdsim

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

func TestParseEndpoint(t *testing.T) {
	tests := []struct {
		endpoint string
		want     zmqEndpoint
		err      bool
	}{
		{"tcp://*:5557", zmqEndpoint{":5557", true}, false},
		{"tcp://[::]:5557", zmqEndpoint{"[::]:5557", true}, false},
		{"tcp://10.0.0.1:5557", zmqEndpoint{"10.0.0.1:5557", false}, false},
		{"tcp://router.example:5557", zmqEndpoint{"router.example:5557", false}, false},
		{"tcp://127.0.0.1:0", zmqEndpoint{"127.0.0.1:0", true}, false},
		{"ipc:///tmp/kv", zmqEndpoint{}, true},
		{"tcp://nowhere", zmqEndpoint{}, true},
		{"127.0.0.1:5557", zmqEndpoint{}, true},
	}
	for _, tt := range tests {
		got, err := parseEndpoint(tt.endpoint)
		if got != tt.want || (err != nil) != tt.err {
			t.Errorf("%q: %+v, %v; want %+v, error %v", tt.endpoint, got, err, tt.want, tt.err)
		}
	}
}

// ask sends a chat request of distinct words and returns its tokens.
func ask(t *testing.T, s *Server, name string) []uint64 {
	t.Helper()
	body := chatOf("", turn{"user", words(name, 20)}) // 21 tokens: 1 full block
	if r := post(t, s, "/v1/chat/completions", body, ""); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	return tokenIDs(t, s, body)
}

// wantStored checks msg is seq with the BlockStored of tokens' first block.
func wantStored(t *testing.T, msg kvMessage, seq uint64, tokens []uint64) {
	t.Helper()
	want := []wireEvent{stored(tokens, 0, 1, false)}
	if got := decodeBatch(t, msg.payload, KVEncodingMap, false); msg.seq != seq || !reflect.DeepEqual(got, want) {
		t.Errorf("seq %d: %+v; want seq %d: %+v", msg.seq, got, seq, want)
	}
}

// Faults.DropKVEventsEvery leaves a batch unsent: the subscriber sees the
// sequence numbers jump, and the replay socket fills the gap.
func TestKVEventsGapAndReplay(t *testing.T) {
	d := start(t, Config{Role: RoleDecode, DropKVEventsEvery: 2,
		KVEvents: KVEvents{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}})
	sub := subscribeKV(t, d)
	a, b, c := ask(t, d, "a"), ask(t, d, "b"), ask(t, d, "c")
	first, third := sub.next(t), sub.next(t)
	wantStored(t, first, 0, a)
	wantStored(t, third, 2, c) // 1 was dropped
	if st := d.KVEventsStats(); st.Sent != 2 || st.Dropped != 1 || st.Unsent != 0 || st.Overflowed != 0 {
		t.Errorf("stats %+v: want 2 sent, 1 dropped", st)
	}

	got := replayKV(t, d.KVReplayAddr(), 1)
	if len(got) != 2 {
		t.Fatalf("replay from 1: %d batches, want 1 and 2", len(got))
	}
	wantStored(t, got[0], 1, b)
	if got[0].topic != first.topic {
		t.Errorf("replayed under topic %q, sent under %q", got[0].topic, first.topic)
	}
	if got[1].seq != 2 || !bytes.Equal(got[1].payload, third.payload) {
		t.Errorf("replayed batch %d differs from the one sent", got[1].seq)
	}
	if got := replayKV(t, d.KVReplayAddr(), 3); len(got) != 0 {
		t.Errorf("replay from the next seq: %d batches, want only the end", len(got))
	}

	d.SetFaults(Faults{}) // counts from the change, and 0 drops none
	tokens := ask(t, d, "d")
	wantStored(t, sub.next(t), 3, tokens)
}

// An engine connects to the router's bound SUB socket (vLLM with a host in
// its endpoint), and redials it after StartKVEvents; what it cached while
// stopped is a gap the replay socket fills.
func TestKVEventsConnectStopAndStart(t *testing.T) {
	sub, endpoint := bindKVSub(t)
	d := start(t, Config{Role: RoleDecode,
		KVEvents: KVEvents{Endpoint: endpoint, ReplayEndpoint: "tcp://" + reboundAddr(t), Topic: "kv@engine-a:8000@pdsim"}})
	if d.KVEventsAddr() != "" || d.KVReplayAddr() == "" {
		t.Errorf("KVEventsAddr %q, KVReplayAddr %q: want none bound, a replay socket", d.KVEventsAddr(), d.KVReplayAddr())
	}
	waitSubscribed(t, d, 1)
	a := ask(t, d, "a")
	if msg := sub.next(t); msg.topic != "kv@engine-a:8000@pdsim" {
		t.Errorf("topic %q", msg.topic)
	} else {
		wantStored(t, msg, 0, a)
	}

	d.StopKVEvents()
	waitSubscribed(t, d, 0)
	b := ask(t, d, "b")
	if st := d.KVEventsStats(); st.Unsent != 1 {
		t.Errorf("stats %+v: want 1 unsent while stopped", st)
	}

	if err := d.StartKVEvents(); err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, d, 1)
	c := ask(t, d, "c")
	wantStored(t, sub.next(t), 2, c)
	if got := replayKV(t, d.KVReplayAddr(), 1); len(got) != 2 || got[0].seq != 1 {
		t.Fatalf("replay from 1: %d batches, want 1 and 2", len(got))
	} else {
		wantStored(t, got[0], 1, b)
	}
}

func TestKVEventsConfig(t *testing.T) {
	for _, kv := range []KVEvents{
		{Endpoint: "tcp://127.0.0.1:0", Encoding: "json"},
		{Endpoint: "udp://127.0.0.1:0"},
		{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "nowhere"},
	} {
		if s, err := Start(Config{KVEvents: kv}); err == nil {
			s.Close()
			t.Errorf("%+v accepted", kv)
		}
	}
	d := start(t, Config{})
	if d.KVEventsAddr() != "" || d.KVReplayAddr() != "" || d.StartKVEvents() == nil || d.KVEventsStats() != (KVEventsStats{}) {
		t.Error("an engine without KV events has no addresses, stats, nor publisher to start")
	}
	d.StopKVEvents() // no-op
}

// reboundAddr is a loopback address free now on a port below the range
// Linux gives connections their local ports from (ip_local_port_range,
// 32768-60999 by default), for a socket the test closes and binds again:
// the connections that other tests (and other packages' tests, run at once)
// open took such a port between the close and the bind.
func reboundAddr(t *testing.T) string {
	t.Helper()
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			low, _ = strconv.Atoi(f[0])
		}
	}
	if low < 2048 {
		t.Skipf("ip_local_port_range starts at %d: no port is safe from other connections", low)
	}
	for range 100 {
		addr := fmt.Sprintf("127.0.0.1:%d", low/2+rand.IntN(low/2))
		if l, err := net.Listen("tcp", addr); err == nil {
			l.Close()
			return addr
		}
	}
	t.Fatal("no free port below the ephemeral range")
	return ""
}
