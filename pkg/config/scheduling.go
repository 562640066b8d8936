package config

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"
)

// This file holds the scheduling keys: how each pool picks endpoints, and
// the prefill retry budget (pd.go holds when a request is disaggregated). Each type fills its
// own defaults (SetDefaults, idempotent) and validates itself with errors that
// name the key as the user wrote it.

// Scheduling policies of a pool (pools.<pool>.policy).
const (
	PolicyLeastLoad      = "least-load"
	PolicyPrefixAffinity = "prefix-affinity"
	PolicyRoundRobin     = "round-robin"
)

// Scheduling defaults.
const (
	DefaultBlockChars          = 256
	DefaultKeyBlocks           = 64
	DefaultMaxBlocks           = 1 << 16
	DefaultLoadFactor          = 2
	DefaultLoadSlack           = 8
	DefaultQueueSlack          = 1
	DefaultSpread              = 4
	DefaultConsecutiveFailures = 3
	DefaultBaseEjection        = time.Second
	DefaultMaxEjection         = 30 * time.Second
	DefaultCheckPath           = "/health"
	// DefaultCheckTimeout leaves SGLang's /health, a one-token generation
	// that answers after a second at least (health_generate in its
	// http_server.py), time to answer under load.
	DefaultCheckTimeout = 5 * time.Second
	// Envoy Gateway's defaults for an active check (its ActiveHealthCheck).
	DefaultUnhealthyThreshold = 3
	DefaultHealthyThreshold   = 1
	DefaultMetricsPath        = "/metrics"
	DefaultDNSInterval        = 10 * time.Second
	// minInterval bounds the checks', scrapes' and lookups' intervals from
	// below: at a microsecond they spin a CPU and never succeed.
	minInterval            = 10 * time.Millisecond
	DefaultPrefillAttempts = 2
	maxFallbacks           = 8
)

// DefaultDecodeQueueSlack is queue_slack's default for the decode pool of a
// P/D deployment (pd.mode other than never) that does not follow its engines'
// KV events. A P/D decode engine's queue holds the requests whose KV is on its
// way (vLLM's num_requests_waiting counts them) and its local prefills, which
// come and go with every hand-off. A conversation spilled off the engine that
// holds it pays its history again there, and replicas that did not see the
// spill estimate what it holds apart; with the engines' events every replica
// sees where it went, and the usual bound does better (docs/scheduling.md,
// the P/D simulation). Under the cache rule (pd.mode auto) the decode pool
// applies it to later turns only, which stay with their history up to 3 ×
// it, and DefaultQueueSlack to the requests that start a conversation.
const DefaultDecodeQueueSlack = 4

// PoolScheduling is how one pool picks its endpoints. Embed it in Pool so that
// its keys sit next to endpoints, under pools.<pool>.
type PoolScheduling struct {
	// Policy is least-load (default), prefix-affinity or round-robin.
	Policy string `json:"policy,omitempty"`
	// Prefix tunes prefix-affinity.
	Prefix PrefixAffinity `json:"prefix"`
	// Health ejects failing endpoints and optionally probes them.
	Health EngineHealth `json:"health"`
	// Metrics scrapes the engines' own load.
	Metrics EngineMetrics `json:"metrics"`
	// DNS is name:port, resolved every DNSInterval; its addresses join Endpoints.
	DNS         string   `json:"dns,omitempty"`
	DNSInterval Duration `json:"dns_interval,omitempty"`
	// Fallbacks is how many extra decode endpoints to offer Envoy for retries
	// (decode pool only; 0, the default, sends exactly one).
	Fallbacks int `json:"fallbacks,omitempty"`
	// KVEvents follows the engines' KV cache events (prefix-affinity only).
	KVEvents KVEvents `json:"kv_events"`
}

