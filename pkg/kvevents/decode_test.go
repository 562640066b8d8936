package kvevents

import (
	"bytes"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/vmihailenco/msgpack/v5"
)

// vllmBatch writes a batch as vLLM does (vllm/distributed/kv_events.py):
// named fields, each event tagged by "type" first (mapped), or positional
// ones with the tag first (the older array_like releases). Its events are a
// BlockStored of two blocks of 2 tokens after a parent, a BlockRemoved and an
// AllBlocksCleared; hash gives each hash its encoding.
func vllmBatch(t testing.TB, mapped bool, hash func(e *msgpack.Encoder, h uint64) error) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	field := func(name string) {
		if mapped {
			must(e.EncodeString(name))
		}
	}
	start := func(n int) {
		if mapped {
			must(e.EncodeMapLen(n))
		} else {
			must(e.EncodeArrayLen(n))
		}
	}
	hashes := func(hs ...uint64) {
		must(e.EncodeArrayLen(len(hs)))
		for _, h := range hs {
			must(hash(e, h))
		}
	}
	start(3)
	field("ts")
	must(e.EncodeFloat64(1764633600.5))
	field("events")
	must(e.EncodeArrayLen(3))
	// BlockStored: the optional trailing fields are there in the named form
	// only, as msgspec omits defaults.
	if mapped {
		start(10)
	} else {
		start(7)
	}
	field("type")
	must(e.EncodeString("BlockStored"))
	field("block_hashes")
	hashes(11, 12)
	field("parent_block_hash")
	must(hash(e, 10))
	field("token_ids")
	must(e.Encode([]int64{1, 2, 3, 4}))
	field("block_size")
	must(e.EncodeInt(2))
	field("lora_id")
	must(e.EncodeNil())
	field("medium")
	must(e.EncodeString("GPU"))
	if mapped {
		field("lora_name")
		must(e.EncodeNil())
		field("extra_keys")
		must(e.EncodeArrayLen(2))
		must(e.EncodeNil())
		must(e.Encode([]any{"salt"}))
		field("kv_cache_spec_kind")
		must(e.EncodeString("full_attention"))
	}
	start(3)
	field("type")
	must(e.EncodeString("BlockRemoved"))
	field("block_hashes")
	hashes(12)
	field("medium")
	must(e.EncodeString("GPU"))
	start(1)
	field("type")
	must(e.EncodeString("AllBlocksCleared"))
	field("data_parallel_rank")
	must(e.EncodeInt(1))
	return buf.Bytes()
}

func TestDecodeBatchReadsBothEncodings(t *testing.T) {
	intHash := func(e *msgpack.Encoder, h uint64) error { return e.EncodeUint(h) }
	bytesHash := func(e *msgpack.Encoder, h uint64) error { return e.EncodeBytes(bytes.Repeat([]byte{byte(h)}, 32)) }
	folded := func(h uint64) uint64 { return xxhash.Sum64(bytes.Repeat([]byte{byte(h)}, 32)) }
	same := func(h uint64) uint64 { return h }
	for _, tt := range []struct {
		name   string
		mapped bool
		hash   func(*msgpack.Encoder, uint64) error
		want   func(uint64) uint64
	}{
		{"named fields, bytes hashes", true, bytesHash, folded},
		{"named fields, integer hashes", true, intHash, same},
		{"positional fields, bytes hashes", false, bytesHash, folded},
		{"positional fields, integer hashes", false, intHash, same},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b, err := DecodeBatch(vllmBatch(t, tt.mapped, tt.hash))
			if err != nil {
				t.Fatal(err)
			}
			if b.TS != 1764633600.5 || b.Rank != 1 || len(b.Events) != 3 {
				t.Fatalf("batch %+v", b)
			}
			stored, removed, cleared := b.Events[0], b.Events[1], b.Events[2]
			if stored.Kind != Stored || !slices.Equal(stored.Hashes, []uint64{tt.want(11), tt.want(12)}) ||
				!stored.HasParent || stored.Parent != tt.want(10) || !slices.Equal(stored.Tokens, []int64{1, 2, 3, 4}) ||
				stored.BlockSize != 2 || stored.Medium != "GPU" || tt.mapped && stored.SpecKind != "full_attention" {
				t.Errorf("BlockStored read as %+v", stored)
			}
			if tt.mapped && (len(stored.Extra) != 2 || stored.Extra[0] != nil || stored.Extra[1] == nil) {
				t.Errorf("extra_keys read as %q", stored.Extra)
			}
			if removed.Kind != Removed || !slices.Equal(removed.Hashes, []uint64{tt.want(12)}) || removed.Medium != "GPU" {
				t.Errorf("BlockRemoved read as %+v", removed)
			}
			if cleared.Kind != Cleared {
				t.Errorf("AllBlocksCleared read as %+v", cleared)
			}
		})
	}
}

