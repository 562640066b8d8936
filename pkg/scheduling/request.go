package scheduling

import (
	"encoding/binary"
	"math"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// Request is what scheduling reads of one client request. The zero value (or
// nil) is a request with nothing to go by: pickers fall back to load.
type Request struct {
	// N is the number of samples asked for, 1 when absent.
	N int
	// Prompts is the number of prompts: a batch has several.
	Prompts int
	// Subset restricts picking to an endpoint-picker subset hint.
	Subset Subset
	// Alone, when set, is why the request's API sends it to a decode
	// endpoint alone; the decider returns it first.
	Alone metrics.Reason
	// Session says the client named its session in a header that Envoy's
	// session hash reads, so that its turns may all reach this replica:
	// prefix-affinity counts whether it sees such conversations whole apart
	// from the others.
	Session bool
	// Client is the client's address as Envoy's session hash reads it for a
	// request that names no session (handlers.ClientAddressHeader): the
	// requests of one address may all reach this replica, so prefix-affinity
	// counts whether it sees their conversations whole per address. "" when
	// unknown: those requests share one count.
	Client string
	// Model is the model (or vLLM adapter) the request names, "" for none:
	// where the pool's engines list different models, only those listing it
	// may take the request (models.go).
	Model string
	// Response is the id of the stored response the request names, "" for
	// none: the decode pool sends it to the endpoint the id names
	// (NewResponseID) while it may take it.
	Response string

	prompt *api.Prompt // read as the request's API reads it; nil for none
	// tokens are the prompt's token ids as its engine computes them, when
	// known (SetTokens): what a pool following KV events looks up, keyed
	// as the prompt's Cache says.
	tokens []int64
	// held is what the policy that picked for it last estimates that
	// endpoint holds of its prompt: prefix-affinity sets it as it picks, for
	// the decider to read of the decode endpoint.
	held estimate
	// absent are the endpoints of the pool last picked for it that are out
	// of rotation or gone, and moved conversations lately (recentlyMoved).
	absent []*Endpoint
	// runes is 1 + the prompt's length in runes once counted (promptRunes), 0 before.
	runes int
	// modelOnly: the pool last picked for it took only the endpoints
	// serving its Model as candidates (models.go).
	modelOnly bool
}

// estimate is how many leading characters of a prompt (Request.Prompt) an
// endpoint is estimated to hold in its prefix cache, or, when exact (read
// from the engines' KV events), how many of its tokens it holds.
type estimate struct {
	addr   string
	chars  int
	tokens int
	exact  bool
}

// SetTokens gives r its prompt's token ids (the engine's render endpoint or
// /tokenize, or the body's own ids).
func (r *Request) SetTokens(ids []int64) { r.tokens = ids }

// Tokens are the prompt's token ids, nil when not known.
func (r *Request) Tokens() []int64 {
	if r == nil {
		return nil
	}
	return r.tokens
}

// Held is the estimated cached start of the prompt on e, in characters: 0
// unless e's pool's policy (prefix-affinity) picked e for r and estimated it.
// An exact count of tokens is given as its share of the characters.
func (r *Request) Held(e *Endpoint) int {
	if r == nil || e == nil || r.held.addr != e.Addr {
		return 0
	}
	if r.held.exact {
		if len(r.tokens) == 0 {
			return 0
		}
		return int(int64(len(r.Prompt())) * int64(r.held.tokens) / int64(len(r.tokens)))
	}
	return r.held.chars
}

// NewRequest is the request whose prompt p is.
func NewRequest(p *api.Prompt) *Request {
	return &Request{N: p.N, Prompts: p.Prompts, Model: p.Model, prompt: p}
}

// Prompt is the prompt as the prefix index sees it (api.Prompt.Text).
func (r *Request) Prompt() string { return r.read((*api.Prompt).Text) }

// Preamble is the start of the head before the first user message
// (api.Prompt.Preamble), empty when the request has none.
func (r *Request) Preamble() string { return r.read((*api.Prompt).Preamble) }

// Head is the start of the prompt that later turns of the same conversation
// repeat (api.Prompt.Head), empty when the request has none.
func (r *Request) Head() string { return r.read((*api.Prompt).Head) }

// Previous is the start of the prompt that the conversation's previous
// request sent (api.Prompt.Previous), empty when no reply follows the head.
func (r *Request) Previous() string { return r.read((*api.Prompt).Previous) }

// conversationName is the client's own name for the conversation
// (api.Prompt.Conversation), "" for none.
func (r *Request) conversationName() string {
	if r == nil || r.prompt == nil {
		return ""
	}
	return r.prompt.Conversation
}

// cache is what the engine keys the prompt's cached blocks with besides
// their text (api.Prompt.Cache).
func (r *Request) cache() kvevents.Keys {
	if r == nil || r.prompt == nil {
		return kvevents.Keys{}
	}
	return r.prompt.Cache
}

// namespace is a hash of cache and of the prompt's Variant, 0 for none: it
// keys the request's rendezvous ranking and the local hint's blocks, as
// the engine keys its cached blocks.
func (r *Request) namespace() uint64 {
	k, v := r.cache(), uint64(0)
	if r != nil {
		v = r.prompt.Variant()
	}
	if k == (kvevents.Keys{}) && v == 0 {
		return 0
	}
	var h xxhash.Digest // of model, NUL, salt (and NUL, variant), without building the string
	h.Reset()
	h.WriteString(k.Model)
	h.WriteString("\x00")
	h.WriteString(k.Salt)
	if v != 0 {
		var b [9]byte // NUL, variant
		binary.LittleEndian.PutUint64(b[1:], v)
		h.Write(b[:])
	}
	return h.Sum64()
}

// model is the model the request names, "" for none or a nil request.
func (r *Request) model() string {
	if r == nil {
		return ""
	}
	return r.Model
}

// read is what part says of the request's prompt, "" for a nil request.
func (r *Request) read(part func(*api.Prompt) string) string {
	if r == nil {
		return ""
	}
	return part(r.prompt)
}

// UncachedTokens is how many of the prompt's tokens e lacks, by Held, and
// the prompt's tokens.
func (r *Request) UncachedTokens(e *Endpoint, charsPerToken float64) (uncached, tokens int) {
	tokens = r.PromptTokens(charsPerToken)
	if e != nil && r.held.exact && r.held.addr == e.Addr {
		return tokens - min(r.held.tokens, tokens), tokens
	}
	prompt := r.Prompt()
	if prompt == "" {
		return tokens, tokens
	}
	// Held is in bytes (the cache's blocks are); tokens follow characters.
	// A cut at a rune's start splits the count: what is held is the whole
	// less the rest, most often the shorter part.
	h := min(r.Held(e), len(prompt))
	held := r.promptRunes() - utf8.RuneCountInString(prompt[h:])
	if h < len(prompt) && !utf8.RuneStart(prompt[h]) {
		held = utf8.RuneCountInString(prompt[:h])
	}
	return tokens - int(int64(tokens)*int64(held)/int64(r.promptRunes())), tokens
}

// uncountedMedia says a media part of the prompt (api.Prompt.Media) ends
// past its first held characters: its JSON tells nothing of the tokens the
// engine makes of it, and vLLM keys those tokens' blocks by the media's
// hash, which no request's keys give (kvevents.Keys), so that the engines'
// KV events never show them held either.
func (r *Request) uncountedMedia(held int) bool {
	return r != nil && r.prompt.Media() > held
}

// promptRunes is the prompt's length in runes, counted once.
func (r *Request) promptRunes() int {
	if r.runes == 0 {
		r.runes = 1 + utf8.RuneCountInString(r.Prompt())
	}
	return r.runes - 1
}

// PromptTokens is the prompt's length in tokens: exact when the body carries
// token ids, else the characters divided by charsPerToken, rounded up.
func (r *Request) PromptTokens(charsPerToken float64) int {
	if r == nil {
		return 0
	}
	if r.tokens != nil {
		return len(r.tokens)
	}
	if n := r.prompt.Tokens(); n >= 0 {
		return n
	}
	if charsPerToken <= 0 {
		charsPerToken = 4
	}
	return int(math.Ceil(float64(r.promptRunes()) / charsPerToken))
}
