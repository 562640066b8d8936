package kv

import (
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// sglangKV drives SGLang's PD disaggregation: both legs carry the same top-level
// bootstrap fields and must be in flight together, because the prefill engine
// waits for the decode engine to connect to its bootstrap server. SGLang has no
// kv_transfer_params (it would silently drop it) and needs an integer room.
type sglangKV struct{ sglangFamily }

func (sglangKV) Dispatch() Dispatch    { return Concurrent }
func (sglangKV) Paired() bool          { return true }
func (sglangKV) HandsBackParams() bool { return false }

// The prefill leg is not capped: SGLang's prefill engine stops after the forward
// pass by itself, and the reference routers send it the client's body unchanged.
func (sglangKV) PrefillEdits(h *Handoff) []body.Edit { return bootstrapFields(h) }
func (sglangKV) DecodeEdits(h *Handoff) []body.Edit  { return bootstrapFields(h) }

// bootstrapFields are one host, port and room for the whole request, or, with
// Rooms, lists of them with one entry per sample, as SGLang's own gateway
// sends parallel samples (the engine reads list entry i for sample i).
func bootstrapFields(h *Handoff) []body.Edit {
	host, port := body.Quote(h.PrefillHost), body.Uint(uint64(h.BootstrapPort))
	if h.Rooms == nil {
		return []body.Edit{
			body.Set("bootstrap_host", host),
			body.Set("bootstrap_port", port),
			body.Set("bootstrap_room", body.Uint(h.Room)),
		}
	}
	rooms := make([][]byte, len(h.Rooms))
	for i, r := range h.Rooms {
		rooms[i] = body.Uint(r)
	}
	return []body.Edit{
		body.Set("bootstrap_host", list(len(h.Rooms), func(int) []byte { return host })),
		body.Set("bootstrap_port", list(len(h.Rooms), func(int) []byte { return port })),
		body.Set("bootstrap_room", list(len(h.Rooms), func(i int) []byte { return rooms[i] })),
	}
}

// list is the JSON array of n values.
func list(n int, value func(i int) []byte) []byte {
	b := []byte{'['}
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, value(i)...)
	}
	return append(b, ']')
}
