package api

import (
	"bytes"
	"strconv"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// A vLLM prefill leg overwrites the request's output limit and its stream
// options (the Shape's Caps), so the prefill engine accepts a request whose
// limit or stream options the decode engine then refuses: it computes the
// prompt and keeps the blocks for a pull that never comes, until its lease
// ends. A client could pin the prefill engines' caches with a few long
// prompts so. Such a request goes to the decode engine alone, which answers
// it with its own 400. The checks read the fields as vLLM does; where they
// are stricter than vLLM, a request the engine takes only loses its
// prefill leg.

// chatAlone: vLLM's chat takes max_completion_tokens when it is set, else
// max_tokens (`request.max_completion_tokens if request.max_completion_tokens
// is not None else request.max_tokens`,
// vllm/entrypoints/openai/chat_completion/serving.py). Releases before took
// the first not 0: there a request with max_completion_tokens 0 and a valid
// max_tokens is served, and loses only its prefill leg here.
func chatAlone(o *body.Object) Reason {
	n, given, valid := limit(o, "max_completion_tokens", "max_tokens")
	if !valid || given && n < 1 || refusedMinTokens(o, n, given) || refusedStream(o) {
		return InvalidLimits
	}
	return orTruncation(o, orBeamSearch(o, promptLogprobs(o, "top_logprobs", true)))
}

// completionsAlone: vLLM's completions take max_tokens, 16 when it is left
// out or null (CompletionRequest's default, to which normalize_null_max_tokens
// turns a null; releases before it left a null to the context, where such a
// request only loses its prefill leg here), which may be 0 with echo: the
// prompt alone, sampled with a limit of 1 (echo_without_generation,
// vllm/entrypoints/openai/completion/protocol.py).
func completionsAlone(o *body.Object) Reason {
	n, given, valid := limitOr16(o, true)
	echo, _ := o.LaxBool("echo")
	echoOnly := echo && given && n == 0
	if !valid || given && n < 1 && !echoOnly || refusedMinTokens(o, max(n, 1), given) || refusedStream(o) {
		return InvalidLimits
	}
	return orTruncation(o, orBeamSearch(o, promptLogprobs(o, "logprobs", false)))
}

// orTruncation is why, else Truncation for a prompt cut to the context
// length less the output limit: truncate_prompt_tokens -1 (or any negative),
// read as pydantic reads an int ("-1" and -1.0 are -1).
func orTruncation(o *body.Object, why Reason) Reason {
	if n, ok := o.LaxInt("truncate_prompt_tokens"); why == NoReason && ok && n < 0 {
		return Truncation
	}
	return why
}

// orBeamSearch is why a chat or completions request that vLLM serves goes to
// a decode engine alone: its prompt logprobs (why), else its beam search
// (use_beam_search: to_beam_search_params, in the protocol files, and the
// beam search loop of vLLM's OpenAI serving, whose steps each run
// `SamplingParams(logprobs=2 * beam_width, max_tokens=1, ...)`, leave the
// request's kv_transfer_params out, so the decode engine computes the prompt
// itself and the prefill engine's blocks wait out their lease).
func orBeamSearch(o *body.Object, why Reason) Reason {
	if beam, _ := o.LaxBool("use_beam_search"); why == NoReason && beam {
		return BeamSearch
	}
	return why
}

// messagesAlone: the Messages API requires max_tokens (vLLM's
// AnthropicMessagesRequest, as Anthropic's API).
func messagesAlone(o *body.Object) Reason {
	if n, given, valid := limit(o, "max_tokens"); !valid || !given || n < 1 || refusedStreamFlag(o) {
		return InvalidLimits
	}
	return NoReason
}

// generateAlone: vLLM's token-in API requires sampling_params, its
// SamplingParams, whose max_tokens is 16 when left out and must be at least 1
// (GenerateRequest, vllm/entrypoints/serve/disagg/protocol.py).
func generateAlone(o *body.Object) Reason {
	sp, ok := o.Object("sampling_params")
	if !ok {
		return InvalidLimits
	}
	if n, given, valid := limitOr16(sp, false); !valid || given && n < 1 || refusedMinTokens(sp, n, given) || refusedStream(o) {
		return InvalidLimits
	}
	return generatePromptLogprobs(o)
}

// limitOr16 is limit's reading of max_tokens where the engine's model
// defaults it to 16: a key left out gives 16, and so does null where
// nullToo (else null leaves the limit to what the context holds).
func limitOr16(o *body.Object, nullToo bool) (n int64, given, valid bool) {
	if raw, ok := o.Raw("max_tokens"); !ok || nullToo && body.IsNull(raw) {
		return 16, true, true
	}
	return limit(o, "max_tokens")
}

// limit is the output limit keys give, as vLLM reads them: n is the first
// of keys present (not null), given false when none is; valid is false when
// a key present is not an integer (pydantic refuses it). vLLM refuses a
// limit below 1 (SamplingParams: "max_tokens must be at least 1").
func limit(o *body.Object, keys ...string) (n int64, given, valid bool) {
	for _, k := range keys {
		if !present(o, k) {
			continue
		}
		v, ok := o.LaxInt(k)
		if !ok {
			return 0, false, false
		}
		if !given {
			n, given = v, true
		}
	}
	return n, given, true
}

// refusedMinTokens reports whether vLLM refuses the request's min_tokens,
// which the prefill leg's caps overwrite with 1: an int that may be left out
// but not null, and SamplingParams refuse one below 0, or above the output
// limit when one is given ("min_tokens must be less than or equal to
// max_tokens"). Above a limit left to the context the engine refuses it
// too, which is not checked here: the context is the engine's to know.
func refusedMinTokens(o *body.Object, limit int64, given bool) bool {
	if _, ok := o.Raw("min_tokens"); !ok {
		return false
	}
	m, ok := o.LaxInt("min_tokens")
	return !ok || m < 0 || given && m > limit
}

// refusedStream reports whether vLLM's chat, completions or generate refuse
// the request's stream or stream_options, which the prefill leg's caps
// overwrite: refusedStreamFlag; stream_options without stream (`if
// data.get("stream_options") and not data.get("stream")`,
// validate_stream_options, on the raw JSON: Python's truth of each value);
// or stream_options that its StreamOptions model refuses (not an object, or
// include_usage or continuous_usage_stats not a bool: [], false, 5, "{}").
// Generate's GenerateRequest takes stream_options too; that it is checked
// alike is our assumption, at the cost of a prefill leg where it is not.
func refusedStream(o *body.Object) bool {
	if refusedStreamFlag(o) {
		return true
	}
	stream, _ := o.Raw("stream")
	options, given := o.Raw("stream_options")
	if !given || body.IsNull(options) {
		return false
	}
	parsed, ok := o.Object("stream_options")
	return !ok || refusedBool(parsed, "include_usage") || refusedBool(parsed, "continuous_usage_stats") ||
		truthy(options) && !truthy(stream)
}

// refusedStreamFlag reports whether vLLM refuses the request's stream: one
// that is neither a bool nor null ("maybe", 2, {}). This is all the Messages
// and Responses APIs check: their requests have no stream_options, and
// ignore one sent (AnthropicMessagesRequest; ResponsesRequest, whose
// OpenAIBaseModel ignores unknown fields).
func refusedStreamFlag(o *body.Object) bool { return refusedBool(o, "stream") }

// refusedBool reports whether pydantic refuses key's value as a bool | None:
// neither null nor a value LaxBool reads.
func refusedBool(o *body.Object, key string) bool {
	raw, _ := o.Raw(key)
	_, valid := body.LaxBool(raw)
	return !valid && len(raw) > 0 && !body.IsNull(raw)
}

// truthy is Python's truth of a JSON value (absent: None): false for null,
// false, a number equal to 0, "", [] and {}.
func truthy(raw []byte) bool {
	switch {
	case len(raw) == 0, body.IsNull(raw), string(raw) == "false", string(raw) == `""`:
		return false
	case raw[0] == '[' || raw[0] == '{':
		return len(bytes.TrimSpace(raw[1:len(raw)-1])) > 0
	case raw[0] == '-' || raw[0] >= '0' && raw[0] <= '9':
		f, err := strconv.ParseFloat(string(raw), 64)
		return err != nil || f != 0
	}
	return true
}

// ContextLimit is the output limit vLLM checks, with the prompt's tokens,
// against the model's context length before it runs a request
// (TokenizeParams, vllm/renderers/params.py @ 017638d7), and the key that
// gave it: chat's max_completion_tokens, else max_tokens (chatAlone); the
// max_tokens of completions (16 when left out or null) and of Messages,
// which vLLM runs as a chat request; the Responses API's max_output_tokens.
// None given is 0 and key "". ok is false for a limit that is not an
// integer (the request goes decode-only: InvalidLimits), and for other APIs:
// generate's engine stops at the context instead (docs/engines.md, API by
// API, item 10).
func (a *API) ContextLimit(o *body.Object) (key string, n int64, ok bool) {
	var keys []string
	switch a.Name { // by name: the table may hold a copy of a built-in API
	case NameChat:
		keys = []string{"max_completion_tokens", "max_tokens"}
	case NameCompletions:
		n, _, ok = limitOr16(o, true)
		return "max_tokens", n, ok
	case NameMessages:
		keys = []string{"max_tokens"}
	case NameResponses:
		keys = []string{"max_output_tokens"}
	default:
		return "", 0, false
	}
	for _, k := range keys {
		if present(o, k) {
			n, ok = o.LaxInt(k)
			return k, n, ok
		}
	}
	return "", 0, true
}
