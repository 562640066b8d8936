package kv

import (
	"slices"
	"strconv"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// mooncakeKV drives vLLM's MooncakeConnector: both legs go out at once and
// meet on a transfer_id the router makes. The prefill leg, capped as for
// NIXL, asks the engine to keep the blocks for that id; the decode leg names
// the id, the prefill engine's bootstrap server and its engine id (one per
// data-parallel rank, from that server's GET /query: Handoff.EngineID), and
// pulls the blocks from there. The prefill answer hands nothing back. Without
// kv_transfer_params a Mooncake engine serves a request as any engine does,
// so requests may go decode-only.
type mooncakeKV struct{ vllmFamily }

func (mooncakeKV) Dispatch() Dispatch     { return Concurrent }
func (mooncakeKV) Paired() bool           { return false }
func (mooncakeKV) HandsBackParams() bool  { return false }
func (mooncakeKV) Rendezvous() Rendezvous { return MooncakeEngineIDs }

// RepeatedPull: MooncakeConnectorWorker.send_kv_to_decode, mooncake_connector.py @ 00f4240e.
func (mooncakeKV) RepeatedPull() string {
	return "the prefill engine forgets a transfer once sent: the decode engine waits VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT " +
		"(480 s by default) for it, then fails its load (or recomputes the prompt, under kv_load_failure_policy recompute)"
}

func (mooncakeKV) PrefillEdits(h *Handoff) []body.Edit {
	params := `{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":` + string(body.Quote(transferID(h))) + `}`
	return append(slices.Clip(h.Shape.Caps), transferParams(h.Shape, []byte(params)))
}

// DecodeEdits names all three keys the decode engine needs: with
// do_remote_prefill and one of them missing, vLLM's Mooncake scheduler
// waits for KV that it never asks for.
func (mooncakeKV) DecodeEdits(h *Handoff) []body.Edit {
	addr := "http://" + h.PrefillHost + ":" + strconv.Itoa(h.BootstrapPort)
	params := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_bootstrap_addr":` + string(body.Quote(addr)) +
		`,"remote_engine_id":` + string(body.Quote(h.EngineID)) + `,"transfer_id":` + string(body.Quote(transferID(h))) + `}`
	return []body.Edit{transferParams(h.Shape, []byte(params))}
}

// transferID is the request's transfer id, "xfer-" as vLLM's proxy begins
// it: unique among a prefill engine's transfers in flight as the room is
// random (a batch, whose prompts would share it, never goes P/D under a
// vLLM connector).
func transferID(h *Handoff) string { return "xfer-" + strconv.FormatUint(h.Room, 16) }
