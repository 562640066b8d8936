package kv

import (
	"slices"
	"sync"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Reserved fields and headers: what a client could use to steer a handoff,
// or the engine's placement of a request, if it reached an engine
// (docs/architecture.md §Security rules, rule 1). Each engine family reads
// its own; the connector of the family removes them from every leg,
// decode-only and pass-through ones included, with every duplicate, before
// it adds its own. Where each comes from upstream is listed, with the file,
// in reserved_test.go.

// handoffKeys are both families' handoff fields at the top level: vLLM's
// kv_transfer_params, SGLang's bootstrap fields. Every connector removes all
// four, so that a body written for the other family's engines is harmless too.
var handoffKeys = []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"}

// sglangKeys are SGLang's other request fields that only a router sets: the
// pairing key and the decode side's tensor-parallel size of a handoff, the
// data-parallel rank a request is pinned to (and its deprecated spelling),
// the prefill rank that holds the KV, the request's id (rid: a client's
// could collide with another request's on the engines), and the router hint
// naming a peer to fetch a cached prefix from. They sit at the top level on
// chat, completions and generate alike.
var sglangKeys = []string{"bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank",
	"disagg_prefill_dp_rank", "rid", "kv_router_hint"}

// dataParallelRankHeader pins a request to one data-parallel rank of an
// engine, in vLLM and SGLang alike; pd-extproc never sets it.
const dataParallelRankHeader = "x-data-parallel-rank"

// sglangOverrideHeaders are SGLang's x-override-* headers: newer SGLang sets
// the request's fields from them (the bootstrap fields among them), so that a
// router can steer the engine without rewriting the body. pd-extproc is the
// router and rewrites the body; a client sending one would be steering the
// decode engine past it. The whole family goes: every one is a router's.
var sglangOverrideHeaders = []string{
	"x-override-rid", "x-override-bootstrap-host", "x-override-bootstrap-port", "x-override-bootstrap-room",
	"x-override-conversation-id", "x-override-routed-dp-rank", "x-override-disagg-prefill-dp-rank", "x-override-priority",
}

var (
	handoffEdits = deletes(handoffKeys)
	sglangEdits  = deletes(slices.Concat(handoffKeys, sglangKeys))
	vllmHeaders  = []string{dataParallelRankHeader}
	sglangHeader = append([]string{dataParallelRankHeader}, sglangOverrideHeaders...)
)

func deletes(keys []string) []body.Edit {
	edits := make([]body.Edit, len(keys))
	for i, k := range keys {
		edits[i] = body.Delete(k)
	}
	return edits
}

// vllmFamily is what the vLLM connectors share: their engines, and what a
// client may not set for them.
type vllmFamily struct{}

func (vllmFamily) Family() api.Family { return api.VLLM }

// extraArgsKeys are what vLLM's engine reads from a request's extra_args as
// a router's: the KV handoff (the connector reads it when the top level has
// none), the encoder cache's handoff, and the KV events' report mode, with
// which the engine publishes the blocks a request reuses as stored again (a
// view following the events would take them for copies and keep them past
// their eviction).
var extraArgsKeys = []string{"kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"}

// Reserved: the handoff fields, and extraArgsKeys inside the object the
// API's handler copies into the engine's extra_args (vllm_xargs).
func (vllmFamily) Reserved(s *api.Shape) []body.Edit {
	if s.ExtraArgs == nil {
		return handoffEdits
	}
	// The edits are built once per path: every leg asks, and the API table's
	// shapes share a few path slices.
	key := pathKey{&s.ExtraArgs[0], len(s.ExtraArgs)}
	if edits, ok := vllmEdits.Load(key); ok {
		return edits.([]body.Edit)
	}
	edits := slices.Clip(handoffEdits)
	for _, k := range extraArgsKeys {
		edits = append(edits, body.Delete(k).In(s.ExtraArgs...))
	}
	vllmEdits.Store(key, edits)
	return edits
}

// vllmEdits caches vllmFamily.Reserved by the path of extra_args.
var vllmEdits sync.Map // pathKey -> []body.Edit

// pathKey names a path slice: its array and length.
type pathKey struct {
	first *string
	n     int
}

func (vllmFamily) ReservedHeaders() []string { return vllmHeaders }

// sglangFamily is the same for SGLang's connector.
type sglangFamily struct{}

func (sglangFamily) Family() api.Family              { return api.SGLang }
func (sglangFamily) Reserved(*api.Shape) []body.Edit { return sglangEdits }
func (sglangFamily) ReservedHeaders() []string       { return sglangHeader }
