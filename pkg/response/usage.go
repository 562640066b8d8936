// Package response rewrites the decode engine's answer on its way back to the
// client, for what the engines report wrongly under P/D. Today that is one
// number: the prompt tokens found cached. A decode engine counts the KV it
// pulled from the prefill engine as cached (vllm-project/router issue #193:
// cached_tokens equals prompt_tokens), or reports a placeholder; vLLM's own
// router (src/routers/http/logprobs_merge.rs) and llm-d's sidecar
// (pkg/sidecar/proxy/cached_tokens_usage_rewriter.go) replace it with the
// prefill engine's value, and so does this package.
//
// Everything else passes byte for byte: a JSON answer is held whole and one
// number spliced into it; a stream of server-sent events is passed on event by
// event as it comes, holding back only an event cut across chunks. The package
// knows nothing of Envoy: the handlers feed it the chunks Envoy sends.
package response

import "github.com/pd-extproc/pd-extproc/pkg/metrics"

// cachedTokens is where each API's answer reports the prompt tokens found in
// the engine's cache, for the APIs whose usage is rewritten. The prefill
// answer carries the number at the same place: it is the same API.
//
// Other APIs would join with their own path: the Responses API reports it at
// usage.input_tokens_details.cached_tokens (streamed only in the final
// response.completed event, inside "response"), and vLLM's token-in generate
// API has no usage object to rewrite.
var cachedTokens = map[string][]string{
	metrics.APIChat:        {"usage", "prompt_tokens_details", "cached_tokens"},
	metrics.APICompletions: {"usage", "prompt_tokens_details", "cached_tokens"},
}

// CachedTokensPath is where the answers of api (a metrics.API* value) report
// the prompt tokens found cached; nil when they are not rewritten.
func CachedTokensPath(api string) []string { return cachedTokens[api] }
