package kv

import (
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// sglangKV drives SGLang's PD disaggregation: both legs carry the same top-level
// bootstrap fields and must be in flight together, because the prefill engine
// waits for the decode engine to connect to its bootstrap server. SGLang has no
// kv_transfer_params (it would silently drop it) and needs an integer room.
type sglangKV struct{ sglangFamily }

func (sglangKV) Dispatch() Dispatch     { return Concurrent }
func (sglangKV) Paired() bool           { return true }
func (sglangKV) HandsBackParams() bool  { return false }
func (sglangKV) Rendezvous() Rendezvous { return SGLangBootstrapPort }

// RepeatedPull: the bootstrap thread's transfer_infos[room],
// python/sglang/srt/disaggregation/mooncake/conn.py.
func (sglangKV) RepeatedPull() string {
	return "the prefill engine sends a bootstrap room's KV once: a second decode request for the room waits " +
		"SGLANG_DISAGGREGATION_WAITING_TIMEOUT for KV that never comes, and fails"
}

// The prefill leg is not capped: SGLang's prefill engine stops after the forward
// pass by itself, and the reference routers send it the client's body unchanged.
func (sglangKV) PrefillEdits(h *Handoff) []body.Edit { return bootstrapFields(h) }
func (sglangKV) DecodeEdits(h *Handoff) []body.Edit  { return bootstrapFields(h) }

// bootstrapFields are one host, port and room for the whole request (in a
// batch the engine adds each prompt's index to the room). Several samples of
// one prompt cannot be paired: SGLang's tokenizer manager gives every sample
// and its prefix-cache request the prompt's first room, so lists of rooms per
// sample, as SGLang's gateway sends them, are never read (docs/engines.md).
func bootstrapFields(h *Handoff) []body.Edit {
	return []body.Edit{
		body.Set("bootstrap_host", body.Quote(h.PrefillHost)),
		body.Set("bootstrap_port", body.Uint(uint64(h.BootstrapPort))),
		body.Set("bootstrap_room", body.Uint(h.Room)),
	}
}
