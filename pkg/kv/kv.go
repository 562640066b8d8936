// Package kv holds the KV transfer connectors selected at config time. A connector
// knows what one engine family needs for a prefill/decode handoff: the body
// edits of each leg, placed where the request's API wants them (api.Shape),
// whether the decode leg must wait for the prefill response (vLLM NIXL, shared
// storage) or both legs go out at once (SGLang, vLLM Mooncake), whether a
// request may skip the prefill, whether the prefill answer hands anything
// back, and what must be read of the prefill engines beforehand. Connectors
// are stateless and safe to share across requests.
package kv

import (
	"fmt"
	"slices"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Connector names, as users write them in the config's `connector` key.
const (
	NIXL          = "kv-nixl"
	SharedStorage = "kv-shared-storage"
	SGLang        = "kv-sglang"
	Mooncake      = "kv-mooncake"
)

// Dispatch is the order in which the two legs are sent.
type Dispatch int

const (
	// Sequential: the prefill leg completes first; its response feeds the decode body.
	Sequential Dispatch = iota
	// Concurrent: both legs go out at once; the engines pair up by themselves.
	Concurrent
)

// Rendezvous is what the decode leg needs to know of a prefill engine
// beyond its address, which the pools read from each prefill engine.
type Rendezvous int

const (
	// NoRendezvous: the address is enough.
	NoRendezvous Rendezvous = iota
	// SGLangBootstrapPort: the engine's bootstrap port, from its server info.
	SGLangBootstrapPort
	// MooncakeEngineIDs: the engine ids of its data-parallel ranks, from its
	// bootstrap server's GET /query.
	MooncakeEngineIDs
)

// Handoff is what a connector may read to build the legs of one request.
type Handoff struct {
	Body          *body.Object // the client's request body
	Shape         *api.Shape   // where the request's API puts the fields
	PrefillHost   string       // host of the chosen prefill endpoint (IPv6 in brackets)
	BootstrapPort int          // the chosen prefill endpoint's bootstrap port, SGLang's or Mooncake's (its own, else the pool's)
	Room          uint64       // random per request, 0..2^62-1 (a batch adds its prompts' indexes): pairs concurrent legs
	EngineID      string       // kv-mooncake: the chosen prefill engine's id, of the data-parallel rank its leg names
	PrefillKV     []byte       // Sequential only: raw kv_transfer_params of the prefill response, nil when it gave none
	Named         []body.Edit  // the router's own fields, set on every leg (a Responses request_id)
}

// Connector controls the wire shape of the prefill and decode requests, and
// says what its engines need of the flow around them: callers ask it, never
// its name.
type Connector interface {
	// Family is the engines it drives: the APIs they serve and can
	// disaggregate are theirs (pkg/api).
	Family() api.Family
	// Reserved removes, from a body of an API of shape s, every field its
	// engines read through which a client could steer a handoff
	// (reserved.go), with every duplicate: applied to every leg, before the
	// connector's own edits.
	Reserved(s *api.Shape) []body.Edit
	// ReservedHeaders are the request headers its engines read that only a
	// router may set (lower case): removed from the request Envoy forwards
	// to the decode engine. The prefill leg carries none of them.
	ReservedHeaders() []string
	// Dispatch is the order in which the two legs go out.
	Dispatch() Dispatch
	// Paired reports whether the engines serve only prefill/decode pairs: the
	// decode engine refuses a request without a prefill partner, so none may
	// go decode-only, and the pair hands off batches by itself.
	Paired() bool
	// Rendezvous is what the pools must read from each prefill engine for
	// the decode leg to find it.
	Rendezvous() Rendezvous
	// HandsBackParams reports whether the prefill answer carries the
	// kv_transfer_params the decode leg needs (Handoff.PrefillKV): an answer
	// without them means the decode engine recomputes the prompt.
	HandsBackParams() bool
	// RepeatedPull is what a second decode request carrying the decode
	// leg's transfer parameters meets (vLLM's Responses server sends one
	// per generation after a built-in tool call), "" when it finds the KV
	// as the first did.
	RepeatedPull() string
	// PrefillEdits turns the client's body into the prefill leg's body.
	PrefillEdits(h *Handoff) []body.Edit
	// DecodeEdits turns the client's body into the decode leg's body.
	DecodeEdits(h *Handoff) []body.Edit
}

// Build returns the connector for name. There is no default: the connector
// must match the engines' KV transfer, which only the operator knows.
func Build(name string) (Connector, error) {
	switch name {
	case NIXL:
		return nixlKV{}, nil
	case SharedStorage:
		return sharedStorageKV{}, nil
	case SGLang:
		return sglangKV{}, nil
	case Mooncake:
		return mooncakeKV{}, nil
	default:
		return nil, fmt.Errorf("unknown kv connector %q (want %s, %s, %s or %s)", name, NIXL, SharedStorage, SGLang, Mooncake)
	}
}

// PrefillBody returns the body of the prefill leg: the client's without the
// fields it may not set (Connector.Reserved), plus the router's (Named) and
// the connector's.
func PrefillBody(c Connector, h *Handoff) body.Spliced {
	return h.Body.Splice(slices.Concat(h.Named, c.Reserved(h.Shape), c.PrefillEdits(h))...)
}

// DecodeBody returns the body of the decode leg.
func DecodeBody(c Connector, h *Handoff) body.Spliced {
	return h.Body.Splice(slices.Concat(h.Named, c.Reserved(h.Shape), c.DecodeEdits(h))...)
}

// Scrubbed returns the client's body without the fields it may not set for
// c's engines, plus the router's own (named): the body of a request that
// goes to a decode endpoint alone.
func Scrubbed(c Connector, o *body.Object, s *api.Shape, named ...body.Edit) body.Spliced {
	return o.Splice(slices.Concat(named, c.Reserved(s))...)
}

// transferParams sets kv_transfer_params where the request's API reads it.
func transferParams(s *api.Shape, value []byte) body.Edit {
	return body.Set("kv_transfer_params", value).In(s.ParamsIn...)
}
