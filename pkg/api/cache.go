package api

import (
	"bytes"
	"encoding/json"

	"github.com/cespare/xxhash/v2"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// What keys a request's cached blocks besides its text: the LoRA adapter
// that computes it and its cache_salt (vLLM's generate_block_hash_extra_keys,
// vllm/v1/core/kv_cache_utils.py), read once per request into its Prompt's
// Cache, from which the namespace that ranks it and the KV-event lookup both
// derive; and what has the engine render another prompt from the same
// messages, its Variant, which the namespace alone reads (the KV-event
// lookup hashes token ids the engine rendered with it).

// PromptOf reads a request for scheduling (Prompt) as engine renders it,
// with its Model, its Cache: the adapter SGLang's lora_path names (a
// string, or a batch's list naming one), else the model; and with the
// client's name for its Conversation; and its Variant.
func (a *API) PromptOf(o *body.Object, engine Family) *Prompt {
	p := a.Prompt(o)
	p.engine = engine
	p.Model, _ = o.String("model")
	model, ok := loraPath(o)
	if !ok {
		model = p.Model
	}
	var salt string
	if !a.Unsalted {
		salt, _ = o.String("cache_salt")
	}
	p.Cache = kvevents.Keys{Model: model, Salt: salt}
	render := p.render
	p.render = func() rendering {
		r := render()
		r.variant = a.variant(o)
		return r
	}
	p.Conversation, _ = o.String("prompt_cache_key")
	return p
}

// loraPath is the one adapter a request's lora_path names: a string, or a
// list of one name (a batch's, an entry per prompt).
func loraPath(o *body.Object) (string, bool) {
	if s, ok := o.String("lora_path"); ok {
		return s, s != ""
	}
	raw, _ := o.Raw("lora_path")
	name := ""
	for e := range body.Items(raw) {
		var s string
		if json.Unmarshal(e, &s) != nil || s == "" || name != "" && s != name {
			return "", false
		}
		name = s
	}
	return name, name != ""
}

// variant hashes what has the engine render a request's prompt otherwise
// than its text says, or key its blocks apart; 0 for none. On the APIs that
// render a chat template: a template of the request's own (chat_template),
// the template kwargs as vLLM's chat endpoint merges them (templateKwargs:
// documents, reasoning_effort, enable_thinking), the Responses API's
// reasoning effort (gpt-oss writes it into its system message) and
// Anthropic's output_config effort (vLLM's Messages handler makes it the
// reasoning_effort: _handle_output_config,
// vllm/entrypoints/anthropic/serving.py @ 0001948b). On every API: SGLang's
// extra_key, which keys its radix cache as cache_salt does
// (_compute_extra_key, python/sglang/srt/entrypoints/openai/serving_base.py).
// Values are read as parsed: whitespace and key order change nothing.
func (a *API) variant(o *body.Object) uint64 {
	var parts [4][]byte
	if n := a.Name; n == NameChat || n == NameResponses || n == NameMessages { // by name: the table may hold a copy
		parts[0], _ = o.Raw("chat_template")
		if parts[1] = templateKwargs(o); parts[1] == nil {
			parts[1], _ = o.Raw("chat_template_kwargs")
		}
		if r, ok := o.Object("reasoning"); ok {
			parts[2], _ = r.Raw("effort")
		} else if c, ok := o.Object("output_config"); ok {
			parts[2], _ = c.Raw("effort")
		}
	}
	parts[3], _ = o.Raw("extra_key")
	var h *xxhash.Digest
	for i, raw := range parts {
		if len(raw) == 0 || body.IsNull(raw) {
			continue
		}
		if h == nil {
			h = xxhash.New()
		}
		h.Write([]byte{byte(i)})
		h.Write(canonical(raw))
	}
	if h == nil {
		return 0
	}
	return h.Sum64()
}

// canonical is a JSON value re-encoded as parsed: no whitespace, objects'
// keys sorted, strings' escapes as Go writes them; raw itself when it does
// not parse.
func canonical(raw []byte) []byte {
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	var v any
	if d.Decode(&v) != nil {
		return raw
	}
	out, err := json.Marshal(v)
	if err != nil {
		return raw
	}
	return out
}