// PrefixAffinity tunes the prefix-affinity policy.
type PrefixAffinity struct {
	// BlockChars is the size of a prompt block, in bytes of rendered prompt.
	BlockChars int `json:"block_chars,omitempty"`
	// KeyBlocks bounds the key that ranks the endpoints, in blocks: the
	// prompt's preamble (tools, system prompt) or else its head or its first
	// blocks. Requests that share the key go to the same few endpoints on
	// every replica, while the load bounds allow.
	KeyBlocks int `json:"key_blocks,omitempty"`
	// MaxBlocks bounds the remembered block chains (LRU), the local hint that
	// keeps a conversation where a load spill sent it.
	MaxBlocks int `json:"max_blocks,omitempty"`
	// An endpoint whose load exceeds LoadFactor × mean load + LoadSlack is
	// passed over even when it holds the longest prefix.
	LoadFactor float64 `json:"load_factor,omitempty"`
	LoadSlack  float64 `json:"load_slack,omitempty"`
	// An endpoint whose engine queue (scraped) exceeds the mean queue +
	// QueueSlack is passed over too.
	QueueSlack float64 `json:"queue_slack,omitempty"`
	// EstimateQueueSlack is QueueSlack for a request placed without a view
	// of the engines' caches from their KV events (the pool follows none,
	// or none it may trust now); 0: QueueSlack. Not a key of its own:
	// SetDecodeDefaults sets it where QueueSlack is left out, and under the
	// cache rule the decode pool reads it for later turns only
	// (DefaultDecodeQueueSlack).
	EstimateQueueSlack float64 `json:"-"`
	// Spread sizes a key's home set: its share of the pool's requests ×
	// the endpoints × Spread, rounded up to a power of two.
	Spread float64 `json:"spread,omitempty"`
}

// EngineHealth configures passive ejection and optional active checks.
type EngineHealth struct {
	// ConsecutiveFailures (connection errors, 5xx) eject an endpoint.
	ConsecutiveFailures int `json:"consecutive_failures,omitempty"`
	// An ejection lasts BaseEjection, doubling per failed probe up to MaxEjection.
	BaseEjection Duration `json:"base_ejection,omitempty"`
	MaxEjection  Duration `json:"max_ejection,omitempty"`
	// CheckInterval > 0 turns on active checks: GET CheckPath, 2xx is healthy.
	CheckInterval Duration `json:"check_interval,omitempty"`
	CheckPath     string   `json:"check_path,omitempty"`
	CheckTimeout  Duration `json:"check_timeout,omitempty"`
	// UnhealthyThreshold checks in a row that time out or cannot connect
	// mark an endpoint down (an answer that is not 2xx does at once, and so
	// does a first check); HealthyThreshold checks in a row that pass mark
	// it up again. Envoy's meanings of unhealthy_threshold and
	// healthy_threshold.
	UnhealthyThreshold int `json:"unhealthy_threshold,omitempty"`
	HealthyThreshold   int `json:"healthy_threshold,omitempty"`
}

// EngineMetrics configures scraping the engines' /metrics for their queue and KV use.
type EngineMetrics struct {
	// Interval > 0 turns scraping on.
	Interval Duration `json:"interval,omitempty"`
	Path     string   `json:"path,omitempty"`
	// Timeout bounds one scrape; default min(Interval, 1s).
	Timeout Duration `json:"timeout,omitempty"`
	// StaleAfter: older figures are ignored; default 3 × Interval.
	StaleAfter Duration `json:"stale_after,omitempty"`
}

// PrefillAttempts is the prefill leg's retry budget. Embed it in Prefill so
// that its keys sit under prefill.
type PrefillAttempts struct {
	// Attempts is how many prefill endpoints one request may try (default 2).
	Attempts int `json:"attempts,omitempty"`
	// AttemptTimeout bounds one attempt (default: prefill.timeout).
	AttemptTimeout Duration `json:"attempt_timeout,omitempty"`
}

// SetDefaults fills the keys left out.
func (s *PoolScheduling) SetDefaults() {
	orDefault(&s.Policy, PolicyLeastLoad)
	s.Prefix.SetDefaults()
	s.Health.SetDefaults()
	s.Metrics.SetDefaults()
	s.KVEvents.SetDefaults()
	if s.DNS != "" && s.DNSInterval == 0 {
		s.DNSInterval = Duration(DefaultDNSInterval)
	}
}

// SetDecodeDefaults fills the keys left out of the decode pool of a
// deployment whose pd.mode is mode: as SetDefaults, but a P/D decode pool
// (mode other than never) places the requests it places without KV events
// with DefaultDecodeQueueSlack: all of them when it follows none, else
// those it cannot look up in a view it may trust (engines that publish
// nothing, or fell silent).
func (s *PoolScheduling) SetDecodeDefaults(mode string) {
	if mode != PDNever && s.Prefix.QueueSlack == 0 {
		s.Prefix.EstimateQueueSlack = DefaultDecodeQueueSlack
		if !s.KVEvents.On() {
			s.Prefix.QueueSlack = DefaultDecodeQueueSlack
		}
	}
	s.SetDefaults()
}

