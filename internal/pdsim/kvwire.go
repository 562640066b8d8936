package pdsim

import (
	"bytes"
	"encoding/binary"
	"errors"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// The KV events in vLLM's wire format, as vllm/distributed/kv_events.py
// writes them (vllm-project/vllm at 0181ea3173e53eea8cf04a86891488e3dc89bb34):
// msgspec structs in msgpack, each event tagged by its class name. Written
// here from the format itself, not shared with any consumer, so a misreading
// on either side shows in their tests.

// kvBatch is one message: the events of one change to the cache.
type kvBatch struct {
	seq    uint64
	ts     time.Time
	events []kvEvent
	send   bool // false: only kept for replay
}

// Encodings of the events (KVEvents.Encoding), as vLLM's have changed.
const (
	// KVEncodingMap is current vLLM's: the batch {"ts", "events",
	// "data_parallel_rank"} and each event a map of its fields, its class
	// name under "type", fields at their default None left out (msgspec's
	// omit_defaults).
	KVEncodingMap = "map"
	// KVEncodingMapEvents is what vLLM 0.26 sends, after
	// vllm-project/vllm#42892 made the events maps: the same events in a
	// positional batch [ts, events, data_parallel_rank].
	KVEncodingMapEvents = "map-events"
	// KVEncodingArray is older vLLM's msgspec array_like=True: the batch
	// [ts, events, data_parallel_rank] and each event an array of its tag
	// and its fields in declaration order, as vLLM's
	// examples/online_serving/kv_events_subscriber.py decodes them.
	KVEncodingArray = "array"
)

// kvWire encodes batches one way.
type kvWire struct {
	arrayBatch, arrayEvents bool
	// intHashes sends a block hash as the int of its low 64 bits, as vLLM
	// does with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (maybe_convert_block_hash
	// in vllm/v1/core/kv_cache_utils.py); otherwise as its 32 digest bytes.
	intHashes bool
}

func newKVWire(encoding string, intHashes bool) kvWire {
	return kvWire{arrayBatch: encoding != KVEncodingMap, arrayEvents: encoding == KVEncodingArray, intHashes: intHashes}
}

// field is one field of a msgspec struct, in declaration order.
type field struct {
	key string
	val any
}

func (w kvWire) encode(b kvBatch) ([]byte, error) {
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	e.UseCompactInts(true) // as msgspec writes ints: in the fewest bytes
	events := make([]any, len(b.events))
	for i, ev := range b.events {
		events[i] = w.event(ev)
	}
	batch := record{array: w.arrayBatch, fields: []field{
		{"ts", float64(b.ts.UnixNano()) / 1e9},
		{"events", events},
		{"data_parallel_rank", 0}, // set by the publisher, so never left out
	}}
	err := batch.encode(e)
	return buf.Bytes(), err
}

// event is one event's tag and fields as the encoding lays them out.
func (w kvWire) event(ev kvEvent) record {
	switch ev.kind {
	case blockStored:
		fields := []field{
			{"block_hashes", w.hashes(ev.hashes)},
			{"parent_block_hash", w.parent(ev.parent)},
			{"token_ids", ev.tokens},
			{"block_size", blockSize},
			{"lora_id", orNil(ev.keys.adapterID, 0)},
			{"medium", "GPU"},
		}
		if !w.arrayEvents {
			// What vLLM's block pool (vllm/v1/core/block_pool.py) fills in:
			// the adapter's name, each block's extra keys (its
			// generate_block_hash_extra_keys tuple: the adapter's name, then
			// on a prompt's first block the cache_salt; nil for none), the
			// one KV cache group, full attention.
			extra := make([]any, len(ev.hashes))
			for i := range extra {
				if keys := ev.keys.extra(ev.first + i); keys != nil {
					extra[i] = keys
				}
			}
			fields = append(fields,
				field{"lora_name", orNil(ev.keys.adapter, "")},
				field{"extra_keys", extra},
				field{"group_idx", 0},
				field{"kv_cache_spec_kind", "full_attention"})
		}
		return record{w.arrayEvents, "BlockStored", fields}
	case blockRemoved:
		return record{w.arrayEvents, "BlockRemoved", []field{{"block_hashes", w.hashes(ev.hashes)}, {"medium", "GPU"}}}
	}
	return record{array: w.arrayEvents, tag: "AllBlocksCleared"}
}

func (w kvWire) hashes(hs []blockHash) []any {
	out := make([]any, len(hs))
	for i := range hs {
		out[i] = w.hash(&hs[i])
	}
	return out
}

func (w kvWire) parent(h *blockHash) any {
	if h == nil {
		return nil
	}
	return w.hash(h)
}

func (w kvWire) hash(h *blockHash) any {
	if w.intHashes {
		return binary.BigEndian.Uint64(h[len(h)-8:])
	}
	return h[:]
}

// record is a msgspec struct: a map of its fields (its tag, if any, first
// under "type") or, array_like, an array of its tag and field values.
type record struct {
	array  bool
	tag    string // the batch has none
	fields []field
}

func (r record) encode(e *msgpack.Encoder) error {
	n := len(r.fields)
	if r.tag != "" {
		n++
	}
	var err error
	switch {
	case r.array:
		err = e.EncodeArrayLen(n)
	default:
		err = e.EncodeMapLen(n)
		if r.tag != "" {
			err = errors.Join(err, e.EncodeString("type"))
		}
	}
	if r.tag != "" {
		err = errors.Join(err, e.EncodeString(r.tag))
	}
	for _, f := range r.fields {
		if !r.array {
			err = errors.Join(err, e.EncodeString(f.key))
		}
		err = errors.Join(err, encodeValue(e, f.val))
	}
	return err
}

func encodeValue(e *msgpack.Encoder, v any) error {
	switch v := v.(type) {
	case record:
		return v.encode(e)
	case []any:
		err := e.EncodeArrayLen(len(v))
		for _, x := range v {
			err = errors.Join(err, encodeValue(e, x))
		}
		return err
	}
	return e.Encode(v)
}

// orNil is v, or nil (msgpack's nil) when it is none.
func orNil[T comparable](v, none T) any {
	if v == none {
		return nil
	}
	return v
}
