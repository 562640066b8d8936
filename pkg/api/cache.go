package api

import (
	"encoding/json"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// What keys a request's cached blocks besides its text: the LoRA adapter
// that computes it and its cache_salt (vLLM's generate_block_hash_extra_keys,
// vllm/v1/core/kv_cache_utils.py), read once per request into its Prompt's
// Cache, from which the namespace that ranks it and the KV-event lookup both
// derive.

// PromptOf reads a request for scheduling (Prompt), with its Model, its
// Cache: the adapter SGLang's lora_path names (a string, or a batch's list
// naming one), else the model; and with the client's name for its
// Conversation.
func (a *API) PromptOf(o *body.Object) *Prompt {
	p := a.Prompt(o)
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
