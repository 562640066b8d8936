package config

import (
	"errors"
	"fmt"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// Routes is what the service routes besides the APIs it disaggregates
// (pkg/api): everything else gets its 404.
type Routes struct {
	// Passthrough lists "METHOD /path" entries (a path ending in /* admits
	// the paths below it) routed to a decode engine alone after the usual
	// scrub. Left out: api.DefaultPassthrough; a list replaces it whole.
	Passthrough []string `json:"passthrough"`
	// PairBuiltinTools disaggregates Responses requests whose tools include
	// one other than a function, which go decode-only by default
	// (builtin_tools): vLLM may run several generations in such a request,
	// each pulling the decode leg's KV again. Refused where a second pull
	// goes wrong (kv.Connector.RepeatedPull).
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

// Validate checks the entries under key ("routes") for connector c, named
// name (c is nil when the name is unknown).
func (r Routes) Validate(key, name string, c kv.Connector) error {
	_, err := api.ParseRoutes(key+".passthrough", r.Passthrough)
	if c != nil && r.PairBuiltinTools && api.Responses.Pairs.Has(c.Family()) && c.RepeatedPull() != "" {
		err = errors.Join(err, fmt.Errorf("%s.pair_builtin_tools: not with %s: vLLM's Responses server runs a generation after "+
			"each built-in tool call, each with the decode leg's kv_transfer_params again, and %s; drop the key: such "+
			"requests then go to a decode engine alone (builtin_tools)", key, name, c.RepeatedPull()))
	}
	return err
}

// ParallelSamplingRefuse is what kv-sglang does with a request with several
// samples (pd.sglang_parallel_sampling), and the only value left: a 400.
const ParallelSamplingRefuse = "refuse"
