package kvevents

import (
	"encoding/binary"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Keys are what keys a request's blocks in an engine's prefix cache besides
// their tokens, as vLLM keys them (generate_block_hash_extra_keys,
// vllm/v1/core/kv_cache_utils.py): the name of the LoRA adapter the request
// is for, on every block, then its cache_salt, on the first block only.
type Keys struct {
	// Model is the model the request names. It keys the blocks only when
	// it names an adapter, which the index knows from the engines storing
	// blocks of an adapter of that name (their events' lora_name): a base
	// model's blocks carry no name.
	Model string
	Salt  string // the request's cache_salt, "" for none
}

// maxAdapters and maxAdapterName bound the adapter names an index
// remembers (about a megabyte); a name past them is looked up as a base
// model's would be.
const (
	maxAdapters    = 4096
	maxAdapterName = 256
)

// extra is what keys the blocks of a request with keys k, besides their
// tokens: first for its first block, rest for the others. lora says whether
// k.Model names an adapter.
func (k Keys) extra(lora bool) (first, rest []byte) {
	if lora {
		rest = appendName(nil, k.Model)
	}
	first = rest
	if k.Salt != "" {
		first = appendName(append([]byte(nil), rest...), k.Salt)
	}
	return first, rest
}

// A block's extra keys are kept in a form of this package's, each key in
// the order vLLM lists them (LoRA name, multimodal inputs, cache_salt,
// prompt embeddings): a name (an adapter's, a salt, a bare string key) as
// its bytes, whichever of vLLM's encodings carried it, so that a request's
// Keys give the same bytes; any other key as its raw msgpack, which no
// request's Keys give (a multimodal input, prompt embeddings: a request
// with them finds its blocks up to them, not past).
const (
	nameKey   = 's'
	opaqueKey = 'r'
)

func appendName(buf []byte, s string) []byte {
	buf = append(buf, nameKey)
	buf = binary.AppendUvarint(buf, uint64(len(s)))
	return append(buf, s...)
}

func appendOpaque(buf, raw []byte) []byte {
	buf = append(buf, opaqueKey)
	buf = binary.AppendUvarint(buf, uint64(len(raw)))
	return append(buf, raw...)
}

// readExtra reads extra_keys: nil, or a list with an entry per block, each
// nil or a tuple of keys. Keys come bare (a name, a (hash, offset) pair for
// a multimodal input, bytes for prompt embeddings: vLLM's tuples as its
// block hash takes them) or typed (vLLM's ExtraKey structs, tagged "lora",
// "cache_salt", "mm", ...). adapter is the name of a typed LoRA key, if any.
func readExtra(d *decoder) (blocks [][]byte, adapter string, err error) {
	var key *decoder // each key is read again by it, made at the first
	blocks, err = readList(d, func() ([]byte, error) {
		var out []byte
		n, err := d.arrayLen()
		for i := 0; err == nil && i < n; i++ {
			var raw []byte
			if raw, err = d.raw(); err != nil {
				break
			}
			if key == nil {
				key = d.part(raw)
			} else {
				key.reset(raw)
			}
			name, lora, ok := readName(key)
			switch {
			case ok:
				out = appendName(out, name)
				if lora {
					adapter = name
				}
			default:
				out = appendOpaque(out, raw)
			}
		}
		if err == nil {
			err = d.charge(len(out))
		}
		return out, err
	})
	return blocks, adapter, err
}

// readName reads one extra key, alone in d, as a name: a bare string, or a
// typed LoRA ({"type": "lora", "name": ...}) or cache_salt ({"type":
// "cache_salt", "salt": ...}) key; lora says it is an adapter's.
func readName(d *decoder) (name string, lora, ok bool) {
	raw := d.payload
	if len(raw) == 0 {
		return "", false, false
	}
	if msgpcode.IsString(raw[0]) {
		s, err := d.DecodeString()
		return s, false, err == nil
	}
	if !isMap(raw[0]) {
		return "", false, false
	}
	var tag, value string
	err := readStruct(d, func(field string, _ int) error {
		var err error
		switch field {
		case "type":
			tag, err = d.DecodeString()
		case "name", "salt":
			value, err = d.DecodeString()
		default:
			err = d.skip()
		}
		return err
	})
	if err != nil || !(tag == "lora" || tag == "cache_salt") {
		return "", false, false
	}
	return value, tag == "lora", true
}
