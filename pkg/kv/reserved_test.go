package kv

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// A reserved field: a key a client may not set for one engine family, where
// it sits, and where upstream reads it. The fuzz test models the legs with
// this list too, so that it is written once, here, apart from the code.
type reservedField struct {
	family api.Family
	key    string
	// extraArgs: the key sits inside the API's extra_args object
	// (api.Shape.ExtraArgs), not at the top level.
	extraArgs bool
	source    string
}

var reservedFields = []reservedField{
	// Both families' handoffs, removed by every connector.
	{api.VLLM | api.SGLang, "kv_transfer_params", false, "vLLM vllm/entrypoints/openai/chat_completion/protocol.py @ d5dba2d7 " +
		"(to_sampling_params copies it into extra_args), completion/protocol.py, responses/protocol.py"},
	{api.VLLM | api.SGLang, "bootstrap_host", false, "SGLang python/sglang/srt/entrypoints/openai/protocol.py @ 004c82e0 " +
		"(ChatCompletionRequest, CompletionRequest: \"For PD disaggregation\"); managers/io_struct.py @ 001067ff (GenerateReqInput)"},
	{api.VLLM | api.SGLang, "bootstrap_port", false, "as bootstrap_host"},
	{api.VLLM | api.SGLang, "bootstrap_room", false, "as bootstrap_host"},
	// vLLM: extra_args starts from the client's vllm_xargs, and keeps its
	// kv_transfer_params when the top level has none.
	{api.VLLM, "kv_transfer_params", true, "vLLM vllm/entrypoints/openai/chat_completion/protocol.py @ d5dba2d7, to_sampling_params: " +
		"extra_args = self.vllm_xargs, then kv_transfer_params only if the top level's is truthy; " +
		"generate: sampling_params.extra_args, vllm/entrypoints/serve/disagg/serving.py @ fef8b03f"},
	// The other extra args vLLM's engine reads as a router's: the KV events'
	// report mode (with "full" the engine publishes the blocks a request
	// reuses as stored again, which a view following the events cannot tell
	// from another copy) and the encoder cache's handoff.
	{api.VLLM, "kv_cache_report_mode", true, "vLLM vllm/v1/request.py (Request reads it from extra_args beside kv_transfer_params); " +
		"vllm/v1/core/kv_cache_manager.py, get_computed_blocks: \"full\" emits BlockStored for the reused prefix"},
	{api.VLLM, "ec_transfer_params", true, "vLLM vllm/v1/request.py (Request reads it from extra_args: the encoder cache connector's handoff)"},
	// SGLang's router-only fields.
	{api.SGLang, "routed_dp_rank", false, "SGLang openai/protocol.py @ 004c82e0 (chat, completions: \"external router assigns a specific DP worker\"); " +
		"io_struct.py @ 001067ff"},
	{api.SGLang, "data_parallel_rank", false, "SGLang openai/protocol.py @ 004c82e0 (the deprecated spelling, migrated into routed_dp_rank); io_struct.py @ 001067ff"},
	{api.SGLang, "disagg_prefill_dp_rank", false, "SGLang openai/protocol.py @ 004c82e0 (\"hint telling decode which prefill DP worker has the KV cache\"); " +
		"io_struct.py @ 001067ff"},
	{api.SGLang, "rid", false, "SGLang openai/protocol.py @ 004c82e0 (chat, completions: \"For request id\"); io_struct.py @ 001067ff"},
	{api.SGLang, "bootstrap_pair_key", false, "SGLang io_struct.py @ 001067ff (GenerateReqInput, \"For disaggregated inference\")"},
	{api.SGLang, "decode_tp_size", false, "SGLang io_struct.py @ 001067ff (GenerateReqInput, \"For disaggregated inference\")"},
	{api.SGLang, "kv_router_hint", false, "SGLang io_struct.py @ 001067ff (GenerateReqInput: a router's hint naming the peer that holds a prefix)"},
}

// reservedHeaders are the headers a client may not send an engine of each
// family, with where upstream reads them.
var reservedHeaders = []struct {
	family api.Family
	name   string
	source string
}{
	{api.VLLM | api.SGLang, "x-data-parallel-rank", "vLLM vllm/entrypoints/openai/engine/serving.py @ 619e4b31 (_get_data_parallel_rank); " +
		"SGLang openai/serving_base.py (extract_routed_dp_rank_from_header: the header beats the body's routed_dp_rank)"},
	{api.SGLang, "x-override-rid", "SGLang python/sglang/srt/entrypoints/request_headers.py @ 204a3c7a (_HEADER_OVERRIDES)"},
	{api.SGLang, "x-override-bootstrap-host", "as x-override-rid"},
	{api.SGLang, "x-override-bootstrap-port", "as x-override-rid"},
	{api.SGLang, "x-override-bootstrap-room", "as x-override-rid"},
	{api.SGLang, "x-override-conversation-id", "as x-override-rid"},
	{api.SGLang, "x-override-routed-dp-rank", "as x-override-rid"},
	{api.SGLang, "x-override-disagg-prefill-dp-rank", "as x-override-rid"},
	{api.SGLang, "x-override-priority", "as x-override-rid"},
}