// Validate checks the pool's scheduling keys; key is the pool's own key,
// e.g. "pools.decode".
func (s PoolScheduling) Validate(key string) error {
	var errs []error
	switch s.Policy {
	case PolicyLeastLoad, PolicyPrefixAffinity, PolicyRoundRobin:
	default:
		errs = append(errs, fmt.Errorf("%s.policy: %q is not %s, %s or %s", key, s.Policy, PolicyLeastLoad, PolicyPrefixAffinity, PolicyRoundRobin))
	}
	errs = append(errs, s.Prefix.Validate(key+".prefix"), s.Health.Validate(key+".health"), s.Metrics.Validate(key+".metrics"),
		s.KVEvents.Validate(key+".kv_events", s.Policy))
	if s.DNS != "" {
		if err := validateHostPort(s.DNS); err != nil {
			errs = append(errs, fmt.Errorf("%s.dns: %w", key, err))
		}
		if s.DNSInterval < Duration(minInterval) {
			errs = append(errs, fmt.Errorf("%s.dns_interval: %s is below %s", key, s.DNSInterval.D(), minInterval))
		}
	}
	if s.Fallbacks < 0 || s.Fallbacks > maxFallbacks {
		errs = append(errs, fmt.Errorf("%s.fallbacks: %d is not between 0 and %d", key, s.Fallbacks, maxFallbacks))
	}
	return errors.Join(errs...)
}

// SetDefaults fills the keys left out.
func (p *PrefixAffinity) SetDefaults() {
	orDefault(&p.BlockChars, DefaultBlockChars)
	orDefault(&p.KeyBlocks, DefaultKeyBlocks)
	orDefault(&p.MaxBlocks, DefaultMaxBlocks)
	orDefault(&p.LoadFactor, DefaultLoadFactor)
	orDefault(&p.LoadSlack, DefaultLoadSlack)
	orDefault(&p.QueueSlack, DefaultQueueSlack)
	orDefault(&p.Spread, DefaultSpread)
}

// Validate checks the prefix-affinity keys under key.
func (p PrefixAffinity) Validate(key string) error {
	var errs []error
	if p.BlockChars < 16 || p.BlockChars > 1<<16 {
		errs = append(errs, fmt.Errorf("%s.block_chars: %d is not between 16 and 65536", key, p.BlockChars))
	}
	if p.KeyBlocks < 1 || p.KeyBlocks > 1<<12 {
		errs = append(errs, fmt.Errorf("%s.key_blocks: %d is not between 1 and 4096", key, p.KeyBlocks))
	}
	if p.MaxBlocks < 1 || p.MaxBlocks > 1<<24 {
		errs = append(errs, fmt.Errorf("%s.max_blocks: %d is not between 1 and %d", key, p.MaxBlocks, 1<<24))
	}
	if p.LoadFactor < 1 {
		errs = append(errs, fmt.Errorf("%s.load_factor: %g is below 1 (1 means: never above the mean load)", key, p.LoadFactor))
	}
	if p.LoadSlack < 0 {
		errs = append(errs, fmt.Errorf("%s.load_slack: must not be negative", key))
	}
	if p.QueueSlack < 0 {
		errs = append(errs, fmt.Errorf("%s.queue_slack: must not be negative", key))
	}
	if p.Spread < 0 {
		errs = append(errs, fmt.Errorf("%s.spread: must not be negative", key))
	}
	return errors.Join(errs...)
}

// SetDefaults fills the keys left out.
func (h *EngineHealth) SetDefaults() {
	orDefault(&h.ConsecutiveFailures, DefaultConsecutiveFailures)
	orDefault(&h.BaseEjection, Duration(DefaultBaseEjection))
	orDefault(&h.MaxEjection, max(Duration(DefaultMaxEjection), h.BaseEjection))
	orDefault(&h.CheckPath, DefaultCheckPath)
	orDefault(&h.UnhealthyThreshold, DefaultUnhealthyThreshold)
	orDefault(&h.HealthyThreshold, DefaultHealthyThreshold)
	// Not capped by check_interval: a round of checks ends before the next
	// interval begins, so a check may take longer than the interval.
	orDefault(&h.CheckTimeout, Duration(DefaultCheckTimeout))
}