func TestDecodeBatchRefusesWhatIsNotABatch(t *testing.T) {
	whole := vllmBatch(t, true, func(e *msgpack.Encoder, h uint64) error { return e.EncodeUint(h) })
	typeless, _ := msgpack.Marshal(map[string]any{"ts": 1.0, "events": []any{map[string]any{"block_hashes": []int{1}}}})
	for name, payload := range map[string][]byte{
		"empty":                 nil,
		"cut short":             whole[:len(whole)/2],
		"not msgpack":           []byte(`{"ts":1}`),
		"an event without type": typeless,
	} {
		if _, err := DecodeBatch(payload); err == nil {
			t.Errorf("%s: DecodeBatch succeeded", name)
		}
	}
}

// TestDecodeBatchCostsWhatItReads: a payload of a few bytes that claims
// billions of events, hashes or tokens, a hash of 4 GiB, or a value nested
// ten million deep in a field it does not read is refused, and costs about
// its own size: never what it claims (an engine's bug, or a hostile
// publisher, would otherwise take the router down with it).
func TestDecodeBatchCostsWhatItReads(t *testing.T) {
	ts := []byte{0xcb, 0, 0, 0, 0, 0, 0, 0, 0}   // float64 0
	huge := []byte{0xdd, 0xff, 0xff, 0xff, 0xff} // an array of 2³²-1
	batch := func(parts ...[]byte) []byte {      // [ts, events]
		return slices.Concat(append([][]byte{{0x92}, ts}, parts...)...)
	}
	stored := []byte{0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd'}
	deep := append(bytes.Repeat([]byte{0x91}, 10_000_000), 0xc0) // [[[…nil…]]]
	for name, payload := range map[string][]byte{
		"billions of events":        batch(huge),
		"billions of hashes":        batch([]byte{0x91, 0x92}, stored, huge),
		"billions of tokens":        batch([]byte{0x91, 0x94}, stored, []byte{0x90, 0xc0}, huge),
		"billions of event fields":  batch([]byte{0x91, 0xdf, 0xff, 0xff, 0xff, 0xff}),
		"a hash of 4 GiB":           batch([]byte{0x91, 0x92}, stored, []byte{0x91, 0xc6, 0xff, 0xff, 0xff, 0xff}),
		"a map of billions":         batch([]byte{0x91, 0x96}, stored, []byte{0x90, 0xc0, 0x90, 0x01, 0xdf, 0xff, 0xff, 0xff, 0xff}),
		"ten million deep, unread":  slices.Concat([]byte{0x83, 0xa2, 't', 's'}, ts, []byte{0xa6, 'e', 'v', 'e', 'n', 't', 's', 0x90, 0xa1, 'x'}, deep[:len(deep)-1]),
		"ten million deep, a tuple": batch([]byte{0x91, 0x89}, stored, []byte{0x90, 0xc0, 0x90, 0x01, 0xc0, 0xc0, 0xc0, 0x91}, deep[:len(deep)-1]),
	} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err := DecodeBatch(payload)
		runtime.ReadMemStats(&after)
		if err == nil {
			t.Errorf("%s: DecodeBatch succeeded", name)
		}
		if got, limit := after.TotalAlloc-before.TotalAlloc, uint64(2*len(payload)+1<<20); got > limit {
			t.Errorf("%s: %d bytes allocated for a payload of %d", name, got, len(payload))
		}
	}
}

