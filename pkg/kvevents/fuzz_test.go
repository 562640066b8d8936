package kvevents

import (
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// FuzzDecodeBatch: whatever a publisher sends, DecodeBatch returns without
// a panic, and the index applies what it accepts without one.
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
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := DecodeBatch(payload)
		if err != nil {
			return
		}
		x := NewIndex(Bounds{}, time.Minute, nil)
		x.Apply(Publisher{Endpoint: "10.0.0.1:8000"}, b.Events)
	})
}
