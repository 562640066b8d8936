// Package response rewrites the decode engine's answer on its way back to the
// client, for what the engines report wrongly under P/D. Today that is the
// prompt tokens found cached. A decode engine counts the KV it
// pulled from the prefill engine as cached (vllm-project/router issue #193:
// cached_tokens equals prompt_tokens), or reports a placeholder; vLLM's own
// router (src/routers/http/logprobs_merge.rs) and llm-d's sidecar
// (pkg/sidecar/proxy/cached_tokens_usage_rewriter.go) replace it with the
// prefill engine's value, and so does this package, at the place the API
// table names (api.Shape.CachedTokens), with the count of the tokens not
// cached where the API gives it beside them (Anthropic's input_tokens).
//
// Everything else passes byte for byte: a JSON answer is held whole and the
// numbers spliced into it; a stream of server-sent events is passed on event
// by event as it comes, holding back only an event cut across chunks. The
// package knows nothing of Envoy: the handlers feed it the chunks Envoy sends.
package response
