package config

import (
	"errors"
	"fmt"
)

// This file holds the P/D decider's keys (pd.*): when a request is
// disaggregated, by its prompt, by what its decode endpoint holds and by load.

// P/D modes (pd.mode).
const (
	PDAuto   = "auto"
	PDAlways = "always"
	PDNever  = "never"
)

// P/D defaults.
const (
	DefaultCharsPerToken     = 4
	DefaultMinUncachedTokens = 1024
	DefaultMaxUncachedRatio  = 1
	DefaultDecodeBusyQueue   = 1
)

// PD decides per request between P/D and decode-only.
type PD struct {
	// Mode is auto (default: by prompt size), always or never.
	Mode string `json:"mode,omitempty"`
	// MinPromptTokens: in auto mode, shorter prompts are decode-only.
	MinPromptTokens int `json:"min_prompt_tokens,omitempty"`
	// CharsPerToken estimates tokens from characters when the body has no token ids.
	CharsPerToken float64 `json:"chars_per_token,omitempty"`
	// SGLangParallelSampling is what kv-sglang does with a request with
	// n > 1: refuse (400), the only value; rooms was removed.
	SGLangParallelSampling string `json:"sglang_parallel_sampling,omitempty"`
	// MinUncachedTokens: in auto mode, a request whose decode endpoint is
	// estimated to lack fewer of its prompt's tokens than this, and at most
	// MaxUncachedRatio of them, goes decode-only (cached_prefix): the decode
	// engine computes the few itself rather than wait for a prefill leg.
	// Unset: DefaultMinUncachedTokens when pools.decode.policy is
	// prefix-affinity, whose index the estimate comes from, else off; 0: off.
	MinUncachedTokens *int `json:"min_uncached_tokens,omitempty"`
	// MaxUncachedRatio bounds the uncached share of the prompt that may go
	// decode-only by MinUncachedTokens (default 1: no bound).
	MaxUncachedRatio float64 `json:"max_uncached_ratio,omitempty"`
	// Load is the load arm, off by default.
	Load PDLoad `json:"load"`
}

// PDLoad decides by the engines' scraped queues, on top of the prompt rules:
// a busy prefill pool sends a request decode-only to a decode endpoint with
// headroom (prefill_busy), and a busy decode endpoint vetoes every
// decode-only decision of the cache rule and of this arm (decode_busy, P/D).
type PDLoad struct {
	// PrefillQueue > 0 turns the arm on: the prefill pool is busy while its
	// endpoints' mean scraped queue (waiting requests) is at or above it.
	PrefillQueue float64 `json:"prefill_queue,omitempty"`
	// DecodeQueue: the decode endpoint is busy while its scraped queue is at
	// or above it (default DefaultDecodeBusyQueue).
	DecodeQueue float64 `json:"decode_queue,omitempty"`
}

// On reports whether the load arm is on.
func (l PDLoad) On() bool { return l.PrefillQueue > 0 }

// SetDefaults fills the keys left out.
func (p *PD) SetDefaults() {
	orDefault(&p.Mode, PDAuto)
	orDefault(&p.CharsPerToken, DefaultCharsPerToken)
	orDefault(&p.SGLangParallelSampling, ParallelSamplingRefuse)
	orDefault(&p.MaxUncachedRatio, DefaultMaxUncachedRatio)
	if p.Load.On() {
		orDefault(&p.Load.DecodeQueue, DefaultDecodeBusyQueue)
	}
}

// UncachedTokens is the cache rule's token bound given the decode pool's
// policy: MinUncachedTokens, or its default.
func (p PD) UncachedTokens(decodePolicy string) int {
	switch {
	case p.MinUncachedTokens != nil:
		return *p.MinUncachedTokens
	case decodePolicy == PolicyPrefixAffinity:
		return DefaultMinUncachedTokens
	}
	return 0
}

