package config

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// This file holds what holds requests back, and then turns them away, while
// the engines are saturated (admission.*), as the Gateway API Inference
// Extension does: a request names its objective in a header, an objective
// has a priority, and while every endpoint of a pool the request would use
// is saturated a request of a negative priority waits in pd-extproc for
// room, and is refused (429, Retry-After) if none comes, rather than
// queued on the engines ahead of the others.

// Admission defaults: the Inference Extension's saturation detector's
// (pkg/epp/saturationdetector/config.go: DefaultQueueDepthThreshold,
// DefaultKVCacheUtilThreshold).
const (
	DefaultSaturatedQueue   = 5
	DefaultSaturatedKVCache = 0.8
)

// DefaultShedRetryAfter is the Retry-After a shed request is given: long
// enough that batch clients that honour it stay away while the engines
// catch up (docs/scheduling.md, shedding: a second bought the chat almost
// nothing in the simulation, 30 s most of what shedding can buy).
const DefaultShedRetryAfter = 30 * time.Second

// DefaultHold is how long a request that may be shed waits for room before
// it is refused: in the simulations, wherever the pool stayed saturated, a
// hold of 30 s gave the interactive traffic a time to first token 0.2 to
// 0.65 of a refusal at once's (docs/scheduling.md, shedding).
const DefaultHold = 30 * time.Second

// Admission sheds the requests of negative priority while their pools are
// saturated.
type Admission struct {
	// Objectives gives each objective a request may name (its
	// x-gateway-inference-objective header) its priority, as an InferenceObjective's spec.priority: higher is more
	// important, a request naming none or an unknown one has 0, and a
	// negative one is shed while a pool it would use is saturated.
	Objectives map[string]int `json:"objectives,omitempty"`
	// An endpoint is saturated while its scraped waiting queue is at or
	// above SaturatedQueue, or its scraped KV cache use at or above
	// SaturatedKVCache, or its figures are stale; a pool, while every
	// endpoint a request may go to is.
	SaturatedQueue   float64 `json:"saturated_queue,omitempty"`
	SaturatedKVCache float64 `json:"saturated_kv_cache,omitempty"`
	// Hold is how long a request that may be shed waits in pd-extproc for
	// its pool to have room, released as the engines' scraped figures show
	// room (by priority, then in turns between the flows its fairness id
	// names, then by arrival), before it is refused; "0s" refuses at once.
	Hold *Duration `json:"hold,omitempty"`
	// MaxHeld bounds the requests held at once, both pools together; past
	// it a request that may be shed is refused at once. Held requests keep
	// their streams and bodies, which a flood of them would take from the
	// others: by default half of limits.max_concurrent_streams.
	MaxHeld int `json:"max_held,omitempty"`
	// RetryAfter is the Retry-After of a shed request's 429.
	RetryAfter Duration `json:"retry_after,omitempty"`
}

// Sheds reports whether some objective may be shed.
func (a Admission) Sheds() bool {
	for _, p := range a.Objectives {
		if p < 0 {
			return true
		}
	}
	return false
}

// SetDefaults fills the keys left out.
func (a *Admission) SetDefaults() {
	orDefault(&a.SaturatedQueue, DefaultSaturatedQueue)
	orDefault(&a.SaturatedKVCache, DefaultSaturatedKVCache)
	orDefault(&a.RetryAfter, Duration(DefaultShedRetryAfter))
	if a.Hold == nil {
		d := Duration(DefaultHold)
		a.Hold = &d
	}
}

// Held is the longest a request waits in the hold: admission.hold where
// some objective may be shed, else 0.
func (a Admission) Held() Duration {
	if !a.Sheds() || a.Hold == nil {
		return 0
	}
	return *a.Hold
}

// validateAdmission checks admission.*: shedding reads the engines' scraped
// queues and KV use, so every pool with engines must scrape them.
func (c *Config) validateAdmission() error {
	a := c.Admission
	var errs []error
	if a.SaturatedQueue < 0 {
		errs = append(errs, errors.New("admission.saturated_queue: must not be negative"))
	}
	if a.RetryAfter.D() < time.Second {
		errs = append(errs, fmt.Errorf("admission.retry_after: %v is below 1s, the least Retry-After says", a.RetryAfter.D()))
	}
	if a.MaxHeld < 0 {
		errs = append(errs, errors.New("admission.max_held: must not be negative"))
	}
	if a.Hold != nil && (*a.Hold < 0 || *a.Hold > Duration(maxEnvoyMessageTimeout)) {
		errs = append(errs, fmt.Errorf("admission.hold: %v is not between 0s and 1h", a.Hold.D()))
	}
	for _, name := range slices.Sorted(maps.Keys(a.Objectives)) {
		if name == "" || strings.TrimSpace(name) != name {
			// A request without the header names "": such an entry would
			// give it that priority. Envoy trims a header value's white space.
			errs = append(errs, fmt.Errorf("admission.objectives: %q is no objective a request can name: "+
				"a name is not empty and neither starts nor ends with white space", name))
		}
	}
	if a.SaturatedKVCache <= 0 || a.SaturatedKVCache > 1 {
		errs = append(errs, fmt.Errorf("admission.saturated_kv_cache: %g is not in (0, 1]", a.SaturatedKVCache))
	}
	if !a.Sheds() {
		return errors.Join(errs...)
	}
	for _, p := range c.Pools.named() {
		if p.Configured() && p.Metrics.Interval <= 0 {
			errs = append(errs, fmt.Errorf("admission.objectives: a negative priority sheds by the engines' scraped queues "+
				"and KV use: set pools.%s.metrics.interval", p.name))
		}
	}
	return errors.Join(errs...)
}

// HeldScrape is the longest scrape interval docs/scheduling.md advises where
// requests may be held for room: the hold lets them go a scrape at a time,
// and slower scrapes cost the chat in moments of saturation.
const HeldScrape = 250 * time.Millisecond

// SlowScrape is a pool's scrape interval key and its value.
type SlowScrape struct {
	Key      string
	Interval time.Duration
}

// SlowScrapes are the pools scraped less often than HeldScrape where
// requests may be held (admission.hold), prefill first.
func (c *Config) SlowScrapes() []SlowScrape {
	if c.Admission.Held() == 0 {
		return nil
	}
	var slow []SlowScrape
	for _, p := range c.Pools.named() {
		if p.Configured() && p.Metrics.Interval.D() > HeldScrape {
			slow = append(slow, SlowScrape{"pools." + p.name + ".metrics.interval", p.Metrics.Interval.D()})
		}
	}
	return slow
}
