package kv

import (
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// sharedStorageKV drives vLLM connectors that exchange KV through storage keyed by
// the prompt (ExampleConnector, LMCache): the prefill leg writes it, the decode leg
// with the same prompt reads it. Nothing about the handoff travels in the body.
type sharedStorageKV struct{ vllmFamily }

func (sharedStorageKV) Dispatch() Dispatch                  { return Sequential }
func (sharedStorageKV) Paired() bool                        { return false }
func (sharedStorageKV) HandsBackParams() bool               { return false }
func (sharedStorageKV) Rendezvous() Rendezvous              { return NoRendezvous }
func (sharedStorageKV) RepeatedPull() string                { return "" } // a read frees nothing
func (sharedStorageKV) PrefillEdits(h *Handoff) []body.Edit { return h.Shape.Caps }
func (sharedStorageKV) DecodeEdits(*Handoff) []body.Edit    { return nil }
