package pipeline_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/server/assemble"

	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// prefillKV is what the fake prefill engine hands back.
const prefillKV = `{"do_remote_prefill":true,"remote_block_ids":[[1]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"10.0.0.9","remote_port":5600}`

// newPipelineFor is a pipeline of connector whose one prefill endpoint is
// prefill, with more config keys; background legs end with the test.
func newPipelineFor(t *testing.T, connector, prefill, more string) *pipeline.Pipeline {
	t.Helper()
	cfg, err := config.Parse([]byte(fmt.Sprintf("connector: %s\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [\"10.1.1.1:8000\"]}}\n%s",
		connector, prefill, more)))
	if err != nil {
		t.Fatal(err)
	}
	p, err := assemble.Pipeline(cfg, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Wait()
		pipeline.CloseIdle(p)
	})
	return p
}

// TestAPITable routes a request of each API under each connector family and
// checks what the README's table promises: P/D (a prefill leg), decode-only
// with its reason (no prefill leg), or the client's error.
func TestAPITable(t *testing.T) {
	const chat = `{"model":"m","messages":[{"role":"user","content":"hi"}]`
	tests := []struct {
		name, connector, more string
		method, path, body    string         // body "" routes the headers alone
		wantStatus            int            // 0: routed
		wantMessage           string         // in the error, or in the decode body when routed
		wantReason            metrics.Reason // routed: the decision's reason
		wantPrefill           string         // routed P/D: the prefill leg's body, when it matters
	}{
		// vLLM connectors.
		{name: "chat", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `}`, wantReason: metrics.ReasonLongPrompt,
			wantMessage: `"kv_transfer_params":` + prefillKV},
		{name: "responses", connector: "kv-nixl", path: "/v1/responses", body: `{"input":"hi","stream":true}`, wantReason: metrics.ReasonLongPrompt,
			wantMessage: `"kv_transfer_params":` + prefillKV + `}`},
		{name: "responses continuing a stored one", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","previous_response_id":"resp_1"}`, wantReason: metrics.ReasonStoredResponse, wantMessage: `{"input":"hi","previous_response_id":"resp_1","request_id":"resp_pd`},
		{name: "responses in the background", connector: "kv-nixl", path: "/v1/responses", body: `{"input":"hi","background":true}`,
			wantReason: metrics.ReasonStoredResponse},
		{name: "responses in the background, as pydantic reads \"true\"", connector: "kv-nixl", path: "/v1/responses", body: `{"input":"hi","background":"true"}`,
			wantReason: metrics.ReasonStoredResponse},
		{name: "chat with n 2.0, which the engine reads as 2", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `,"n":2.0}`,
			wantReason: metrics.ReasonNGT1},
		{name: "responses with a built-in tool", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","tools":[{"type":"function","name":"f"},{"type":"web_search_preview"}]}`, wantReason: metrics.ReasonBuiltinTools},
		{name: "responses with a tool that is not an object, which the engine refuses", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","tools":[{"type":"function","name":"f"},5]}`, wantReason: metrics.ReasonBuiltinTools},
		{name: "responses with a null tool", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","tools":[null]}`, wantReason: metrics.ReasonBuiltinTools},
		{name: "responses with function tools", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","tools":[{"type":"function","name":"f"}]}`, wantReason: metrics.ReasonLongPrompt},
		{name: "responses with a built-in tool, paired by config", connector: "kv-shared-storage", more: "routes: {pair_builtin_tools: true}", path: "/v1/responses",
			body: `{"input":"hi","tools":[{"type":"code_interpreter"}]}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat without a model, which the engine serves by its own", connector: "kv-nixl", path: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"hi"}]}`, wantReason: metrics.ReasonLongPrompt},
		{name: "completions with a null model", connector: "kv-nixl", path: "/v1/completions", body: `{"model":null,"prompt":"hi"}`,
			wantReason: metrics.ReasonLongPrompt},
		{name: "generate, no model needed", connector: "kv-shared-storage", path: "/inference/v1/generate",
			body: `{"token_ids":[1,2],"sampling_params":{"max_tokens":9}}`, wantReason: metrics.ReasonLongPrompt,
			wantMessage: `{"token_ids":[1,2],"sampling_params":{"max_tokens":9}}`},
		{name: "generate hands the params back inside sampling_params", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1,2],"sampling_params":{"max_tokens":9},"kv_transfer_params":{"remote_host":"evil"}}`, wantReason: metrics.ReasonLongPrompt,
			wantMessage: `{"token_ids":[1,2],"sampling_params":{"max_tokens":9,"extra_args":{"kv_transfer_params":` + prefillKV + `}}}`},
		{name: "generate asking for prompt logprobs", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"prompt_logprobs":0}}`, wantReason: metrics.ReasonPromptLogprobs},
		{name: "generate scoring prompt rows for chosen token ids, without prompt_logprobs", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1,2],"sampling_params":{"prompt_logprob_token_ids":[7,9]}}`, wantReason: metrics.ReasonPromptLogprobs,
			wantMessage: `{"token_ids":[1,2],"sampling_params":{"prompt_logprob_token_ids":[7,9]}}`},
		{name: "generate with prompt_logprob_token_ids null", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"prompt_logprob_token_ids":null}}`, wantReason: metrics.ReasonLongPrompt},
		{name: "generate scoring prompt rows under kv-mooncake", connector: "kv-mooncake", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"prompt_logprob_token_ids":[7],"prompt_logprob_start":0}}`, wantReason: metrics.ReasonPromptLogprobs},
		{name: "generate with n > 1", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"n":2}}`, wantReason: metrics.ReasonNGT1},
		{name: "generate with max_tokens 0", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"max_tokens":0}}`, wantReason: metrics.ReasonInvalidLimits,
			wantMessage: `{"token_ids":[1],"sampling_params":{"max_tokens":0}}`},
		{name: "generate with max_tokens not an integer", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"max_tokens":[]}}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "generate with max_tokens null (the engine's default)", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"max_tokens":null}}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat asking for prompt logprobs", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `,"prompt_logprobs":1}`,
			wantReason: metrics.ReasonPromptLogprobs, wantMessage: `"prompt_logprobs":1}`},
		{name: "completions echo with logprobs", connector: "kv-nixl", path: "/v1/completions", body: `{"model":"m","prompt":"hi","echo":true,"logprobs":0}`,
			wantReason: metrics.ReasonPromptLogprobs},
		{name: "completions echo 1 with logprobs", connector: "kv-nixl", path: "/v1/completions", body: `{"model":"m","prompt":"hi","echo":1,"logprobs":1}`,
			wantReason: metrics.ReasonPromptLogprobs},
		{name: "completions echo without logprobs", connector: "kv-nixl", path: "/v1/completions", body: `{"model":"m","prompt":"hi","echo":true,"logprobs":null}`,
			wantReason: metrics.ReasonLongPrompt},
		// Output limits and stream options the engine refuses, which the prefill caps would overwrite.
		{name: "chat with max_tokens 0", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `,"max_tokens":0}`,
			wantReason: metrics.ReasonInvalidLimits, wantMessage: `"max_tokens":0}`},
		{name: "chat with max_tokens not an integer", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `,"max_tokens":"NaN"}`,
			wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with max_tokens past 64 bits", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `,"max_tokens":99999999999999999999999}`,
			wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with max_tokens 0 that max_completion_tokens overrides", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"max_tokens":0,"max_completion_tokens":5}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat with max_completion_tokens 0 and no max_tokens", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"max_completion_tokens":0}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with max_completion_tokens null and max_tokens 0", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"max_completion_tokens":null,"max_tokens":0}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with max_completion_tokens -1", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"max_completion_tokens":-1,"max_tokens":5}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with max_tokens \"8\", which pydantic reads as 8", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `,"max_tokens":"8"}`,
			wantReason: metrics.ReasonLongPrompt},
		{name: "chat with min_tokens above max_tokens", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `,"max_tokens":4,"min_tokens":5}`,
			wantReason: metrics.ReasonInvalidLimits, wantMessage: `"max_tokens":4,"min_tokens":5}`},
		{name: "chat with min_tokens equal to max_completion_tokens", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"max_completion_tokens":5,"min_tokens":5}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat with min_tokens and no limit (the engine's default)", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"min_tokens":50}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat with min_tokens -1", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `,"min_tokens":-1}`,
			wantReason: metrics.ReasonInvalidLimits},
		{name: "completions with min_tokens not an integer", connector: "kv-nixl", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","min_tokens":"x"}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "generate with min_tokens above max_tokens", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"max_tokens":2,"min_tokens":3}}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with min_tokens null, which vLLM's int refuses", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"min_tokens":null}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with max_tokens true, which pydantic reads as 1", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"max_tokens":true,"min_tokens":1}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat with min_tokens \"3.\", which pydantic refuses", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"min_tokens":"3."}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "completions with min_tokens above the default max_tokens of 16", connector: "kv-nixl", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","min_tokens":17}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "completions with min_tokens 16 and the default max_tokens", connector: "kv-nixl", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","min_tokens":16}`, wantReason: metrics.ReasonLongPrompt},
		{name: "completions with max_tokens null (16, as vLLM normalizes it) and min_tokens 17", connector: "kv-nixl", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","max_tokens":null,"min_tokens":17}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "generate with max_tokens null (the context's limit) and min_tokens 17", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"max_tokens":null,"min_tokens":17}}`, wantReason: metrics.ReasonLongPrompt},
		{name: "responses in the background as \"false\" with store false, which vLLM's raw check refuses", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","background":"false","store":false}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "responses with background \"false\" and store true", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","background":"false","store":true}`, wantReason: metrics.ReasonLongPrompt},
		{name: "responses with background false and store false", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","background":false,"store":false}`, wantReason: metrics.ReasonLongPrompt},
		{name: "completions echoing the prompt alone, min_tokens 1", connector: "kv-nixl", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","echo":true,"max_tokens":0,"min_tokens":1}`, wantReason: metrics.ReasonLongPrompt},
		{name: "completions echoing the prompt alone, min_tokens 2", connector: "kv-nixl", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","echo":true,"max_tokens":0,"min_tokens":2}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "generate with min_tokens above the default max_tokens of 16", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{"min_tokens":17}}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "generate without sampling_params, which vLLM requires", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1]}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "generate with sampling_params null", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":null}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "generate with the default max_tokens", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{}}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat with beam search, which hands no KV over", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"use_beam_search":true}`, wantReason: metrics.ReasonBeamSearch},
		{name: "completions with beam search \"on\"", connector: "kv-shared-storage", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","use_beam_search":"on"}`, wantReason: metrics.ReasonBeamSearch},
		// vLLM cuts such a prompt to the context length less the output
		// limit, which differs between the legs.
		{name: "chat cut by its output limit (truncate_prompt_tokens -1)", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"truncate_prompt_tokens":-1}`, wantReason: metrics.ReasonTruncation},
		{name: "completions cut by its output limit", connector: "kv-shared-storage", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","truncate_prompt_tokens":-1}`, wantReason: metrics.ReasonTruncation},
		{name: "chat cut to its last 8 tokens, alike on both legs", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"truncate_prompt_tokens":8}`, wantReason: metrics.ReasonLongPrompt},
		{name: "responses truncated auto", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","truncation":"auto"}`, wantReason: metrics.ReasonTruncation},
		{name: "responses truncation disabled", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","truncation":"disabled"}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat with beam search off", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"use_beam_search":false}`, wantReason: metrics.ReasonLongPrompt},
		{name: "sglang: chat with use_beam_search, which SGLang does not read", connector: "kv-sglang", path: "/v1/chat/completions",
			body: chat + `,"use_beam_search":true}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat with stream \"maybe\", which the prefill leg's caps would overwrite", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"stream":"maybe"}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with stream \"yes\", which pydantic reads as true", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"stream":"yes"}`, wantReason: metrics.ReasonLongPrompt},
		{name: "messages with stream 2", connector: "kv-nixl", path: "/v1/messages",
			body: `{"model":"m","max_tokens":8,"messages":[],"stream":2}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "responses with stream {}", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","stream":{}}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "generate with stream \"x\"", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{},"stream":"x"}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with stream_options, not streamed", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"stream":false,"stream_options":{"include_usage":true}}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "chat with empty stream_options, not streamed", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"stream_options":{ }}`, wantReason: metrics.ReasonLongPrompt},
		{name: "chat with stream_options, streamed", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"stream":true,"stream_options":{"include_usage":true}}`, wantReason: metrics.ReasonLongPrompt},
		{name: "messages with stream_options, not streamed, which vLLM ignores", connector: "kv-nixl", path: "/v1/messages",
			body: `{"model":"m","max_tokens":8,"messages":[],"stream_options":{"include_usage":true}}`, wantReason: metrics.ReasonLongPrompt},
		{name: "responses with stream_options, not streamed, which vLLM ignores", connector: "kv-nixl", path: "/v1/responses",
			body: `{"input":"hi","stream_options":{"include_obfuscation":false}}`, wantReason: metrics.ReasonLongPrompt},
		{name: "generate with stream_options, not streamed", connector: "kv-nixl", path: "/inference/v1/generate",
			body: `{"token_ids":[1],"sampling_params":{},"stream_options":{"include_usage":true}}`, wantReason: metrics.ReasonInvalidLimits},
		{name: "completions with max_tokens -5", connector: "kv-shared-storage", path: "/v1/completions", body: `{"model":"m","prompt":"hi","max_tokens":-5}`,
			wantReason: metrics.ReasonInvalidLimits},
		{name: "completions echoing the prompt alone (max_tokens 0), which vLLM takes", connector: "kv-nixl", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","echo":true,"max_tokens":0}`, wantReason: metrics.ReasonLongPrompt},
		{name: "completions with max_tokens null (vLLM's default limit)", connector: "kv-nixl", path: "/v1/completions", body: `{"model":"m","prompt":"hi","max_tokens":null}`,
			wantReason: metrics.ReasonLongPrompt},
		{name: "messages without max_tokens", connector: "kv-nixl", path: "/v1/messages", body: `{"model":"m","messages":[]}`,
			wantReason: metrics.ReasonInvalidLimits},
		{name: "responses with max_output_tokens 0", connector: "kv-nixl", path: "/v1/responses", body: `{"input":"hi","max_output_tokens":0}`,
			wantReason: metrics.ReasonInvalidLimits, wantMessage: `{"input":"hi","max_output_tokens":0,"request_id":"resp_pd`},
		{name: "responses with max_output_tokens not an integer", connector: "kv-nixl", path: "/v1/responses", body: `{"input":"hi","max_output_tokens":1.5}`,
			wantReason: metrics.ReasonInvalidLimits},
		{name: "responses with max_output_tokens 16", connector: "kv-nixl", path: "/v1/responses", body: `{"input":"hi","max_output_tokens":16}`,
			wantReason: metrics.ReasonLongPrompt},
		{name: "responses with max_output_tokens null (vLLM's default limit)", connector: "kv-nixl", path: "/v1/responses", body: `{"input":"hi","max_output_tokens":null}`,
			wantReason: metrics.ReasonLongPrompt},
		{name: "chat echo with logprobs off, which asks with top_logprobs' default of 0", connector: "kv-nixl", path: "/v1/chat/completions",
			body: chat + `,"echo":true,"logprobs":false}`, wantReason: metrics.ReasonPromptLogprobs},
		{name: "chat echo with top_logprobs null", connector: "kv-nixl", path: "/v1/chat/completions", body: chat + `,"echo":true,"top_logprobs":null}`,
			wantReason: metrics.ReasonLongPrompt},
		{name: "completions echo with logprobs false, which pydantic reads as 0", connector: "kv-nixl", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","echo":true,"logprobs":false}`, wantReason: metrics.ReasonPromptLogprobs},
		{name: "sglang: chat with echo and logprobs, which SGLang's chat ignores", connector: "kv-sglang", path: "/v1/chat/completions",
			body: chat + `,"echo":true,"logprobs":true,"prompt_logprobs":1}`, wantReason: metrics.ReasonLongPrompt},
		{name: "sglang: completions echo with logprobs 0", connector: "kv-sglang", path: "/v1/completions",
			body: `{"model":"m","prompt":"hi","echo":true,"logprobs":0,"prompt_logprobs":1}`, wantReason: metrics.ReasonLongPrompt},
		{name: "messages", connector: "kv-nixl", path: "/v1/messages", body: `{"model":"m","max_tokens":8,"messages":[],"stream":true,"kv_transfer_params":{}}`,
			wantReason: metrics.ReasonLongPrompt, wantMessage: `{"model":"m","max_tokens":8,"messages":[],"stream":true,"kv_transfer_params":` + prefillKV + `}`,
			wantPrefill: `{"model":"m","max_tokens":1,"messages":[],"stream":false,"kv_transfer_params":{"do_remote_decode":true,` +
				`"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`},
		{name: "messages, decode-only by config", connector: "kv-nixl", more: "routes: {messages_decode_only: true}", path: "/v1/messages",
			body: `{"model":"m","max_tokens":8,"messages":[],"kv_transfer_params":{}}`, wantReason: metrics.ReasonUnpairedAPI,
			wantMessage: `{"model":"m","max_tokens":8,"messages":[]}`},
		{name: "responses, decode-only by config", connector: "kv-nixl", more: "routes: {responses_decode_only: true}", path: "/v1/responses",
			body: `{"input":"hi","kv_transfer_params":{}}`, wantReason: metrics.ReasonUnpairedAPI, wantMessage: `{"input":"hi"}`},
		{name: "messages under shared storage", connector: "kv-shared-storage", path: "/v1/messages", body: `{"model":"m","max_tokens":8,"messages":[]}`,
			wantReason: metrics.ReasonLongPrompt, wantPrefill: `{"model":"m","max_tokens":1,"messages":[],"stream":false}`},
		{name: "SGLang's generate", connector: "kv-nixl", path: "/generate", body: `{"text":"hi"}`, wantStatus: 404,
			wantMessage: "POST /generate is an API of SGLang engines; connector kv-nixl drives vLLM engines"},
		// The pass-through list and its boundary.
		{name: "pass-through, scrubbed", connector: "kv-nixl", path: "/v1/embeddings?x=1", body: `{"model":"m","input":"hi","bootstrap_room":1,"kv_transfer_params":{}}`,
			wantReason: metrics.ReasonPassthrough, wantMessage: `{"model":"m","input":"hi"}`},
		{name: "pass-through without a model", connector: "kv-nixl", path: "/tokenize", body: `{"prompt":"hi"}`, wantReason: metrics.ReasonPassthrough},
		{name: "pass-through with a model too long", connector: "kv-nixl", path: "/tokenize", body: `{"model":"` + strings.Repeat("m", 1025) + `"}`,
			wantStatus: 400, wantMessage: "model names are at most 1024"},
		{name: "pass-through headers", connector: "kv-nixl", method: "GET", path: "/v1/models", wantReason: metrics.ReasonNoBody},
		{name: "a stored response", connector: "kv-nixl", method: "GET", path: "/v1/responses/resp_1?stream=true", wantReason: metrics.ReasonNoBody},
		{name: "deleting a stored response", connector: "kv-nixl", method: "DELETE", path: "/v1/responses/resp_1", wantReason: metrics.ReasonNoBody},
		{name: "a method the path does not take", connector: "kv-nixl", method: "POST", path: "/v1/models", body: `{}`, wantStatus: 404,
			wantMessage: "POST /v1/models is not routed; this path takes GET"},
		{name: "a built-in API without a body", connector: "kv-nixl", path: "/v1/chat/completions", wantStatus: 400, wantMessage: "needs a JSON body"},
		{name: "a built-in API by another method", connector: "kv-nixl", method: "GET", path: "/v1/chat/completions", wantStatus: 404,
			wantMessage: "this path takes POST"},
		{name: "an admin path with a body", connector: "kv-nixl", path: "/flush_cache", body: `{}`, wantStatus: 404, wantMessage: `unknown path "/flush_cache"`},
		{name: "an admin path without a body", connector: "kv-nixl", method: "GET", path: "/start_profile", wantStatus: 404, wantMessage: "unknown path"},
		{name: "a dot segment", connector: "kv-nixl", method: "GET", path: "/v1/responses/../../collective_rpc", wantStatus: 404, wantMessage: "is refused"},
		{name: "an empty segment", connector: "kv-nixl", path: "/v1//embeddings", body: `{}`, wantStatus: 404, wantMessage: "is refused"},
		{name: "an encoded slash", connector: "kv-nixl", method: "GET", path: "/v1/responses/x%2F..%2Fsleep", wantStatus: 404, wantMessage: "is refused"},
		{name: "a prefix entry needs something below it", connector: "kv-nixl", method: "GET", path: "/v1/responses/", wantStatus: 404},
		{name: "a list of the user's replaces the defaults", connector: "kv-nixl", more: `routes: {passthrough: ["GET /health"]}`,
			path: "/v1/embeddings", body: `{}`, wantStatus: 404, wantMessage: "unknown path"},
		// kv-sglang: nothing can go to a decode engine alone but the pass-through list.
		{name: "sglang: chat", connector: "kv-sglang", path: "/v1/chat/completions", body: chat + `}`, wantReason: metrics.ReasonLongPrompt,
			wantMessage: `"bootstrap_room":`},
		{name: "sglang: generate", connector: "kv-sglang", path: "/generate", body: `{"input_ids":[1,2],"bootstrap_room":3}`,
			wantReason: metrics.ReasonLongPrompt, wantMessage: `"bootstrap_port":8998`},
		{name: "sglang: a batch with n = 1 shares one room", connector: "kv-sglang", path: "/v1/completions", body: `{"model":"m","prompt":["a","b"]}`,
			wantReason: metrics.ReasonLongPrompt, wantMessage: `"bootstrap_host":"127.0.0.1"`},
		{name: "sglang: responses", connector: "kv-sglang", path: "/v1/responses", body: `{"input":"hi"}`, wantStatus: 400,
			wantMessage: "kv-sglang cannot serve POST /v1/responses: SGLang's handler for it does not pass bootstrap_host"},
		{name: "sglang: messages", connector: "kv-sglang", path: "/v1/messages", body: `{"model":"m","messages":[]}`, wantStatus: 400,
			wantMessage: "kv-sglang cannot serve POST /v1/messages"},
		{name: "sglang: vLLM's generate", connector: "kv-sglang", path: "/inference/v1/generate", body: `{"token_ids":[1]}`, wantStatus: 404,
			wantMessage: "is an API of vLLM engines"},
		{name: "sglang: prompt logprobs", connector: "kv-sglang", path: "/v1/completions", body: `{"model":"m","prompt":"hi","echo":true,"logprobs":1}`,
			wantStatus: 400, wantMessage: "asks for prompt logprobs, which only the prefill engine computes; SGLang's own gateway merges " +
				"the prefill answer's input_token_logprobs into the decode answer, pd-extproc does not"},
		{name: "sglang: generate's prompt logprobs", connector: "kv-sglang", path: "/generate", body: `{"text":"hi","return_logprob":true,"logprob_start_len":0}`,
			wantStatus: 400, wantMessage: "asks for prompt logprobs"},
		{name: "sglang: a batch's output logprobs", connector: "kv-sglang", path: "/generate",
			body: `{"text":["hi","ho"],"return_logprob":[false,true],"logprob_start_len":[0,-1]}`, wantReason: metrics.ReasonLongPrompt},
		{name: "sglang: a batch's prompt logprobs for one prompt", connector: "kv-sglang", path: "/generate",
			body: `{"text":["hi","ho"],"return_logprob":[false,true],"logprob_start_len":0}`, wantStatus: 400, wantMessage: "asks for prompt logprobs"},
		{name: "sglang: generate's return_logprob 0, which pydantic reads as false", connector: "kv-sglang", path: "/generate",
			body: `{"text":"hi","return_logprob":0,"logprob_start_len":0}`, wantReason: metrics.ReasonLongPrompt},
		{name: "sglang: generate's return_logprob \"no\"", connector: "kv-sglang", path: "/generate",
			body: `{"text":"hi","return_logprob":"no","logprob_start_len":0}`, wantReason: metrics.ReasonLongPrompt},
		{name: "sglang: generate's logprob_start_len \"-1\", output logprobs only", connector: "kv-sglang", path: "/generate",
			body: `{"text":"hi","return_logprob":true,"logprob_start_len":"-1"}`, wantReason: metrics.ReasonLongPrompt},
		{name: "sglang: generate's return_logprob 1 from 0.0", connector: "kv-sglang", path: "/generate",
			body: `{"text":"hi","return_logprob":1,"logprob_start_len":0.0}`, wantStatus: 400, wantMessage: "asks for prompt logprobs"},
		{name: "sglang: generate's output logprobs", connector: "kv-sglang", path: "/generate", body: `{"text":"hi","return_logprob":true,"logprob_start_len":-1}`,
			wantReason: metrics.ReasonLongPrompt},
		{name: "sglang: chat with max_tokens 0 stays paired (both legs are the client's body, which both engines refuse)", connector: "kv-sglang",
			path: "/v1/chat/completions", body: chat + `,"max_tokens":0}`, wantReason: metrics.ReasonLongPrompt},
		{name: "sglang: n > 1 is refused", connector: "kv-sglang", path: "/v1/chat/completions", body: chat + `,"n":2}`, wantStatus: 400,
			wantMessage: "kv-sglang cannot pair several samples"},
		{name: "sglang: n \"2\" is refused", connector: "kv-sglang", path: "/v1/chat/completions", body: chat + `,"n":"2"}`, wantStatus: 400,
			wantMessage: "kv-sglang cannot pair several samples"},
		{name: "sglang: prompt logprobs with echo \"yes\"", connector: "kv-sglang", path: "/v1/completions", body: `{"model":"m","prompt":"hi","echo":"yes","logprobs":1}`,
			wantStatus: 400, wantMessage: "asks for prompt logprobs"},
		{name: "sglang: generate's n > 1 is refused", connector: "kv-sglang", path: "/generate", body: `{"text":"hi","sampling_params":{"n":3}}`,
			wantStatus: 400, wantMessage: "n is 3"},
		{name: "sglang: n > 1 in a list of sampling_params is refused", connector: "kv-sglang", path: "/generate",
			body: `{"text":["hi","ho"],"sampling_params":[{"n":2},{"n":2}]}`, wantStatus: 400, wantMessage: "n is 2"},
		{name: "sglang: a list of sampling_params whose n differ is refused, saying so", connector: "kv-sglang", path: "/generate",
			body: `{"text":["hi","ho","hu"],"sampling_params":[{"n":1},{},{"n":2}]}`, wantStatus: 400,
			wantMessage: "sampling_params[2] has n 2 and sampling_params[0] has n 1: SGLang takes n from the first entry and refuses a list whose n values differ"},
		{name: "sglang: pass-through", connector: "kv-sglang", path: "/v1/tokenize", body: `{"model":"m","prompt":"hi","bootstrap_room":1}`,
			wantReason: metrics.ReasonPassthrough, wantMessage: `{"model":"m","prompt":"hi"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			engine := enginetest.Start(t, enginetest.JSON(200, `{"kv_transfer_params":`+prefillKV+`}`))
			p := newPipelineFor(t, tt.connector, engine.Addr(), tt.more)
			method := tt.method
			if method == "" {
				method = http.MethodPost
			}
			r := &pipeline.Request{ContentType: "application/json", Method: method, Path: tt.path, RequestID: "r1"}
			var d *pipeline.Decision
			var err error
			if tt.body == "" {
				d, err = p.RouteHeaders(r)
			} else {
				r.Body = []byte(tt.body)
				d, err = p.Route(context.Background(), r)
			}
			if tt.wantStatus != 0 {
				if err == nil {
					t.Fatalf("routed, want status %d with %q", tt.wantStatus, tt.wantMessage)
				}
				if e := pipeline.AsError(err, "r"); e.Status != tt.wantStatus || !strings.Contains(e.Message, tt.wantMessage) {
					t.Fatalf("error %v, want status %d with %q", err, tt.wantStatus, tt.wantMessage)
				}
				if r.Report.Prefill != "" || len(engine.Requests()) != 0 {
					t.Errorf("a refused request reached the prefill engine")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer d.Release()
			if r.Report.Reason != tt.wantReason {
				t.Errorf("reason %q, want %q", r.Report.Reason, tt.wantReason)
			}
			pd := r.Report.Mode == metrics.ModePD
			if pd != (tt.wantReason == metrics.ReasonLongPrompt) || pd != (r.Report.Prefill != "") {
				t.Errorf("mode %q with prefill %q for reason %q", r.Report.Mode, r.Report.Prefill, r.Report.Reason)
			}
			if tt.connector != "kv-sglang" && !pd && len(engine.Requests()) != 0 {
				t.Errorf("a decode-only request reached the prefill engine: %s", engine.Requests()[0].Body)
			}
			if reqs := engine.Requests(); tt.wantPrefill != "" && (len(reqs) != 1 || string(reqs[0].Body) != tt.wantPrefill) {
				t.Errorf("prefill legs %+v, want one with\n%s", reqs, tt.wantPrefill)
			}
			if got := string(d.Body.Bytes()); !strings.Contains(got, tt.wantMessage) {
				t.Errorf("decode body %s, want it to contain %s", got, tt.wantMessage)
			}
		})
	}
}
