// Package kvevents keeps a view of what each engine's prefix cache holds, from
// the KV cache events the engines publish (vLLM's --kv-events-config): every
// block stored and removed, over ZeroMQ, each batch msgpack-encoded. It
// subscribes to the engines (Subscriber), checks every publisher's sequence
// numbers and asks its replay socket for what it missed, and indexes the
// blocks (Index) by a chain hash of their token ids, its own, so that a
// request's token ids find the engines holding its longest cached prefix.
// vLLM's own block hash (its serialization of the tokens and extra keys,
// and a seed of its hash algorithm's) is not reproduced; the events carry
// the tokens, and the engine's hashes are kept only to resolve removals.
//
// It knows nothing of pools or policies: scheduling feeds it the endpoints to
// follow and reads Lookup.
package kvevents
