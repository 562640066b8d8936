package api

import (
	"bytes"
	"strconv"
	"strings"
	"sync"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// Prompt is one request's prompt as scheduling reads it: how many samples
// and prompts it asks for at once, and its text and exact length only when
// asked for: only prefix affinity and a pd.min_prompt_tokens threshold read
// them, and rendering a long chat costs more than everything else the
// service does with the body.
type Prompt struct {
	N       int // samples asked for ("n"), 1 when absent
	Prompts int // prompts in the request: a batch has several
	// MixedN is each entry's n of SGLang's list of sampling_params when they
	// differ, which SGLang refuses; nil when they agree.
	MixedN []int
	// Model is the "model" the body names, "" for none: only endpoints
	// serving it may take the request, where the pool knows which do.
	Model string
	// Cache is what the engine keys the prompt's cached blocks with besides
	// their text (API.PromptOf): the model named (SGLang's native API names
	// an adapter in lora_path instead), as a LoRA adapter's blocks are its
	// own, and the cache_salt. Prompts alike in text and not in Cache share
	// no cache.
	Cache kvevents.Keys
	// Conversation is the client's own name for the conversation, OpenAI's
	// prompt_cache_key ("" when it sends none): Codex sends its conversation's
	// id there, which its requests' text does not tell apart (the first user
	// item is the working directory's context).
	Conversation string

	engine Family // the family whose rendering Text follows (API.PromptOf), 0: vLLM's
	once   sync.Once
	render func() rendering
	r      rendering
}

// rendering is a prompt as text, with what rendering it tells: its exact
// length when the body carries token ids (else -1), the lengths of its
// preamble, its head and its previous request (0: none, see Preamble, Head
// and Previous), and where its last media part ends (0: none, see Media).
type rendering struct {
	text                                    string
	tokens, preamble, head, previous, media int
	variant                                 uint64 // see Variant
}

// plain is a rendering of text alone: no token ids, no head.
func plain(text string) rendering { return rendering{text: text, tokens: -1} }

func newPrompt(n int, render func() rendering) *Prompt {
	return &Prompt{N: n, Prompts: 1, render: render}
}

func noPrompt() *Prompt { return newPrompt(1, func() rendering { return plain("") }) }

// Text is the prompt as the prefix index sees it: chat messages rendered in
// order as role and content, a completions prompt as is, token ids in decimal.
func (p *Prompt) Text() string {
	if p == nil {
		return ""
	}
	p.once.Do(p.do)
	return p.r.text
}

// Tokens is the prompt's exact length when the body carries token ids, else -1.
func (p *Prompt) Tokens() int {
	if p == nil {
		return -1
	}
	p.once.Do(p.do)
	return p.r.tokens
}

// Head is the start of Text that every later turn of the same conversation
// repeats: everything through the first user message (tools, system or
// developer messages, instructions, and that message). It is empty when the
// prompt has no messages, or none from the user.
func (p *Prompt) Head() string {
	if p == nil {
		return ""
	}
	p.once.Do(p.do)
	return p.r.text[:p.r.head]
}

// Preamble is the start of Head before the first user message: the tools,
// system or developer messages and instructions that every conversation
// and one-shot request of one agent or template shares. It is empty when
// the head is, or when the first message is the user's.
func (p *Prompt) Preamble() string {
	if p == nil {
		return ""
	}
	p.once.Do(p.do)
	return p.r.text[:p.r.preamble]
}

// Previous is the start of Text that the conversation's previous request
// sent: everything before the model's last reply after the head that the
// client has answered since (a reply is a run of assistant messages, or of
// the Responses API's reasoning and tool-call items; a run that ends the
// prompt is an assistant prefill, not a reply). It is empty when no reply
// follows the head, as on a conversation's first request.
func (p *Prompt) Previous() string {
	if p == nil {
		return ""
	}
	p.once.Do(p.do)
	return p.r.text[:p.r.previous]
}

// Media is where in Text the prompt's last image, audio or video part (or
// their embeddings) ends, 0 when it has none: the tokens the engine makes
// of such a part are not in the request, and its JSON, which Text holds,
// tells only which media it is.
func (p *Prompt) Media() int {
	if p == nil {
		return 0
	}
	p.once.Do(p.do)
	return p.r.media
}

// Variant is a hash of what else has the engine render the prompt
// otherwise than its text says, or key its blocks apart (API.PromptOf); 0
// for none. Like Text, it is worked out only when asked for.
func (p *Prompt) Variant() uint64 {
	if p == nil {
		return 0
	}
	p.once.Do(p.do)
	return p.r.variant
}

func (p *Prompt) do() { p.r = p.render() }

// samples reads n as the engine does ("2" and 2.0 are 2; absent or not a
// number: 1).
func samples(o *body.Object) int {
	if o == nil {
		return 1
	}
	if n, ok := o.LaxInt("n"); ok {
		return int(n)
	}
	return 1
}

// chatPrompt: messages, after the tools chat templates put first (those
// SGLang renders, under SGLang).
func chatPrompt(o *body.Object) *Prompt {
	p := newPrompt(samples(o), nil)
	p.render = func() rendering {
		return withTokenIDs(o, func() rendering {
			var b strings.Builder
			var keep func([]byte) bool
			if p.engine == SGLang {
				keep = sglangTools(o)
			}
			writeTools(&b, o, keep)
			raw, _ := o.Raw("messages")
			return withMessages(&b, raw, false)
		})
	}
	return p
}

// completionsPrompt: a string, token ids, or a batch of either. An array is
// told apart now, as the decider needs to know whether it is a batch. vLLM
// runs an engine request for each entry of prompt_embeds (one string, or a
// list) besides those of prompt, and hands back the first one's KV params
// alone (preprocess_completion, vllm/renderers/online_renderer.py;
// OpenAIServingCompletion), so each counts as a prompt; a null prompt is
// none (`if prompt_input is not None`).
func completionsPrompt(o *body.Object) *Prompt {
	raw, _ := o.Raw("prompt")
	hasPrompt := present(o, "prompt")
	p := promptOf(samples(o), raw)
	render := p.render
	p.render = func() rendering { return withTokenIDs(o, render) }
	if embeds, ok := o.Raw("prompt_embeds"); ok && len(embeds) > 0 && embeds[0] != 'n' { // not null
		n := 1
		if embeds[0] == '[' {
			n = 0
			for range body.Items(embeds) {
				n++
			}
		}
		if hasPrompt {
			n += p.Prompts
		}
		p.Prompts = max(n, 1)
	}
	return p
}

// promptOf reads a prompt (absent when raw is nil): a string, token ids, or a
// batch of either. An array is read at once, as the decider needs to know
// whether it is a batch; a string only when asked for.
func promptOf(n int, raw []byte) *Prompt {
	p := newPrompt(n, func() rendering {
		if len(raw) == 0 {
			return plain("")
		}
		r, _ := renderPrompt(raw)
		return r
	})
	if len(raw) > 0 && raw[0] == '[' {
		r, prompts := renderPrompt(raw)
		p.Prompts = prompts
		p.render = func() rendering { return r }
	}
	return p
}

// withTokenIDs prefers prompt_token_ids, vLLM's older spelling of a token
// prompt, when the body has them.
func withTokenIDs(o *body.Object, render func() rendering) rendering {
	if raw, ok := o.Raw("prompt_token_ids"); ok {
		if r, ok := tokenIDs(raw); ok {
			return r
		}
	}
	return render()
}

// responsesPrompt: tools, as chat templates put them first, and
// instructions, then the input: items, or a string, which is one user
// message and renders as one, so that a conversation that starts with a
// string and goes on with items keeps its head.
func responsesPrompt(o *body.Object) *Prompt {
	return newPrompt(1, func() rendering {
		var b strings.Builder
		writeTools(&b, o, nil)
		if s, ok := o.String("instructions"); ok {
			b.WriteString(s)
			b.WriteByte('\n')
		}
		raw, _ := o.Raw("input")
		if len(raw) > 0 && raw[0] == '"' {
			preamble := b.Len()
			writeMessage(&b, "user", "", "", raw, nil)
			return rendering{text: b.String(), tokens: -1, preamble: preamble, head: b.Len()}
		}
		return withMessages(&b, raw, false)
	})
}

// messagesPrompt: Anthropic's tools, system and messages, as vLLM's handler
// turns them into a chat request (_convert_anthropic_to_openai_request,
// vllm/entrypoints/anthropic/serving.py): tools first, as chat templates
// put them, and the roles as it reads them, so that requests the engine
// caches alike rank alike.
func messagesPrompt(o *body.Object) *Prompt {
	return newPrompt(1, func() rendering {
		var b strings.Builder
		writeTools(&b, o, nil)
		if raw, ok := o.Raw("system"); ok && !body.IsNull(raw) {
			writeContent(&b, raw, true)
			b.WriteByte('\n')
		}
		raw, _ := o.Raw("messages")
		return withMessages(&b, raw, true)
	})
}

// generatePrompt: vLLM's token-in API, whose length is exact.
func generatePrompt(o *body.Object) *Prompt {
	sp, _ := o.Object("sampling_params")
	return newPrompt(samples(sp), func() rendering {
		raw, _ := o.Raw("token_ids")
		if r, ok := tokenIDs(raw); ok {
			return r
		}
		return plain("")
	})
}

// sglangGeneratePrompt: SGLang's native API, text or input_ids, either one
// prompt or a batch (a null one is left out, GenerateReqInput's default);
// n is in sampling_params.
func sglangGeneratePrompt(o *body.Object) *Prompt {
	raw, _ := o.Raw("input_ids")
	if !present(o, "input_ids") {
		raw, _ = o.Raw("text")
	}
	n, mixed := sglangSamples(o)
	p := promptOf(n, raw)
	p.MixedN = mixed
	return p
}

// sglangSamples is n of SGLang's sampling_params, an object or a list of
// them (one per prompt of a batch), as SGLang reads it: a list's from its
// first entry, every entry's n when they differ, which SGLang refuses
// (_handle_parallel_sampling in python/sglang/srt/managers/io_struct.py).
func sglangSamples(o *body.Object) (n int, mixed []int) {
	raw, _ := o.Raw("sampling_params")
	if len(raw) == 0 || raw[0] != '[' {
		sp, _ := o.Object("sampling_params")
		return samples(sp), nil
	}
	entries, first, alike := 0, 1, true
	for item := range body.Items(raw) {
		if entries++; entries == 1 {
			first = entryN(item)
		} else if alike = entryN(item) == first; !alike {
			break
		}
	}
	if alike {
		return first, nil
	}
	for item := range body.Items(raw) {
		mixed = append(mixed, entryN(item))
	}
	return first, mixed
}

// entryN is n of one entry of a list of sampling_params; one that names no
// n is read without indexing it, as a batch may list millions.
func entryN(item []byte) int {
	if !bytes.Contains(item, []byte(`"n"`)) && bytes.IndexByte(item, '\\') < 0 {
		return 1
	}
	sp, _ := body.Parse(item)
	return samples(sp)
}

// renderPrompt reads a prompt: a string, token ids, or a batch of either
// (the first is rendered, all are counted). Nothing nested deeper is read:
// the engines refuse it, and reading each level anew would cost a nested
// body's size times its depth.
func renderPrompt(raw []byte) (r rendering, prompts int) {
	if len(raw) == 0 || raw[0] != '[' {
		return renderOne(raw), 1
	}
	if r, ok := tokenIDs(raw); ok {
		return r, 1
	}
	var first []byte
	for item := range body.Items(raw) {
		if prompts++; prompts == 1 {
			first = item
		}
	}
	if prompts == 0 {
		return plain(""), 1
	}
	return renderOne(first), prompts
}

// renderOne reads one prompt: a string or token ids.
func renderOne(raw []byte) rendering {
	if len(raw) > 0 && raw[0] == '"' {
		return plain(body.DecodeString(raw))
	}
	if r, ok := tokenIDs(raw); ok {
		return r
	}
	return plain("")
}

// tokenIDs renders a JSON array of integers as decimal ids joined by
// commas, and counts them. It reads the elements as they lie rather than
// decode the array: one of something else (a batch of millions of tiny
// strings) ends it at its first element, with no allocation per element.
func tokenIDs(raw []byte) (rendering, bool) {
	if len(raw) == 0 || raw[0] != '[' {
		return rendering{}, false
	}
	var b []byte
	n := 0
	for item := range body.Items(raw) {
		id, err := strconv.ParseInt(string(item), 10, 64)
		switch {
		case err != nil:
			return rendering{}, false
		case n == 0:
			b = make([]byte, 0, len(raw)) // the ids take no more than their JSON
		default:
			b = append(b, ',')
		}
		n++
		b = strconv.AppendInt(b, id, 10)
	}
	return rendering{text: string(b), tokens: n}, true
}
