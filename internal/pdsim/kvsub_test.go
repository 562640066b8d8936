package pdsim

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// A subscriber to a pdsim's KV events as a router runs one: a zmq4 SUB
// socket, its messages decoded with msgpack into generic values, so the
// layout is checked here against vLLM's, not against pdsim's own encoder.

const waitFor = 5 * time.Second

type kvSub struct {
	sock zmq4.Socket
	msgs chan zmq4.Msg
}

type kvMessage struct {
	topic   string
	seq     uint64
	payload []byte
}

// subscribeKV dials the engine's bound PUB socket and waits until the
// engine counts the subscription.
func subscribeKV(t *testing.T, s *Server) *kvSub {
	t.Helper()
	k := newKVSub(t)
	if err := k.sock.Dial("tcp://" + s.KVEventsAddr()); err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, s, 1)
	return k
}

// bindKVSub binds a SUB socket for an engine to connect to, and returns the
// endpoint to give the engine.
func bindKVSub(t *testing.T) (*kvSub, string) {
	t.Helper()
	k := newKVSub(t)
	if err := k.sock.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	return k, "tcp://" + k.sock.Addr().String()
}

func newKVSub(t *testing.T) *kvSub {
	t.Helper()
	k := &kvSub{sock: zmq4.NewSub(context.Background()), msgs: make(chan zmq4.Msg, 100)}
	if err := k.sock.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			msg, err := k.sock.Recv()
			if err != nil { // zmq4 also hands over a dropped connection's error: read on
				select {
				case <-done:
					return
				default:
					continue
				}
			}
			select {
			case k.msgs <- msg:
			case <-done:
				return
			}
		}
	})
	t.Cleanup(func() {
		close(done)
		k.sock.Close()
		wg.Wait()
	})
	return k
}

func (k *kvSub) next(t *testing.T) kvMessage {
	t.Helper()
	select {
	case msg := <-k.msgs:
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			t.Fatalf("message %q: want [topic, 8-byte seq, payload]", msg.Frames)
		}
		return kvMessage{string(msg.Frames[0]), binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2]}
	case <-time.After(waitFor):
		t.Fatal("no KV event message")
		return kvMessage{}
	}
}

// waitSubscribed polls until the engine has n subscribers to its topic.
func waitSubscribed(t *testing.T, s *Server, n int) {
	t.Helper()
	for deadline := time.Now().Add(waitFor); s.KVEventsStats().Subscribers != n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d subscribers, want %d", s.KVEventsStats().Subscribers, n)
		}
	}
}

// replayKV asks the replay socket at addr for the batches from seq on, as a
// DEALER: [empty, seq] out, [empty, topic, seq, payload]... and
// [empty, empty, -1, empty] back.
func replayKV(t *testing.T, addr string, from uint64) []kvMessage {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	d := zmq4.NewDealer(ctx)
	defer d.Close()
	if err := d.Dial("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, from))); err != nil {
		t.Fatal(err)
	}
	var out []kvMessage
	for {
		msg, err := d.Recv()
		if err != nil {
			t.Fatalf("replay from %d: %v after %d batches", from, err, len(out))
		}
		if len(msg.Frames) != 4 || len(msg.Frames[0]) != 0 || len(msg.Frames[2]) != 8 {
			t.Fatalf("replay answer %q: want [empty, topic, seq, payload]", msg.Frames)
		}
		if bytes.Equal(msg.Frames[2], bytes.Repeat([]byte{0xff}, 8)) && len(msg.Frames[1]) == 0 && len(msg.Frames[3]) == 0 {
			return out
		}
		out = append(out, kvMessage{string(msg.Frames[1]), binary.BigEndian.Uint64(msg.Frames[2]), msg.Frames[3]})
	}
}

// wireEvent is one decoded event, its hashes as hashKey writes them.
type wireEvent struct {
	Type   string
	Hashes []string
	Parent string // "" for none
	Tokens []uint64
}