// reservedOf is what the fuzz test and TestReservedFieldsLeaveEveryLeg
// remove, as an engine of family reads the body of a request of shape s.
func reservedOf(family api.Family, s *api.Shape) (top []string, inExtraArgs []string) {
	for _, f := range reservedFields {
		switch {
		case !f.family.Has(family):
		case f.extraArgs && s.ExtraArgs != nil:
			inExtraArgs = append(inExtraArgs, f.key)
		case !f.extraArgs:
			top = append(top, f.key)
		}
	}
	return top, inExtraArgs
}

// Each reserved field, duplicated, under an escaped spelling and where the
// API nests it, is gone from every leg of every connector of its family, for
// every API: decode-only and pass-through bodies included. What a connector
// sets there itself is its own value, never the client's.
func TestReservedFieldsLeaveEveryLeg(t *testing.T) {
	apis := append(slices.Clone(api.Builtin), passthrough(t))
	for _, connector := range []string{NIXL, SharedStorage, SGLang} {
		c, err := Build(connector)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range apis {
			if !a.Serves.Has(c.Family()) {
				continue
			}
			for _, f := range reservedFields {
				if !f.family.Has(c.Family()) || f.extraArgs && a.Shape.ExtraArgs == nil {
					continue
				}
				t.Run(fmt.Sprintf("%s/%s/%s", connector, a.Name, where(f, &a.Shape)), func(t *testing.T) {
					const evil = `"client-value"`
					escaped := `"` + strings.Replace(f.key, "_", `\u005f`, 1) + `"`
					members := fmt.Sprintf(`%q:%s,"model":"m",%s:%s,%q:%s`, f.key, evil, escaped, evil, f.key, evil)
					in := `{` + members + `,"messages":[{"role":"user","content":"x"}]}`
					if f.extraArgs {
						in = `{"model":"m",` + nest(a.Shape.ExtraArgs, `{`+members+`,"kept":1}`) + `}`
					}
					h := handoff(t, a, in)
					legs := map[string][]byte{"decode-only": Scrubbed(c, h.Body, h.Shape).Bytes()}
					if a.Pairs.Has(c.Family()) {
						legs["prefill"], legs["decode"] = PrefillBody(c, h).Bytes(), DecodeBody(c, h).Bytes()
					}
					for leg, b := range legs {
						if strings.Contains(string(b), "client-value") {
							t.Errorf("%s leg keeps the client's %s (%s): %s", leg, f.key, f.source, b)
						}
						if f.extraArgs && !strings.Contains(string(b), `"kept":1`) {
							t.Errorf("%s leg lost the client's other extra args: %s", leg, b)
						}
					}
				})
			}
		}
	}
}

// where names a reserved field's place for a subtest.
func where(f reservedField, s *api.Shape) string {
	if f.extraArgs {
		return strings.Join(s.ExtraArgs, ".") + "." + f.key
	}
	return f.key
}

// nest is value at path, as members of the body: "a":{"b":value}.
func nest(path []string, value string) string {
	out := value
	for i := len(path) - 1; i >= 0; i-- {
		out = fmt.Sprintf("%q:%s", path[i], out)
		if i > 0 {
			out = "{" + out + "}"
		}
	}
	return out
}

// Fields of the other family are the client's business: a vLLM engine has no
// rid, an SGLang one reads no vllm_xargs.
func TestReservedFieldsAreTheFamilys(t *testing.T) {
	const in = `{"model":"m","rid":"r","routed_dp_rank":1,"vllm_xargs":{"kv_transfer_params":"x"},"messages":[]}`
	tests := []struct {
		connector, want string
	}{
		{NIXL, `{"model":"m","rid":"r","routed_dp_rank":1,"vllm_xargs":{},"messages":[]}`},
		{SharedStorage, `{"model":"m","rid":"r","routed_dp_rank":1,"vllm_xargs":{},"messages":[]}`},
		{Mooncake, `{"model":"m","rid":"r","routed_dp_rank":1,"vllm_xargs":{},"messages":[]}`},
		{SGLang, `{"model":"m","vllm_xargs":{"kv_transfer_params":"x"},"messages":[]}`},
	}
	for _, tt := range tests {
		c, _ := Build(tt.connector)
		o, err := body.Parse([]byte(in))
		if err != nil {
			t.Fatal(err)
		}
		if got := Scrubbed(c, o, &api.Chat.Shape).Bytes(); string(got) != tt.want {
			t.Errorf("%s: Scrubbed = %s, want %s", tt.connector, got, tt.want)
		}
	}
}

// The headers a connector has removed from the request Envoy forwards are its
// family's, each from the list above.
func TestReservedHeaders(t *testing.T) {
	for _, connector := range []string{NIXL, SharedStorage, Mooncake, SGLang} {
		c, _ := Build(connector)
		var want []string
		for _, h := range reservedHeaders {
			if h.family.Has(c.Family()) {
				want = append(want, h.name)
			}
		}
		if got := c.ReservedHeaders(); !slices.Equal(got, want) {
			t.Errorf("%s: reserved headers %v, want %v", connector, got, want)
		}
	}
}
