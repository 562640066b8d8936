package kvevents

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/cespare/xxhash/v2"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Kind is what an event says of a publisher's blocks.
type Kind uint8

const (
	Stored  Kind = iota + 1 // BlockStored: blocks computed or received
	Removed                 // BlockRemoved: blocks evicted
	Cleared                 // AllBlocksCleared: the cache was reset
	// Unknown is an event of a type the decoder does not know (a newer
	// engine's, a fork's): read past, and counted, but not indexed.
	Unknown
)

// Event is one KV cache event.
type Event struct {
	Kind Kind
	// Hashes are the engine's block hashes: an integer one (vLLM's default,
	// the digest's low 64 bits) as it is, a bytes one (the whole digest,
	// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) folded to 64 bits.
	Hashes []uint64
	// Parent is the hash of the block before the first of Hashes; HasParent
	// is false for blocks that start a prompt.
	Parent    uint64
	HasParent bool
	Tokens    []int64 // the stored blocks' token ids, BlockSize per block
	BlockSize int
	// Extra holds, per stored block, the extra keys its hash covers (LoRA
	// name, multimodal inputs, cache_salt), nil for none, in this package's
	// form (keys.go). An event without extra_keys that names a LoRA adapter
	// (lora_name, else lora_id) or SGLang's cache_salt (in its metadata, or,
	// since its events are maps, a field of its own) gets those for every
	// block, so that its blocks never match a plain request's.
	Extra [][]byte
	// Adapter is the LoRA adapter the blocks were computed for (lora_name,
	// or a typed LoRA extra key), "" for the base model.
	Adapter string
	// Medium is where the blocks live: "GPU" (or "" when unset) is the
	// engine's prefix cache; other media (an offloaded tier) are not indexed.
	Medium string
	// Group is the KV cache group of hybrid models, and SpecKind the kind
	// of its layers (vLLM's kv_cache_spec_kind: "full_attention",
	// "sliding_window", "mamba", ...), "" from engines that do not say.
	Group    int
	SpecKind string
	// keyed is the raw msgpack of a LoRA id or cache_salt named without
	// extra_keys or a lora_name (Extra).
	keyed []byte
}

// Batch is one published message's events.
type Batch struct {
	TS     float64
	Events []Event // of the types this package knows
	Rank   int     // the publishing data-parallel rank
	// Unknown counts the events of a type this package does not know
	// (a newer vLLM's), read past and not kept.
	Unknown int
}

var errFormat = errors.New("kvevents: not a KV event batch")

// DecodeBatch reads a batch in either of vLLM's encodings: named fields
// (maps, events tagged by "type": vLLM since the map schema) or positional
// ones (msgspec array_like: each event an array whose first element is its
// tag, the older releases). Fields it does not know are skipped.
func DecodeBatch(payload []byte) (Batch, error) {
	d := newDecoder(payload)
	var b Batch
	err := readStruct(d, func(field string, i int) error {
		if i >= 0 {
			field = positional(batchFields, i)
		}
		var err error
		switch field {
		case "ts":
			b.TS, err = d.DecodeFloat64()
		case "events":
			b.Events, b.Unknown, err = readEvents(d)
		case "data_parallel_rank":
			var r int64
			r, err = d.DecodeInt64()
			b.Rank = int(r)
		default:
			err = d.skip()
		}
		return err
	})
	if err != nil {
		return Batch{}, fmt.Errorf("%w: %v", errFormat, err)
	}
	return b, nil
}

var batchFields = []string{"ts", "events", "data_parallel_rank"}

// The fields of each event, in vLLM's order (vllm/distributed/kv_events.py).
var (
	storedFields  = []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
	removedFields = []string{"type", "block_hashes", "medium", "group_idx"}
)

// readEvents reads a batch's events: those of a known type, and the count
// of the others, which are not kept (one is two bytes of a payload, an Event
// is some 200).
func readEvents(d *decoder) (events []Event, unknown int, err error) {
	n, err := d.arrayLen()
	if err != nil || n < 0 {
		return nil, 0, err
	}
	events = make([]Event, 0, min(n, preallocated))
	for range n {
		e, err := readEvent(d)
		if err == nil && e.Kind != Unknown {
			err = d.charge(int(unsafe.Sizeof(e)))
		}
		if err != nil {
			return nil, 0, err
		}
		if e.Kind == Unknown {
			unknown++
			continue
		}
		events = append(events, e)
	}
	return events, unknown, nil
}

// readEvent reads one event: a map of its fields, tagged by "type" (which
// msgspec writes first, though any order is read), or an array whose first
// element is its tag and the rest its fields in vLLM's order.
func readEvent(d *decoder) (Event, error) {
	c, err := d.PeekCode()
	if err != nil {
		return Event{}, err
	}
	if isMap(c) {
		return readNamedEvent(d)
	}
	var e Event
	var fields []string // the kind's, once the tag is read
	err = readStruct(d, func(_ string, i int) error {
		if i == 0 {
			var err error
			fields, err = e.readTag(d)
			return err
		}
		return e.read(d, positional(fields, i))
	})
	e.finish()
	return e, err
}