// decodeBatch decodes a payload generically, checks it is laid out as vLLM
// lays out its encoding, and returns its events.
func decodeBatch(t *testing.T, payload []byte, encoding string, intHashes bool) []wireEvent {
	t.Helper()
	var batch any
	if err := msgpack.Unmarshal(payload, &batch); err != nil {
		t.Fatalf("payload %x: %v", payload, err)
	}
	fail := func(what string, v any) {
		t.Helper()
		t.Fatalf("%s %s: %#v", encoding, what, v)
	}
	var raw []any
	arrayEvents := encoding == KVEncodingArray
	if encoding != KVEncodingMap {
		b, ok := batch.([]any)
		if !ok || len(b) != 3 || !isFloat(b[0]) || !isInt(b[2], 0) {
			fail("batch, want [ts, events, 0]", batch)
		}
		raw, _ = b[1].([]any)
	} else {
		b, ok := batch.(map[string]any)
		if !ok || len(b) != 3 || !isFloat(b["ts"]) || !isInt(b["data_parallel_rank"], 0) {
			fail(`batch, want {"ts", "events", "data_parallel_rank": 0}`, batch)
		}
		raw, _ = b["events"].([]any)
	}
	var out []wireEvent
	for _, r := range raw {
		ev, fields := eventFields(t, r, arrayEvents)
		want := map[string]int{"BlockStored": 6, "BlockRemoved": 2, "AllBlocksCleared": 0}[ev.Type]
		if !arrayEvents && ev.Type == "BlockStored" {
			want = 10
		}
		if len(fields) != want {
			fail("event fields", r)
		}
		if ev.Type == "BlockRemoved" && fields["medium"] != "GPU" {
			fail("BlockRemoved", r)
		}
		if ev.Type != "BlockStored" && ev.Type != "BlockRemoved" {
			out = append(out, ev)
			continue
		}
		ev.Hashes = hashKeys(t, fields["block_hashes"], intHashes)
		if ev.Type == "BlockStored" {
			if fields["parent_block_hash"] != nil {
				ev.Parent = hashKeys(t, []any{fields["parent_block_hash"]}, intHashes)[0]
			}
			ev.Tokens = uints(t, fields["token_ids"])
			if !isInt(fields["block_size"], blockSize) || fields["lora_id"] != nil || fields["medium"] != "GPU" {
				fail("BlockStored", r)
			}
			if !arrayEvents {
				extra, _ := fields["extra_keys"].([]any)
				if fields["lora_name"] != nil || len(extra) != len(ev.Hashes) || extra[0] != nil ||
					!isInt(fields["group_idx"], 0) || fields["kv_cache_spec_kind"] != "full_attention" {
					fail("BlockStored", r)
				}
			}
		}
		out = append(out, ev)
	}
	return out
}

// eventFields is an event's tag and its fields by name: a map's own, or an
// array's by their position in vLLM's BlockStored and BlockRemoved.
func eventFields(t *testing.T, r any, array bool) (wireEvent, map[string]any) {
	t.Helper()
	if !array {
		m, ok := r.(map[string]any)
		typ, _ := m["type"].(string)
		if !ok || typ == "" {
			t.Fatalf("event %#v: want a map with a type", r)
		}
		delete(m, "type")
		return wireEvent{Type: typ}, m
	}
	a, ok := r.([]any)
	if !ok || len(a) == 0 {
		t.Fatalf("event %#v: want an array", r)
	}
	typ, _ := a[0].(string)
	names := map[string][]string{
		"BlockStored":  {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"},
		"BlockRemoved": {"block_hashes", "medium"},
	}[typ]
	if len(a)-1 != len(names) {
		t.Fatalf("event %#v: want [%q %v]", r, typ, names)
	}
	fields := map[string]any{}
	for i, name := range names {
		fields[name] = a[i+1]
	}
	return wireEvent{Type: typ}, fields
}

// hashKeys checks each hash is 32 bytes, or an int, and writes it as hex or
// in decimal.
func hashKeys(t *testing.T, v any, intHashes bool) []string {
	t.Helper()
	list, _ := v.([]any)
	out := make([]string, len(list))
	for i, h := range list {
		b, isBytes := h.([]byte)
		switch {
		case !intHashes && isBytes && len(b) == 32:
			out[i] = hex.EncodeToString(b)
		case intHashes && !isBytes:
			out[i] = fmt.Sprint(uints(t, []any{h})[0])
		default:
			t.Fatalf("block hash %#v: want %s", h, map[bool]string{false: "32 bytes", true: "an int"}[intHashes])
		}
	}
	return out
}

// wantHash is how the events carry a block hash pdsim computed.
func wantHash(h blockHash, intHashes bool) string {
	if intHashes {
		return fmt.Sprint(binary.BigEndian.Uint64(h[24:]))
	}
	return hex.EncodeToString(h[:])
}

func uints(t *testing.T, v any) []uint64 {
	t.Helper()
	list, _ := v.([]any)
	out := make([]uint64, len(list))
	for i, x := range list {
		n, ok := asUint(x)
		if !ok {
			t.Fatalf("%#v is no unsigned int", x)
		}
		out[i] = n
	}
	return out
}

// asUint reads any of the int types msgpack decodes to.
func asUint(v any) (uint64, bool) {
	r := reflect.ValueOf(v)
	switch r.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return uint64(r.Int()), r.Int() >= 0
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return r.Uint(), true
	}
	return 0, false
}

func isInt(v any, want uint64) bool {
	n, ok := asUint(v)
	return ok && n == want
}

func isFloat(v any) bool {
	_, ok := v.(float64)
	return ok
}