// Validate checks the health keys under key.
func (h EngineHealth) Validate(key string) error {
	var errs []error
	if h.ConsecutiveFailures < 1 {
		errs = append(errs, fmt.Errorf("%s.consecutive_failures: must be at least 1", key))
	}
	if h.BaseEjection <= 0 {
		errs = append(errs, fmt.Errorf("%s.base_ejection: must be positive", key))
	}
	if h.MaxEjection < h.BaseEjection {
		errs = append(errs, fmt.Errorf("%s.max_ejection: %s is below base_ejection %s", key, h.MaxEjection.D(), h.BaseEjection.D()))
	}
	if h.CheckInterval < 0 || h.CheckInterval > 0 && h.CheckInterval < Duration(minInterval) {
		errs = append(errs, fmt.Errorf("%s.check_interval: %s is neither 0 (active checks off) nor at least %s", key, h.CheckInterval.D(), minInterval))
	}
	if !strings.HasPrefix(h.CheckPath, "/") {
		errs = append(errs, fmt.Errorf("%s.check_path: %q does not start with /", key, h.CheckPath))
	}
	if h.CheckTimeout <= 0 {
		errs = append(errs, fmt.Errorf("%s.check_timeout: must be positive", key))
	}
	if h.UnhealthyThreshold < 1 {
		errs = append(errs, fmt.Errorf("%s.unhealthy_threshold: must be at least 1", key))
	}
	if h.HealthyThreshold < 1 {
		errs = append(errs, fmt.Errorf("%s.healthy_threshold: must be at least 1", key))
	}
	return errors.Join(errs...)
}

// SetDefaults fills the keys left out.
func (m *EngineMetrics) SetDefaults() {
	orDefault(&m.Path, DefaultMetricsPath)
	if m.Interval > 0 && m.Timeout == 0 {
		m.Timeout = min(m.Interval, Duration(time.Second))
	}
	if m.Interval > 0 && m.StaleAfter == 0 {
		m.StaleAfter = 3 * m.Interval
	}
}

// Validate checks the metrics keys under key.
func (m EngineMetrics) Validate(key string) error {
	var errs []error
	if m.Interval < 0 || m.Interval > 0 && m.Interval < Duration(minInterval) {
		errs = append(errs, fmt.Errorf("%s.interval: %s is neither 0 (scraping off) nor at least %s", key, m.Interval.D(), minInterval))
	}
	if !strings.HasPrefix(m.Path, "/") {
		errs = append(errs, fmt.Errorf("%s.path: %q does not start with /", key, m.Path))
	}
	if m.Interval > 0 && m.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("%s.timeout: must be positive", key))
	}
	if m.Interval > 0 && m.StaleAfter < m.Interval {
		errs = append(errs, fmt.Errorf("%s.stale_after: %s is below interval %s: every figure would be stale", key, m.StaleAfter.D(), m.Interval.D()))
	}
	return errors.Join(errs...)
}

// SetDefaults fills the keys left out; timeout is prefill.timeout.
func (a *PrefillAttempts) SetDefaults(timeout Duration) {
	orDefault(&a.Attempts, DefaultPrefillAttempts)
	orDefault(&a.AttemptTimeout, timeout)
}

// Validate checks the retry keys under key ("prefill"); timeout is prefill.timeout.
func (a PrefillAttempts) Validate(key string, timeout Duration) error {
	var errs []error
	if a.Attempts < 1 || a.Attempts > 10 {
		errs = append(errs, fmt.Errorf("%s.attempts: %d is not between 1 and 10", key, a.Attempts))
	}
	if a.AttemptTimeout <= 0 {
		errs = append(errs, fmt.Errorf("%s.attempt_timeout: must be positive", key))
	}
	if timeout > 0 && a.AttemptTimeout > timeout {
		errs = append(errs, fmt.Errorf("%s.attempt_timeout: %s exceeds %s.timeout %s", key, a.AttemptTimeout.D(), key, timeout.D()))
	}
	return errors.Join(errs...)
}

// validateHostPort accepts name:port with a port in 1..65535.
func validateHostPort(s string) error {
	host, port, err := net.SplitHostPort(s)
	if err != nil || host == "" {
		return fmt.Errorf("%q is not name:port", s)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("%q has no valid port", s)
	}
	return nil
}