// cacheKeys are the keys set of the cache rule and the load arm, as the user
// wrote them.
func (p PD) cacheKeys(key string) []string {
	var set []string
	if p.MinUncachedTokens != nil {
		set = append(set, key+".min_uncached_tokens")
	}
	if p.MaxUncachedRatio != DefaultMaxUncachedRatio {
		set = append(set, key+".max_uncached_ratio")
	}
	if p.Load != (PDLoad{}) {
		set = append(set, key+".load")
	}
	return set
}

// Validate checks the P/D keys under key ("pd").
func (p PD) Validate(key string) error {
	var errs []error
	switch p.Mode {
	case PDAuto, PDAlways, PDNever:
	default:
		errs = append(errs, fmt.Errorf("%s.mode: %q is not %s, %s or %s", key, p.Mode, PDAuto, PDAlways, PDNever))
	}
	if p.MinPromptTokens < 0 {
		errs = append(errs, fmt.Errorf("%s.min_prompt_tokens: must not be negative", key))
	}
	if p.MinUncachedTokens != nil && *p.MinUncachedTokens < 0 {
		errs = append(errs, fmt.Errorf("%s.min_uncached_tokens: must not be negative", key))
	}
	if p.MaxUncachedRatio <= 0 || p.MaxUncachedRatio > 1 {
		errs = append(errs, fmt.Errorf("%s.max_uncached_ratio: %g is not in (0, 1]", key, p.MaxUncachedRatio))
	}
	if p.Load.PrefillQueue < 0 || p.Load.DecodeQueue < 0 {
		errs = append(errs, fmt.Errorf("%s.load: queues must not be negative", key))
	}
	if !p.Load.On() && p.Load.DecodeQueue > 0 {
		errs = append(errs, fmt.Errorf("%s.load.decode_queue: needs %s.load.prefill_queue, which turns the load arm on", key, key))
	}
	if p.CharsPerToken <= 0 || p.CharsPerToken > 100 {
		errs = append(errs, fmt.Errorf("%s.chars_per_token: %g is not in (0, 100]", key, p.CharsPerToken))
	}
	switch p.SGLangParallelSampling {
	case ParallelSamplingRefuse:
	case "rooms":
		errs = append(errs, fmt.Errorf("%s.sglang_parallel_sampling: rooms was removed: SGLang's tokenizer manager gives every "+
			"sample of a prompt the prompt's first bootstrap room, so a room per sample is never read and the samples meet "+
			"the hang the 400 prevents; drop the key (requests with n > 1 get 400)", key))
	default:
		errs = append(errs, fmt.Errorf("%s.sglang_parallel_sampling: %q is not %s", key, p.SGLangParallelSampling, ParallelSamplingRefuse))
	}
	return errors.Join(errs...)
}

// validateCacheRules refuses the cache rule and the load arm where they have
// nothing to go by: the estimate of what a decode endpoint holds is
// prefix-affinity's, and the load arm reads both pools' scraped queues.
func (c *Config) validateCacheRules() error {
	var errs []error
	if c.Pools.Decode.Policy != PolicyPrefixAffinity && (c.PD.MinUncachedTokens != nil && *c.PD.MinUncachedTokens > 0 ||
		c.PD.MaxUncachedRatio != DefaultMaxUncachedRatio) {
		errs = append(errs, fmt.Errorf("pd.min_uncached_tokens, pd.max_uncached_ratio: need pools.decode.policy: %s, "+
			"whose index estimates what the decode endpoint holds (it is %q)", PolicyPrefixAffinity, c.Pools.Decode.Policy))
	}
	if c.PD.Load.On() && (c.Pools.Prefill.Metrics.Interval <= 0 || c.Pools.Decode.Metrics.Interval <= 0) {
		errs = append(errs, errors.New("pd.load: needs both pools to scrape their engines' queues "+
			"(pools.prefill.metrics.interval and pools.decode.metrics.interval)"))
	}
	return errors.Join(errs...)
}
