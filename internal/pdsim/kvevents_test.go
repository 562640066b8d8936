package pdsim

import (
	"encoding/hex"
	"fmt"
	"reflect"
	"testing"
	"time"
)

// stored is the BlockStored pdsim should publish for blocks from..to of
// the prompt of tokens (its full blocks only), as the events carry hashes.
func stored(tokens []uint64, from, to int, intHashes bool) wireEvent {
	hs := blockHashes("pdsim", blockKeys{}, tokens)
	ev := wireEvent{Type: "BlockStored", Tokens: tokens[from*blockSize : to*blockSize]}
	for _, h := range hs[from:to] {
		ev.Hashes = append(ev.Hashes, wantHash(h, intHashes))
	}
	if from > 0 {
		ev.Parent = wantHash(hs[from-1], intHashes)
	}
	return ev
}

func removed(tokens []uint64, block int, intHashes bool) wireEvent {
	return wireEvent{Type: "BlockRemoved", Hashes: []string{wantHash(blockHashes("pdsim", blockKeys{}, tokens)[block], intHashes)}}
}

// A conversation on an engine whose cache holds 3 blocks, in each encoding
// and hash kind: what each request newly caches, chained to what it found
// (the second turn's blocks to the first's last), what it evicts, the reset.
func TestKVEventsAsVLLMPublishesThem(t *testing.T) {
	for _, enc := range []string{KVEncodingMap, KVEncodingMapEvents, KVEncodingArray} {
		for _, intHashes := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s, int hashes %v", enc, intHashes), func(t *testing.T) {
				d := start(t, Config{Role: RoleDecode, PrefixCacheBlocks: 3,
					KVEvents: KVEvents{Endpoint: "tcp://127.0.0.1:0", Encoding: enc, IntHashes: intHashes}})
				sub := subscribeKV(t, d)
				one := tokenIDs(t, d, chatOf("", turn1...))       // 41 tokens: 2 full blocks
				two := tokenIDs(t, d, chatOf("", turn2...))       // 48: 3, the first 2 turn 1's
				other := tokenIDs(t, d, chatOf("", unrelated...)) // 41: 2 of its own
				steps := []struct {
					path, body string
					want       []wireEvent
				}{
					{"/v1/chat/completions", chatOf("", turn1...), []wireEvent{stored(one, 0, 2, intHashes)}},
					{"/v1/chat/completions", chatOf("", turn2...), []wireEvent{stored(two, 2, 3, intHashes)}},
					// The 2 new blocks evict the 2 least recently used, the
					// conversation's from its end, as they are allocated:
					// before they are stored.
					{"/v1/chat/completions", chatOf("", unrelated...), []wireEvent{
						removed(two, 2, intHashes), removed(two, 1, intHashes), stored(other, 0, 2, intHashes)}},
					{"/reset_prefix_cache", "", []wireEvent{{Type: "AllBlocksCleared"}}},
				}
				for i, st := range steps {
					if r := post(t, d, st.path, st.body, ""); r.status != 200 {
						t.Fatalf("step %d: %d %s", i, r.status, r.body)
					}
					msg := sub.next(t)
					if msg.topic != "kv@"+d.Addr()+"@pdsim" || msg.seq != uint64(i) {
						t.Errorf("step %d: topic %q, seq %d; want kv@%s@pdsim, %d", i, msg.topic, msg.seq, d.Addr(), i)
					}
					if got := decodeBatch(t, msg.payload, enc, intHashes); !reflect.DeepEqual(got, st.want) {
						t.Errorf("step %d: events\n%+v\nwant\n%+v", i, got, st.want)
					}
				}
				if reflect.DeepEqual(one[:32], other[:32]) || !reflect.DeepEqual(one[:32], two[:32]) {
					t.Error("turn 2's tokens should start with turn 1's, the unrelated prompt's not")
				}
			})
		}
	}
}

// The bytes msgspec writes for the same batches: fields in declaration
// order, the tag first, ints in the fewest bytes, floats in 8.
func TestKVWireBytes(t *testing.T) {
	ts := time.Unix(1, 5e8) // 1.5
	var h blockHash
	h[31] = 5
	tests := []struct {
		encoding string
		intHash  bool
		event    kvEvent
		want     string // hex
	}{
		{KVEncodingMap, false, kvEvent{kind: allBlocksCleared},
			"83" + "a2" + hex.EncodeToString([]byte("ts")) + "cb3ff8000000000000" +
				"a6" + hex.EncodeToString([]byte("events")) + "91" +
				"81" + "a4" + hex.EncodeToString([]byte("type")) + "b0" + hex.EncodeToString([]byte("AllBlocksCleared")) +
				"b2" + hex.EncodeToString([]byte("data_parallel_rank")) + "00"},
		{KVEncodingArray, true, kvEvent{kind: blockRemoved, hashes: []blockHash{h}},
			"93" + "cb3ff8000000000000" + "91" +
				"93" + "ac" + hex.EncodeToString([]byte("BlockRemoved")) + "91" + "05" + "a3" + hex.EncodeToString([]byte("GPU")) + "00"},
		{KVEncodingMapEvents, false, kvEvent{kind: blockRemoved, hashes: []blockHash{h}},
			"93" + "cb3ff8000000000000" + "91" +
				"83" + "a4" + hex.EncodeToString([]byte("type")) + "ac" + hex.EncodeToString([]byte("BlockRemoved")) +
				"ac" + hex.EncodeToString([]byte("block_hashes")) + "91" + "c420" + hex.EncodeToString(h[:]) +
				"a6" + hex.EncodeToString([]byte("medium")) + "a3" + hex.EncodeToString([]byte("GPU")) + "00"},
	}
	for _, tt := range tests {
		got, err := newKVWire(tt.encoding, tt.intHash).encode(kvBatch{ts: ts, events: []kvEvent{tt.event}})
		if err != nil || hex.EncodeToString(got) != tt.want {
			t.Errorf("%s: %x, %v\nwant %s", tt.encoding, got, err, tt.want)
		}
	}
}
