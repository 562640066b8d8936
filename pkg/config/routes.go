package config

import "github.com/pd-extproc/pd-extproc/pkg/api"

// Routes is what the service routes besides the APIs it disaggregates
// (pkg/api): everything else gets its 404.
type Routes struct {
	// Passthrough lists "METHOD /path" entries (a path ending in /* admits
	// the paths below it) routed to a decode engine alone after the usual
	// scrub. Left out: api.DefaultPassthrough; a list replaces it whole.
	Passthrough []string `json:"passthrough"`
	// PairBuiltinTools disaggregates Responses requests whose tools include
	// one other than a function, which go decode-only by default
	// (builtin_tools): vLLM may run several generations in such a request.
	PairBuiltinTools bool `json:"pair_builtin_tools,omitempty"`
	// MessagesDecodeOnly sends Anthropic Messages requests to a decode
	// engine alone, for vLLM before 0.19.0, whose prefill answer carries no
	// kv_transfer_params (so the decode engine would recompute the prompt
	// after a prefill leg spent for nothing).
	MessagesDecodeOnly bool `json:"messages_decode_only,omitempty"`
	// ResponsesDecodeOnly does the same for the Responses API, for vLLM
	// before 0.19.0, whose ResponsesRequest has no kv_transfer_params
	// (vllm-project/vllm#37424 added them).
	ResponsesDecodeOnly bool `json:"responses_decode_only,omitempty"`
}

// SetDefaults fills the keys left out.
func (r *Routes) SetDefaults() {
	if r.Passthrough == nil {
		r.Passthrough = api.DefaultPassthrough
	}
}

// Validate checks the entries under key ("routes").
func (r Routes) Validate(key string) error {
	_, err := api.ParseRoutes(key+".passthrough", r.Passthrough)
	return err
}

// ParallelSamplingRefuse is what kv-sglang does with a request with several
// samples (pd.sglang_parallel_sampling), and the only value left: a 400.
const ParallelSamplingRefuse = "refuse"