// TestDecodeBatchReadsSGLangs: SGLang's publisher (python/sglang/srt/
// disaggregation/kv_events.py) writes vLLM's older positional layout
// without the medium, and integer hashes.
func TestDecodeBatchReadsSGLangs(t *testing.T) {
	payload, err := msgpack.Marshal([]any{1.5, []any{
		[]any{"BlockStored", []int{1, 2}, nil, []int{1, 2, 3, 4}, 2, nil},
		[]any{"BlockRemoved", []int{2}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := DecodeBatch(payload)
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 2 || b.Events[0].Kind != Stored || b.Events[0].HasParent || !slices.Equal(b.Events[0].Hashes, []uint64{1, 2}) ||
		b.Events[0].BlockSize != 2 || b.Events[0].Medium != "" || b.Events[1].Kind != Removed || !slices.Equal(b.Events[1].Hashes, []uint64{2}) {
		t.Errorf("read as %+v", b)
	}
}

// TestDecodeBatchReadsPastUnknownEvents: an event of a type this release does
// not know (a newer vLLM's, a fork's), in either encoding and whatever its
// fields, is read past and counted, and the batch's other events stand.
func TestDecodeBatchReadsPastUnknownEvents(t *testing.T) {
	for name, events := range map[string][]any{
		"named fields, some of known names in other shapes": {map[string]any{"type": "BlockMigrated", "block_hashes": []int{7},
			"token_ids": map[string]any{"from": 1}, "to": map[string]any{"medium": "CPU"}},
			map[string]any{"type": "BlockRemoved", "block_hashes": []int{2}, "medium": "GPU"}},
		"positional fields": {[]any{"BlockMigrated", []int{7}, []any{"CPU", nil}},
			[]any{"BlockRemoved", []int{2}, "GPU"}},
	} {
		payload, err := msgpack.Marshal([]any{1.0, events})
		if err != nil {
			t.Fatal(err)
		}
		b, err := DecodeBatch(payload)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if b.Unknown != 1 || len(b.Events) != 1 || b.Events[0].Kind != Removed || !slices.Equal(b.Events[0].Hashes, []uint64{2}) {
			t.Errorf("%s: read as %+v, %d unknown", name, b.Events, b.Unknown)
		}
	}
}

// TestDecodeBatchKeysAdaptersWithoutExtraKeys: blocks of a LoRA adapter or
// with SGLang's cache_salt (in its metadata, where vLLM has lora_name, or,
// since SGLang's events are maps, a field of its own), from a publisher that
// writes no extra_keys, are keyed by them, so that they never match a plain
// request's blocks; nil fields, and SGLang's session_id, which is no part of
// a page's identity (sgl-project/sglang#37482), key nothing.
func TestDecodeBatchKeysAdaptersWithoutExtraKeys(t *testing.T) {
	sglang := func(extra map[string]any) map[string]any {
		m := map[string]any{"type": "BlockStored", "block_hashes": []int{1, 2}, "parent_block_hash": nil,
			"token_ids": seq(0, 4), "block_size": 2, "lora_id": nil, "medium": "GPU"}
		for k, v := range extra {
			m[k] = v
		}
		return m
	}
	for _, tt := range []struct {
		name  string
		event any
		keyed bool
	}{
		{"a plain block", []any{"BlockStored", []int{1, 2}, nil, seq(0, 4), 2, nil, "GPU", nil}, false},
		{"vLLM before extra_keys, a LoRA name", []any{"BlockStored", []int{1, 2}, nil, seq(0, 4), 2, nil, "GPU", "sql-lora"}, true},
		{"vLLM before lora_name, a LoRA id", []any{"BlockStored", []int{1, 2}, nil, seq(0, 4), 2, 3, "GPU"}, true},
		{"SGLang, a cache_salt", []any{"BlockStored", []int{1, 2}, nil, seq(0, 4), 2, nil, nil, map[string]any{"cache_salt": "t1"}}, true},
		{"SGLang, a cache_salt and a session_id", []any{"BlockStored", []int{1, 2}, nil, seq(0, 4), 2, nil, nil,
			map[string]any{"cache_salt": "t1", "session_id": "s1"}}, true},
		{"SGLang, a session_id alone", []any{"BlockStored", []int{1, 2}, nil, seq(0, 4), 2, nil, nil, map[string]any{"session_id": "s1"}}, false},
		{"SGLang's map, a cache_salt", sglang(map[string]any{"cache_salt": "t1", "session_id": "s1"}), true},
		{"SGLang's map, a session_id alone", sglang(map[string]any{"cache_salt": nil, "session_id": "s1"}), false},
		{"extra_keys given: theirs", []any{"BlockStored", []int{1, 2}, nil, seq(0, 4), 2, nil, "GPU", "sql-lora", []any{nil, nil}}, false},
	} {
		payload, err := msgpack.Marshal([]any{1.0, []any{tt.event}})
		if err != nil {
			t.Fatal(err)
		}
		b, err := DecodeBatch(payload)
		if err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		e := b.Events[0]
		keyed := len(e.Extra) == 2 && e.Extra[0] != nil && e.Extra[1] != nil
		if keyed != tt.keyed || !tt.keyed && slices.ContainsFunc(e.Extra, func(x []byte) bool { return x != nil }) {
			t.Errorf("%s: extra %q, want keyed %v", tt.name, e.Extra, tt.keyed)
		}
	}
}

// TestLookupKeysRequestsAsTheEngineKeysBlocks: blocks an engine stored for
// a LoRA adapter, or under a cache_salt, are found by requests for that
// adapter, or with that salt, and by no others, whichever of vLLM's forms
// of extra keys the events carry (bare, typed, or none but a lora_name);
// a block with a multimodal input ends a plain request's match there.
func TestLookupKeysRequestsAsTheEngineKeysBlocks(t *testing.T) {
	lora := map[string]any{"type": "lora", "name": "sql"}
	salt := map[string]any{"type": "cache_salt", "salt": "s1"}
	keyed := func(first []any, rest ...any) []any { return []any{first, rest, rest} }
	event := func(adapter any, extra any) map[string]any {
		return map[string]any{"type": "BlockStored", "block_hashes": []int{1, 2, 3}, "parent_block_hash": nil,
			"token_ids": seq(0, 12), "block_size": 4, "lora_id": nil, "medium": "GPU", "lora_name": adapter, "extra_keys": extra}
	}
	plain := event(nil, []any{nil, nil, nil})
	for _, tt := range []struct {
		name   string
		stored any
		keys   Keys
		want   int
	}{
		{"plain blocks, a plain request", plain, Keys{Model: "base"}, 12},
		{"plain blocks, a salted request", plain, Keys{Model: "base", Salt: "s1"}, 0},
		{"salted blocks, the same salt", event(nil, []any{[]any{"s1"}, nil, nil}), Keys{Salt: "s1"}, 12},
		{"salted blocks, another salt", event(nil, []any{[]any{"s1"}, nil, nil}), Keys{Salt: "s2"}, 0},
		{"salted blocks, no salt", event(nil, []any{[]any{"s1"}, nil, nil}), Keys{}, 0},
		{"an adapter's blocks, a request for it", event("sql", keyed([]any{"sql"}, "sql")), Keys{Model: "sql"}, 12},
		{"an adapter's blocks, a request for the base model", event("sql", keyed([]any{"sql"}, "sql")), Keys{Model: "base"}, 0},
		{"the base model's blocks, a request for a known adapter", plain, Keys{Model: "known"}, 0},
		{"an adapter's salted blocks", event("sql", keyed([]any{"sql", "s1"}, "sql")), Keys{Model: "sql", Salt: "s1"}, 12},
		{"typed extra keys", event("sql", keyed([]any{lora, salt}, lora)), Keys{Model: "sql", Salt: "s1"}, 12},
		{"typed extra keys name the adapter", event(nil, keyed([]any{lora}, lora)), Keys{Model: "sql"}, 12},
		{"no extra_keys, a lora_name (older vLLM)", event("sql", nil), Keys{Model: "sql"}, 12},
		{"no extra_keys, a lora_name, a plain request", event("sql", nil), Keys{}, 0},
		{"an image in the second block", event(nil, []any{nil, []any{[]any{"img", 3}}, nil}), Keys{Model: "base"}, 4},
		{"a typed image in the second block", event(nil, []any{nil, []any{map[string]any{"type": "mm", "modality": "image", "hash": "img", "block_offset": 0}}, nil}), Keys{}, 4},
	} {
		t.Run(tt.name, func(t *testing.T) {
			x := NewIndex(Bounds{}, time.Minute, nil)
			x.Reset(a, true)
			x.Reset(b, true)
			for p, ev := range map[Publisher]any{a: tt.stored, b: event("known", keyed([]any{"known"}, "known"))} {
				payload, err := msgpack.Marshal([]any{1.0, []any{ev}})
				if err != nil {
					t.Fatal(err)
				}
				batch, err := DecodeBatch(payload)
				if err != nil {
					t.Fatal(err)
				}
				x.Apply(p, batch.Events)
			}
			held, _ := x.Lookup([]string{a.Endpoint}, seq(0, 12), tt.keys)
			if held[a.Endpoint] != tt.want {
				t.Errorf("holds %d tokens for %+v, want %d", held[a.Endpoint], tt.keys, tt.want)
			}
		})
	}
}

// A payload of many tiny elements, within the message bound, takes a bounded
// multiple of its size decoded: millions of two-byte unknown events, or of
// one-byte empty extra-key tuples, once took some 300 times it (an Event,
// or a slice header, each). Unknown events are now counted, not kept; a
// list whose elements would take more than the payload's budget is refused
// before anything is made for them.
func TestTinyElementsCostABoundedMultiple(t *testing.T) {
	n := 1 << 18                                         // a variable: byte() keeps the low bits of each shift
	header := []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0} // [timestamp,
	list := []byte{0xdd, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
	tests := []struct {
		name    string
		payload []byte
		refused bool
	}{
		{"unknown events [\"\"]", slices.Concat(header, list, bytes.Repeat([]byte{0x91, 0xa0}, n), []byte{}), false},
		{"extra_keys of empty tuples", slices.Concat(header, []byte{0x91, 0x82, 0xa4}, []byte("type"), []byte{0xab}, []byte("BlockStored"),
			[]byte{0xaa}, []byte("extra_keys"), list, bytes.Repeat([]byte{0x90}, n)), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			b, err := DecodeBatch(tt.payload)
			runtime.ReadMemStats(&after)
			switch {
			case tt.refused && (err == nil || !strings.Contains(err.Error(), errTooCostly.Error())):
				t.Errorf("DecodeBatch: %v, want %v", err, errTooCostly)
			case !tt.refused && (err != nil || b.Unknown != n || len(b.Events) != 0):
				t.Errorf("DecodeBatch: %d events, %d unknown, %v; want %d unknown", len(b.Events), b.Unknown, err, n)
			}
			if got := after.TotalAlloc - before.TotalAlloc; got > uint64(2*len(tt.payload)) {
				t.Errorf("a payload of %d bytes allocated %d (%.0f times)", len(tt.payload), got, float64(got)/float64(len(tt.payload)))
			}
		})
	}
}

// SGLang running EAGLE speculative decoding keys its radix tree by pairs of
// consecutive tokens and publishes a pair [t, t+1] for each token: the
// first of each is the token, and the batch stands.
func TestDecodeBatchReadsSGLangTokenPairs(t *testing.T) {
	for name, tokens := range map[string]any{
		"tokens": []int{5, 6, 7, 8},
		"pairs":  [][]int{{5, 6}, {6, 7}, {7, 8}, {8, 9}},
	} {
		payload, err := msgpack.Marshal([]any{1.0, []any{[]any{"BlockStored", []int{11}, nil, tokens, 4, nil, "GPU"}}})
		if err != nil {
			t.Fatal(err)
		}
		b, err := DecodeBatch(payload)
		if err != nil || len(b.Events) != 1 || !slices.Equal(b.Events[0].Tokens, []int64{5, 6, 7, 8}) {
			t.Errorf("%s: %+v, %v; want the tokens 5, 6, 7, 8", name, b.Events, err)
		}
	}
}