func readNamedEvent(d *decoder) (Event, error) {
	n, err := d.mapLen()
	if err != nil {
		return Event{}, err
	}
	type field struct {
		name string
		raw  []byte
	}
	fs := make([]field, 0, min(n, len(storedFields)))
	var e Event
	for range n {
		name, err := d.DecodeString()
		if err != nil {
			return e, err
		}
		if name == "type" {
			if _, err := e.readTag(d); err != nil {
				return e, err
			}
			continue
		}
		raw, err := d.raw()
		if err != nil {
			return e, err
		}
		fs = append(fs, field{name, raw})
	}
	switch e.Kind {
	case 0:
		return e, errors.New("an event without a type")
	case Unknown:
		return e, nil // its fields, whatever their shapes, are not this package's to read
	}
	for _, f := range fs {
		if err := e.read(d.part(f.raw), f.name); err != nil {
			return e, err
		}
	}
	e.finish()
	return e, nil
}

// finish keys a stored event's blocks by the adapter or cache_salt it named
// without extra_keys (Extra): by the adapter's name as a request for it is
// keyed, else by what it named as it is, which no request's keys match.
func (e *Event) finish() {
	var k []byte
	switch {
	case e.Adapter != "":
		k = appendName(nil, e.Adapter)
	case e.keyed != nil:
		k = appendOpaque(nil, e.keyed)
	}
	if e.Kind == Stored && e.Extra == nil && k != nil {
		e.Extra = make([][]byte, len(e.Hashes))
		for i := range e.Extra {
			e.Extra[i] = k
		}
	}
	e.keyed = nil
}

// readTag reads an event's tag and returns its fields in vLLM's order.
func (e *Event) readTag(d *decoder) ([]string, error) {
	tag, err := d.DecodeString()
	if err != nil {
		return nil, err
	}
	switch tag {
	case "BlockStored":
		e.Kind = Stored
		return storedFields, nil
	case "BlockRemoved":
		e.Kind = Removed
		return removedFields, nil
	case "AllBlocksCleared":
		e.Kind = Cleared
		return nil, nil
	}
	e.Kind = Unknown // its fields are skipped
	return nil, nil
}

// read reads the field called name.
func (e *Event) read(d *decoder, name string) error {
	var err error
	switch name {
	case "block_hashes":
		e.Hashes, err = readHashes(d)
	case "parent_block_hash":
		var ok bool
		e.Parent, ok, err = readHash(d)
		e.HasParent = ok
	case "token_ids":
		e.Tokens, err = readTokens(d)
	case "block_size":
		var n int64
		n, err = d.DecodeInt64()
		e.BlockSize = int(n)
	case "medium":
		e.Medium, err = readOptionalString(d)
	case "extra_keys":
		var adapter string
		if e.Extra, adapter, err = readExtra(d); adapter != "" {
			e.Adapter = adapter
		}
	case "group_idx":
		var n int64
		n, err = d.DecodeInt64() // nil reads as 0
		e.Group = int(n)
	case "kv_cache_spec_kind":
		e.SpecKind, err = readOptionalString(d)
	case "lora_id", "lora_name", "metadata", "cache_salt":
		err = e.readKey(d, name, true)
	default:
		err = d.skip()
	}
	return err
}

// readKey reads a field that keys the blocks where no extra_keys do (finish):
// a lora_name as the adapter, anything else but nil as it is. A map is
// SGLang's metadata (at position 7, where vLLM has lora_name), of which only
// the cache_salt keys a page, not the session_id (sgl-project/sglang#37482).
func (e *Event) readKey(d *decoder, name string, top bool) error {
	c, err := d.PeekCode()
	switch {
	case err != nil:
		return err
	case c == msgpcode.Nil:
		return d.DecodeNil()
	case name == "lora_name" && msgpcode.IsString(c):
		e.Adapter, err = d.DecodeString()
		return err
	case top && isMap(c):
		return readStruct(d, func(field string, _ int) error {
			if field != "cache_salt" {
				return d.skip()
			}
			return e.readKey(d, field, false)
		})
	}
	raw, err := d.raw()
	e.keyed = append(e.keyed, raw...)
	return err
}

// positional maps an array element's index to its field name for kind.
func positional(fields []string, i int) string {
	if i < len(fields) {
		return fields[i]
	}
	return ""
}

// readHash reads a block hash: bytes (folded to 64 bits with xxhash), an
// integer, or nil (ok false).
func readHash(d *decoder) (h uint64, ok bool, err error) {
	c, err := d.PeekCode()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c == msgpcode.Nil:
		return 0, false, d.DecodeNil()
	case msgpcode.IsBin(c) || msgpcode.IsString(c):
		b, err := d.bytes()
		return xxhash.Sum64(b), true, err
	case c == msgpcode.Uint64:
		u, err := d.DecodeUint64()
		return u, true, err
	default:
		i, err := d.DecodeInt64()
		return uint64(i), true, err
	}
}

func readHashes(d *decoder) ([]uint64, error) {
	return readList(d, func() (uint64, error) {
		h, ok, err := readHash(d)
		if err == nil && !ok {
			err = errors.New("a nil block hash")
		}
		return h, err
	})
}

// readTokens reads token_ids: integers, or, from SGLang running EAGLE
// speculative decoding, whose radix tree keys pairs of consecutive tokens,
// a pair [t, t+1] for each token, of which the first is the token
// (RadixCache._record_store_event, python/sglang/srt/mem_cache/radix_cache.py).
func readTokens(d *decoder) ([]int64, error) {
	return readList(d, func() (int64, error) {
		if c, err := d.PeekCode(); err != nil || !isArray(c) {
			return d.DecodeInt64()
		}
		n, err := d.arrayLen()
		if err == nil && n < 1 {
			err = errors.New("an empty token pair")
		}
		if err != nil {
			return 0, err
		}
		t, err := d.DecodeInt64()
		for i := 1; err == nil && i < n; i++ {
			err = d.skip()
		}
		return t, err
	})
}
