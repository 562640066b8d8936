package api

import (
	"iter"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Shape is where a KV handoff sits in an API's body.
type Shape struct {
	// Caps make a vLLM prefill leg compute the prompt and stop after one
	// token, non-streamed (only a non-streamed answer carries
	// kv_transfer_params). SGLang's prefill engine stops by itself.
	Caps []body.Edit
	// ParamsIn is the object vLLM reads kv_transfer_params from: nil for
	// the top level. The answer always carries it at the top level.
	ParamsIn []string
	// ExtraArgs is the object whose members vLLM's handler for the API copies
	// into the engine's extra_args, where its connectors read
	// kv_transfer_params when the top level has none: a vLLM connector
	// removes the client's there too (pkg/kv owns which keys each connector
	// reserves; the shape says only where they sit). Nil: the API has none.
	// SGLang's reserved fields sit at the top level of every API it serves.
	ExtraArgs []string
	// CachedTokens is where the API's answer reports the prompt tokens found
	// in the engine's cache, the number response.rewrite_usage corrects (a
	// decode engine counts the KV it pulled as cached: vllm-project/router
	// issue #193); the prefill answer, being of the same API and not
	// streamed, carries the true one there. Nil: the usage is not
	// rewritten. CachedTokensInEvents is where a streamed answer's events
	// carry it, when elsewhere (the Responses API's response.completed).
	CachedTokens, CachedTokensInEvents []string
	// UncachedTokens is where the answer reports the prompt tokens not found
	// cached, when that number leaves out CachedTokens' and so must be
	// rewritten with it (Anthropic's input_tokens); in the answer and its
	// events alike. Nil: the prompt tokens are reported whole.
	UncachedTokens []string
}

// vllmXargs: vLLM's OpenAI requests copy vllm_xargs into the engine's
// extra_args, where the connector reads kv_transfer_params when the top
// level has none (chat_completion/protocol.py, to_sampling_params). Its
// values may only be strings and numbers, which no connector expects.
var vllmXargs = []string{"vllm_xargs"}

// extraArgs is where vLLM's token-in generate passes kv_transfer_params on:
// its handler hands the engine only sampling_params (serve/disagg/serving.py).
var extraArgs = []string{"sampling_params", "extra_args"}

var (
	// openAIShape: chat and completions, as vLLM's toy proxy builds them.
	openAIShape = Shape{
		Caps: []body.Edit{
			body.Set("stream", body.False),
			body.Delete("stream_options"), // vLLM refuses stream_options without stream
			body.Set("max_tokens", body.One),
			body.SetIfPresent("max_completion_tokens", body.One), // chat prefers it over max_tokens
			// The one token is never a stop token: an older NixlConnector hands
			// out the KV only for an answer cut by its length (llm-d and vLLM's
			// router set it too), and vLLM refuses min_tokens > max_tokens.
			body.Set("min_tokens", body.One),
			body.Delete("min_completion_tokens"),
		},
		ExtraArgs:    vllmXargs,
		CachedTokens: []string{"usage", "prompt_tokens_details", "cached_tokens"},
	}
	// responsesShape: the same caps in the Responses API's words; the
	// prefill engine must neither keep the response nor run it in the
	// background. Its request has no min_tokens, but ignore_eos, which it
	// passes to SamplingParams: the EOS token then neither stops the answer
	// nor joins stop_token_ids, so the one token is cut by its length, as
	// min_tokens makes it on chat (ResponsesRequest.to_sampling_params,
	// vllm/entrypoints/openai/responses/protocol.py; check_stop,
	// vllm/v1/core/sched/utils.py @ 018d5dc7).
	responsesShape = Shape{
		Caps: []body.Edit{
			body.Set("stream", body.False),
			body.Delete("stream_options"),
			body.Set("max_output_tokens", body.One),
			body.Set("store", body.False),
			body.Set("background", body.False),
			body.Set("ignore_eos", body.True),
		},
		ExtraArgs:            vllmXargs,
		CachedTokens:         []string{"usage", "input_tokens_details", "cached_tokens"},
		CachedTokensInEvents: []string{"response", "usage", "input_tokens_details", "cached_tokens"},
	}
	// messagesShape: Anthropic's Messages API, whose max_tokens vLLM also
	// makes the chat request's max_completion_tokens. Its request has no
	// vllm_xargs, nor min_tokens or ignore_eos: a one-token leg whose token
	// is a stop token gets no kv_transfer_params from an older NixlConnector
	// (docs/engines.md). Since vllm-project/vllm#40912 its usage states the cached
	// tokens as cache_read_input_tokens, and input_tokens the rest of the
	// prompt (cache_creation_input_tokens is always 0), where the engine
	// states them: in a whole answer, and in a stream's message_delta event.
	messagesShape = Shape{
		Caps: []body.Edit{
			body.Set("stream", body.False),
			body.Set("max_tokens", body.One),
		},
		CachedTokens:   []string{"usage", "cache_read_input_tokens"},
		UncachedTokens: []string{"usage", "input_tokens"},
	}
	// generateShape: vLLM's token-in API has the limits in sampling_params.
	generateShape = Shape{
		Caps: []body.Edit{
			body.Set("stream", body.False),
			body.Delete("stream_options"),
			body.Set("max_tokens", body.One).In("sampling_params"),
			body.Set("min_tokens", body.One).In("sampling_params"),
		},
		ParamsIn:     extraArgs,
		ExtraArgs:    extraArgs,
		CachedTokens: []string{"usage", "prompt_tokens_details", "cached_tokens"}, // GenerateResponse's UsageInfo
	}
	// topLevelShape: SGLang's native generate and the pass-through list.
	topLevelShape = Shape{}
)

// promptLogprobs: vLLM's chat and completions ask for the prompt's
// logprobs with prompt_logprobs or, with echo, with what stands in for it
// (`if prompt_logprobs is None and self.echo: prompt_logprobs = ...`,
// to_sampling_params): chat's top_logprobs, which is 0 when left out, and
// completions' logprobs, none when left out (false is 0, still asking).
func promptLogprobs(o *body.Object, echoKey string, byDefault bool) Reason {
	if present(o, "prompt_logprobs") {
		return PromptLogprobs
	}
	if echo, _ := o.LaxBool("echo"); echo {
		if raw, ok := o.Raw(echoKey); ok && !body.IsNull(raw) || !ok && byDefault {
			return PromptLogprobs
		}
	}
	return NoReason
}

// sglangChatAlone: SGLang's chat has neither echo nor prompt_logprobs, and
// asks for the output's logprobs only (logprob_start_len -1,
// serving_chat.py): nothing keeps it from its pair.
func sglangChatAlone(*body.Object) Reason { return NoReason }

// sglangCompletionsAlone: SGLang's completions ask for the prompt's logprobs
// with echo and a logprobs count not 0 (`if request.echo and
// request.logprobs`: logprob_start_len 0); its later releases only warn
// that they are not computed, and lose nothing by the refusal but the
// request. prompt_logprobs is not a field of theirs.
func sglangCompletionsAlone(o *body.Object) Reason {
	echo, _ := o.LaxBool("echo")
	if n, ok := o.LaxInt("logprobs"); echo && ok && n != 0 {
		return PromptLogprobs
	}
	return NoReason
}

// generatePromptLogprobs: vLLM's generate asks in sampling_params, which is
// the engine's SamplingParams as it is: with prompt_logprobs, or with
// prompt_logprob_token_ids, which scores the prompt's rows for those ids
// without prompt_logprobs (SamplingParams in vllm/sampling_params.py @
// 00388f65; its skip_reading_prefix_cache reads either).
func generatePromptLogprobs(o *body.Object) Reason {
	if sp, ok := o.Object("sampling_params"); ok && (present(sp, "prompt_logprobs") || present(sp, "prompt_logprob_token_ids")) {
		return PromptLogprobs
	}
	return NoReason
}

// sglangPromptLogprobs: SGLang's generate returns the prompt's logprobs with
// return_logprob from logprob_start_len on; a negative start means the
// output only. A batch may give either per prompt, as a list
// (GenerateReqInput, io_struct.py): it asks when any prompt does.
func sglangPromptLogprobs(o *body.Object) Reason {
	if !present(o, "return_logprob") || !present(o, "logprob_start_len") {
		return NoReason
	}
	ret, _ := o.Raw("return_logprob")
	start, _ := o.Raw("logprob_start_len")
	nextRet, stopRet := iter.Pull(perPrompt(ret))
	defer stopRet()
	nextStart, stopStart := iter.Pull(perPrompt(start))
	defer stopStart()
	for {
		// A shorter list's last value goes on for the prompts after it.
		r, moreRets := nextRet()
		s, moreStarts := nextStart()
		if !moreRets && !moreStarts {
			return NoReason
		}
		if moreRets {
			ret = r
		}
		if moreStarts {
			start = s
		}
		// Read as the dataclass's fields are when FastAPI validates it with
		// pydantic: "return_logprob": 0 is false, "logprob_start_len": "-1" is -1.
		ask, askOK := body.LaxBool(ret)
		from, fromOK := body.LaxInt(start)
		if (ask || !askOK) && (from >= 0 || !fromOK) {
			return PromptLogprobs
		}
	}
}

// perPrompt is a field's value for each prompt of a batch: a list's
// elements, or the one value for all.
func perPrompt(raw []byte) iter.Seq[[]byte] {
	return func(yield func([]byte) bool) {
		none := true
		for item := range body.Items(raw) {
			if none = false; !yield(item) {
				return
			}
		}
		if none {
			yield(raw)
		}
	}
}

// responsesAlone: a Responses request that continues a stored response or
// runs in the background needs the engine that stores it; one with a
// built-in tool may run several generations in one request
// (_generate_with_builtin_tools in vLLM's Responses server). A tool that is
// not an object, which the engine refuses, goes to it alone too.
func responsesAlone(o *body.Object) Reason {
	if present(o, "previous_response_id") {
		return StoredResponse
	}
	if bg, _ := o.LaxBool("background"); bg {
		return StoredResponse
	}
	// vLLM's validate_background tests the raw values, before pydantic
	// reads them: "background": "false" with store false is refused
	// ("background can only be used when `store` is true"), though the
	// prefill leg's caps would make it valid. A null store was refused too
	// until vLLM read it as its default.
	if background, _ := o.Raw("background"); truthy(background) {
		if store, ok := o.Raw("store"); ok && !truthy(store) {
			return InvalidLimits
		}
	}
	// vLLM's ResponsesRequest.to_sampling_params takes min(max_output_tokens,
	// the default), and SamplingParams refuses a limit below 1 (limits.go);
	// store and background, which the caps set false, are bool | None.
	if n, given, valid := limit(o, "max_output_tokens"); !valid || given && n < 1 || refusedStreamFlag(o) ||
		refusedBool(o, "store") || refusedBool(o, "background") {
		return InvalidLimits
	}
	if t, _ := o.String("truncation"); t == "auto" {
		return Truncation
	}
	raw, _ := o.Raw("tools")
	for item := range body.Items(raw) {
		t, err := body.Parse(item)
		if err != nil {
			return BuiltinTools
		}
		if kind, _ := t.String("type"); kind != "function" {
			return BuiltinTools
		}
	}
	return NoReason
}

// present reports whether key is there and not null (pydantic's None).
func present(o *body.Object, key string) bool {
	raw, ok := o.Raw(key)
	return ok && !body.IsNull(raw)
}
