package kvevents

import (
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// FuzzDecodeBatch: whatever a publisher sends, DecodeBatch returns without
// a panic, and the index applies what it accepts, and looks requests up
// after it (plain, for an adapter it named, salted), without one.
// testdata/fuzz keeps what once crashed it: field-named-nil, a map whose key
// is nil, which was taken for a position of -1.
func FuzzDecodeBatch(f *testing.F) {
	uint := func(e *msgpack.Encoder, h uint64) error { return e.EncodeUint(h) }
	bytes := func(e *msgpack.Encoder, h uint64) error { return e.EncodeBytes([]byte{byte(h), 1, 2, 3}) }
	for _, mapped := range []bool{true, false} {
		for _, hash := range []func(*msgpack.Encoder, uint64) error{uint, bytes} {
			f.Add(vllmBatch(f, mapped, hash))
		}
	}
	adapter, _ := msgpack.Marshal([]any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": []int{1, 2},
		"token_ids": seq(0, 8), "block_size": 4, "lora_name": "sql", "extra_keys": []any{[]any{map[string]any{"type": "lora", "name": "sql"}, "s1"}, []any{"sql"}}}}})
	f.Add(adapter)
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := DecodeBatch(payload)
		if err != nil {
			return
		}
		x := NewIndex(Bounds{}, time.Minute, nil)
		x.Apply(Publisher{Endpoint: "10.0.0.1:8000"}, b.Events)
		for _, k := range []Keys{{}, {Model: "sql"}, {Model: "sql", Salt: "s1"}} {
			x.Lookup([]string{"10.0.0.1:8000"}, seq(0, 64), k)
		}
		for _, e := range b.Events {
			if e.Adapter != "" {
				x.Lookup([]string{"10.0.0.1:8000"}, e.Tokens, Keys{Model: e.Adapter})
			}
		}
	})
}
