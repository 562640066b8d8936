// Package api is the table of the engine APIs pd-extproc routes: for each
// one its method and path, which engine families serve it and which can
// disaggregate it, whether the engine needs "model", how its prompt is read
// for scheduling, where a connector's fields go in its body, which fields a
// client may not set, and its metrics label. The pipeline routes by it and
// the metrics take their api labels from it. The engine facts behind each
// entry, with their upstream sources, are in the README's API table.
//
// Everything else a deployment lets through is the pass-through list
// (routes.go): routed to a decode engine alone, after the same scrub.
package api

import (
	"strings"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// Family is a set of engine families: those that serve an API, or those
// under which it can be disaggregated. A connector drives one family.
type Family uint8

// Engine families.
const (
	VLLM Family = 1 << iota
	SGLang
)

// Has reports whether f includes g.
func (f Family) Has(g Family) bool { return f&g != 0 }

func (f Family) String() string {
	switch f {
	case VLLM:
		return "vLLM"
	case SGLang:
		return "SGLang"
	}
	return "vLLM and SGLang"
}

// Reason is why one request of an API that can be disaggregated goes to a
// decode engine alone.
type Reason uint8

// Why a request is not disaggregated.
const (
	NoReason Reason = iota
	// PromptLogprobs: the request asks for the prompt's logprobs, which only
	// the engine that computed the prompt has.
	PromptLogprobs
	// StoredResponse: the request reads or makes a response the engine
	// stores (a background run, a previous_response_id); the prefill engine
	// never stores one.
	StoredResponse
	// BuiltinTools: a Responses request with a tool other than a function
	// (web search, code interpreter, MCP): vLLM may run several generations
	// for it inside one request, each with the request's sampling parameters,
	// so the later ones ask again for the KV blocks the prefill leg handed
	// over for the first, freed by then (docs/engines.md).
	BuiltinTools
	// InvalidLimits: the engine refuses the request for a field the prefill
	// leg's caps overwrite (its output limit, stream_options without
	// stream). Paired, the prefill engine would compute the prompt and keep
	// its blocks for a pull that never comes, as the decode engine refuses
	// the request.
	InvalidLimits
	// BeamSearch: vLLM's beam search runs its own requests, one step at a
	// time, with sampling parameters of its own that carry no
	// kv_transfer_params: the prefill leg's KV would never be pulled.
	BeamSearch
	// Truncation: vLLM cuts the prompt to the context length less the
	// request's output limit (truncate_prompt_tokens -1; the Responses API's
	// truncation "auto"), and the prefill leg's limit of one token differs
	// from the decode leg's: a long prompt is cut on one leg and not on the
	// other, and the decode engine would pull blocks of another token
	// sequence (TokenizeParams._token_truncation, vllm/renderers/params.py).
	Truncation
)

// API is one engine API pd-extproc routes.
type API struct {
	Name   string // its metrics label and log name
	Method string
	Path   string
	Serves Family // the engines that serve it
	Pairs  Family // those of them under which it can be disaggregated
	// Unpaired says why a family that serves the API cannot disaggregate
	// it, for the client's error when its connector cannot go decode-only.
	Unpaired string
	// Leading is how many data events the API's streams send before each
	// choice's first token (response.NewOpening): 1 for chat, whose role
	// event comes first; 2 for Messages (vLLM's message_start, then the first
	// content_block_start) and Responses (response.created and
	// response.in_progress, sent before the engine has anything:
	// responses_stream_generator); none for completions and generate.
	Leading int
	// Model: the engine refuses a request without a "model" string
	// (Anthropic's Messages). Chat and completions take none: vLLM's
	// ChatCompletionRequest and CompletionRequest have "model: str | None",
	// served by the engine's first model name, and SGLang's default it.
	Model bool
	Shape Shape
	// Prompt reads the request for scheduling.
	Prompt func(*body.Object) *Prompt
	// Alone says when one request must go to a decode engine alone.
	Alone func(*body.Object) Reason
	// PairedAlone is Alone under SGLang, the paired family, where its
	// engine reads the request otherwise (nil: as Alone).
	PairedAlone func(*body.Object) Reason
	// Tokenize says how to get the request's token ids (nil: no way);
	// callers use TokensOf.
	Tokenize func(*body.Object) Tokens
	// Unsalted: the engine does not key the request's blocks by its
	// cache_salt (vLLM's Messages handler leaves it out of the chat request
	// it runs), so neither does its Prompt's Cache.
	Unsalted bool
	// AnthropicErrors: the engine words its errors as Anthropic's API does
	// ({"type":"error","error":{...}}), and so do the router's own.
	AnthropicErrors bool
}

// The metrics labels of requests outside the built-in APIs.
const (
	Passthrough = "passthrough" // a request of the pass-through list
	Other       = "other"       // refused: an unknown path or method
)

// The APIs, as named in metrics and logs.
const (
	NameChat           = "chat"
	NameCompletions    = "completions"
	NameResponses      = "responses"
	NameGenerate       = "generate"
	NameSGLangGenerate = "sglang_generate"
	NameMessages       = "messages"
)

// sglangDropsBootstrap is why SGLang cannot pair an API whose handler builds
// its generate request without the bootstrap fields: its P/D decode server
// refuses a request without bootstrap_room.
const sglangDropsBootstrap = "SGLang's handler for it does not pass bootstrap_host, bootstrap_port and " +
	"bootstrap_room on to its scheduler, so a P/D decode server refuses it"

// The built-in APIs: those pd-extproc disaggregates, or routes itself.
var (
	Chat = &API{
		Name: NameChat, Method: "POST", Path: "/v1/chat/completions",
		Serves: VLLM | SGLang, Pairs: VLLM | SGLang, Leading: 1,
		Shape: openAIShape, Prompt: chatPrompt, Alone: chatAlone, PairedAlone: sglangChatAlone, Tokenize: chatTokens,
	}
	Completions = &API{
		Name: NameCompletions, Method: "POST", Path: "/v1/completions",
		Serves: VLLM | SGLang, Pairs: VLLM | SGLang,
		Shape: openAIShape, Prompt: completionsPrompt, Alone: completionsAlone, PairedAlone: sglangCompletionsAlone, Tokenize: completionsTokens,
	}
	Responses = &API{
		Name: NameResponses, Method: "POST", Path: "/v1/responses",
		Serves: VLLM | SGLang, Pairs: VLLM, Unpaired: sglangDropsBootstrap, Leading: 2,
		Shape: responsesShape, Prompt: responsesPrompt, Alone: responsesAlone, Tokenize: responsesTokens,
	}
	Generate = &API{
		Name: NameGenerate, Method: "POST", Path: "/inference/v1/generate",
		Serves: VLLM, Pairs: VLLM,
		Shape: generateShape, Prompt: generatePrompt, Alone: generateAlone, Tokenize: generateTokens,
	}
	SGLangGenerate = &API{
		Name: NameSGLangGenerate, Method: "POST", Path: "/generate",
		Serves: SGLang, Pairs: SGLang,
		Shape: topLevelShape, Prompt: sglangGeneratePrompt, Alone: sglangPromptLogprobs,
	}
	// Messages: vLLM passes a Messages request's kv_transfer_params to the
	// chat path it runs and returns them in a non-streamed answer since
	// 0.19.0 (vllm-project/vllm#37535); routes.messages_decode_only sends it
	// to a decode engine alone for older engines (docs/engines.md).
	Messages = &API{
		Name: NameMessages, Method: "POST", Path: "/v1/messages",
		Serves: VLLM | SGLang, Pairs: VLLM, Unpaired: sglangDropsBootstrap, Model: true, Leading: 2,
		Shape: messagesShape, Prompt: messagesPrompt, Alone: messagesAlone,
		Unsalted:        true, // _convert_anthropic_to_openai_request, vllm/entrypoints/anthropic/serving.py @ 82df3f49
		AnthropicErrors: true, // vLLM's Messages handler raises AnthropicErrorResponse
	}
)

// Builtin lists the built-in APIs in the order the README's table shows them.
var Builtin = []*API{Chat, Completions, Responses, Generate, SGLangGenerate, Messages}

// passthrough is the API of every request the pass-through list admits.
var passthrough = &API{
	Name: Passthrough, Serves: VLLM | SGLang, Leading: 1,
	Shape: topLevelShape, Prompt: func(*body.Object) *Prompt { return noPrompt() },
	Alone: func(*body.Object) Reason { return NoReason },
}

// Labels lists every value the api label of the metrics can take.
func Labels() []string {
	labels := make([]string, 0, len(Builtin)+2)
	for _, a := range Builtin {
		labels = append(labels, a.Name)
	}
	return append(labels, Passthrough, Other)
}

// LabelOf is the label of a request of method to path (query included)
// known before it is routed: a built-in API's name, else Other (a method the
// API does not take too). A request the pass-through list admits is
// labelled once routed.
func LabelOf(method, path string) string {
	if a := builtinAt(stripQuery(path)); a != nil && a.Method == method {
		return a.Name
	}
	return Other
}

// AnthropicErrorsAt reports whether errors to a request to path (query
// included) are worded as Anthropic's API words them: at an API whose
// engine does (API.AnthropicErrors), and below it, where Anthropic's
// clients call the rest of that API (POST /v1/messages/count_tokens, which
// vLLM's Anthropic router answers in the same words: api_router.py).
func AnthropicErrorsAt(path string) bool {
	path = stripQuery(path)
	for _, a := range Builtin {
		if a.AnthropicErrors && (path == a.Path || strings.HasPrefix(path, a.Path+"/")) {
			return true
		}
	}
	return false
}

func builtinAt(path string) *API {
	for _, a := range Builtin {
		if a.Path == path {
			return a
		}
	}
	return nil
}
