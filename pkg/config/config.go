// Package config defines the extproc configuration file: its schema, defaults and
// validation. Errors name the offending key, as a user wrote it.
package config

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"time"
	"unicode"

	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// Config is the whole configuration file.
type Config struct {
	Connector string   `json:"connector"`
	Pools     Pools    `json:"pools"`
	Prefill   Prefill  `json:"prefill"`
	Limits    Limits   `json:"limits"`
	Envoy     Envoy    `json:"envoy"`
	Tracing   Tracing  `json:"tracing"`
	PD        PD       `json:"pd"`
	Routes    Routes   `json:"routes"`
	Response  Response `json:"response"`
	// Admission sheds requests of low priority while the engines are
	// saturated (admission.go).
	Admission Admission `json:"admission"`
	// ignored are the keys set that do nothing without their switch (Ignored).
	ignored []string
}

// Pools lists the engine endpoints of each role.
type Pools struct {
	Prefill Pool `json:"prefill"`
	Decode  Pool `json:"decode"`
}

// namedPool is a pool with the name its keys start with (pools.<name>).
type namedPool struct {
	name string
	Pool
}

// named is each pool with its name, prefill first.
func (p Pools) named() []namedPool { return []namedPool{{"prefill", p.Prefill}, {"decode", p.Decode}} }

// Pool is one role's endpoints and how they are picked.
type Pool struct {
	Endpoints     []string `json:"endpoints"`
	BootstrapPort int      `json:"bootstrap_port,omitempty"` // kv-sglang and kv-mooncake only
	// TLS makes the decode pool's health checks and /metrics scrapes HTTPS
	// (the decode leg itself is Envoy's). The prefill pool's follow prefill.tls.
	TLS EngineTLS `json:"tls"`
	// APIKeyFile holds the decode engines' API key (engines.go).
	APIKeyFile string `json:"api_key_file,omitempty"`
	// Kubernetes discovers more endpoints from the Kubernetes API (kubernetes.go).
	Kubernetes *Kubernetes `json:"kubernetes,omitempty"`
	PoolScheduling
}

// Configured reports whether the pool names a source of endpoints: a list,
// a DNS name or Kubernetes discovery. A config without a decode pool is
// valid (the embedded default names no engine); the server then stays not
// ready and says what to set.
func (p Pool) Configured() bool {
	return len(p.Endpoints) > 0 || p.DNS != "" || p.Kubernetes != nil
}

// Failure policies for a prefill leg that cannot be completed.
const (
	OnFailureDecodeOnly = "decode-only"
	OnFailureFail       = "fail"
)

// Prefill configures the prefill leg. Timeout bounds the whole prefill phase of
// a request, retries included; each attempt has its own AttemptTimeout.
type Prefill struct {
	Timeout   Duration  `json:"timeout"`
	OnFailure string    `json:"on_failure"`
	TLS       EngineTLS `json:"tls"`
	// APIKeyFile holds the prefill engines' API key (engines.go).
	APIKeyFile string `json:"api_key_file,omitempty"`
	// HTTP2 speaks HTTP/2 to the engines: cleartext with prior knowledge
	// (h2c), or negotiated with TLS. Off by default: vLLM and SGLang serve HTTP/1.1.
	HTTP2 bool `json:"http2"`
	// MaxIdleConnsPerEndpoint sizes the keep-alive pool per prefill engine;
	// beyond it, each concurrent leg opens and closes its own connection.
	MaxIdleConnsPerEndpoint int `json:"max_idle_conns_per_endpoint"`
	// MaxConnsPerEndpoint bounds the connections open to one prefill engine
	// at once; a leg past it waits for one, within its attempt's timeout.
	MaxConnsPerEndpoint int `json:"max_conns_per_endpoint"`
	// MaxBackground bounds the kv-sglang prefill legs running in the
	// background, which outlive their streams; past it a request gets 503
	// with Retry-After. Default: limits.max_concurrent_streams.
	MaxBackground int `json:"max_background"`
	PrefillAttempts
}

// Limits bounds what one request, and all of them together, may use.
type Limits struct {
	MaxBodyBytes int64 `json:"max_body_bytes"`
	// MaxConcurrentStreams bounds the requests in progress at once; past it a
	// request is refused at once with 429 and Retry-After, never queued.
	MaxConcurrentStreams int `json:"max_concurrent_streams"`
	// RetryAfter is the Retry-After a refused request is given.
	RetryAfter Duration `json:"retry_after"`
	// BodyTimeout bounds how long a request body may take to arrive, from its
	// headers on: a body not complete by then gets 408 and gives its stream
	// slot and buffer back.
	BodyTimeout Duration `json:"body_timeout"`
	// MaxBufferedBytes bounds the request bodies held at once, all streams
	// together; past it a request gets 503 with Retry-After. 0 (the default)
	// derives it from the container's memory limit (limits.go).
	MaxBufferedBytes int64 `json:"max_buffered_bytes"`
}

// Defaults for keys the file leaves out.
const (
	DefaultBootstrapPort = 8998
	DefaultMaxBodyBytes  = 32 << 20
	// maxEnvoyMessageTimeout bounds Envoy's ext_proc message_timeout and
	// max_message_timeout (the proto's lte: 3600s), so an override above it
	// is never honoured.
	maxEnvoyMessageTimeout = time.Hour
	// MaxMaxBodyBytes is the largest limits.max_body_bytes: a BUFFERED body
	// comes whole in one gRPC message, at most 2 GiB (math.MaxInt32), with
	// room for the rest of the message.
	MaxMaxBodyBytes = 2<<30 - 2<<20
	// DefaultMaxConcurrentStreams keeps a replica's memory bounded: each stream
	// may hold a body up to limits.max_body_bytes (and its rewritten copy).
	DefaultMaxConcurrentStreams = 1024
	DefaultPrefillTimeout       = 30 * time.Second
	DefaultBodyTimeout          = 60 * time.Second
	// DefaultMaxConnsPerEndpoint: twice the keep-alive pool, so that a burst
	// still opens connections, but a flood of kv-sglang legs (each holds its
	// connection for the whole prefill) cannot open one per request.
	DefaultMaxConnsPerEndpoint = 512
)

// Parse reads a YAML configuration, fills defaults and validates it.
// Unknown keys are errors: a misspelt key must not silently fall back to a
// default. So is a file without `connector`: no default can match the engines.
func Parse(data []byte) (*Config, error) { return parse(data, nil) }

// errNoConnector names what a file without `connector` must choose from.
var errNoConnector = fmt.Errorf("connector: not set; name the engines' KV transfer: %s (vLLM NixlConnector), %s (vLLM "+
	"ExampleConnector or LMCache on a shared store), %s (SGLang PD) or %s (vLLM MooncakeConnector)", kv.NIXL, kv.SharedStorage, kv.SGLang, kv.Mooncake)

// Unconfigured parses the embedded default config, run without --config. It
// names no connector and no engine: the server starts, routes nothing and
// stays not ready. The pipeline still needs a connector: it gets
// kv-shared-storage, which puts nothing on the wire, and with no decode
// engine no request reaches it.
func Unconfigured(data []byte) (*Config, error) {
	return parse(data, func(c *Config) error {
		if c.Connector != "" || c.Pools.Prefill.Configured() || c.Pools.Decode.Configured() {
			return errors.New("the default config names a connector or engines: give such a file with --config")
		}
		c.Connector = kv.SharedStorage
		return nil
	})
}

// parse decodes data strictly, lets prepare see the keys as written, then
// fills defaults and validates.
func parse(data []byte, prepare func(*Config) error) (*Config, error) {
	var c Config
	if err := caseSensitive(data); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		if bad := (*json.UnmarshalTypeError)(nil); errors.As(err, &bad) && bad.Field != "" {
			return nil, fmt.Errorf("config: %s: cannot take %s as %s", keyOf(bad.Field), bad.Value, bad.Type)
		}
		if nf := nonFinite(data); nf != nil { // YAML's conversion to JSON refused it, naming no key
			err = nf
		}
		return nil, fmt.Errorf("config: %w", err)
	}
	if prepare != nil {
		if err := prepare(&c); err != nil {
			return nil, fmt.Errorf("config: %w", err)
		}
	}
	c.ignored = append(c.Pools.ignored(), c.Admission.ignored()...) // before the defaults fill the keys left out
	c.setDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return &c, nil
}

// caseSensitive refuses a key that matches one of ours only when case is
// ignored ("Policy" for "policy"), which encoding/json would take, and which
// would silently override the key as written when both are given. Kubernetes
// decodes its objects alike (sigs.k8s.io/json). Other faults are left to the
// decoding that follows, whose errors name the key.
func caseSensitive(data []byte) error {
	j, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil
	}
	strict, _ := kjson.UnmarshalStrict(j, &Config{}, kjson.DisallowUnknownFields)
	return errors.Join(strict...)
}

// Load reads and parses the file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return Parse(data)
}

// orDefault sets *v to def when it is the zero value: a key left out.
func orDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

func (c *Config) setDefaults() {
	orDefault(&c.Pools.Prefill.BootstrapPort, DefaultBootstrapPort)
	orDefault(&c.Prefill.Timeout, Duration(DefaultPrefillTimeout))
	orDefault(&c.Prefill.MaxIdleConnsPerEndpoint, 256)
	orDefault(&c.Prefill.MaxConnsPerEndpoint, DefaultMaxConnsPerEndpoint)
	orDefault(&c.Prefill.OnFailure, OnFailureDecodeOnly)
	orDefault(&c.Limits.MaxBodyBytes, DefaultMaxBodyBytes)
	orDefault(&c.Limits.MaxConcurrentStreams, DefaultMaxConcurrentStreams)
	orDefault(&c.Prefill.MaxBackground, c.Limits.MaxConcurrentStreams)
	orDefault(&c.Limits.RetryAfter, Duration(time.Second))
	orDefault(&c.Limits.BodyTimeout, Duration(DefaultBodyTimeout))
	if c.Limits.MaxBufferedBytes == 0 {
		// One body of the largest size must always fit.
		c.Limits.MaxBufferedBytes = max(DefaultMaxBufferedBytes(cgroupFS), c.Limits.MaxBodyBytes)
	}
	c.Admission.SetDefaults()
	orDefault(&c.Admission.MaxHeld, max(1, c.Limits.MaxConcurrentStreams/2))
	orDefault(&c.Envoy.OverrideAfter, Duration(150*time.Millisecond))
	orDefault(&c.Envoy.OverrideMessageTimeout, min(c.Prefill.Timeout+c.Admission.Held()+Duration(30*time.Second), Duration(maxEnvoyMessageTimeout)))
	c.Tracing.SetDefaults()
	c.Response.SetDefaults()
	c.Pools.Prefill.PoolScheduling.SetDefaults()
	c.Pools.Decode.PoolScheduling.SetDecodeDefaults(c.PD.Mode)
	c.PD.SetDefaults()
	c.Routes.SetDefaults()
	c.Prefill.PrefillAttempts.SetDefaults(c.Prefill.Timeout)
}

func (c *Config) validate() error {
	var errs []error
	connector, err := kv.Build(c.Connector)
	switch {
	case c.Connector == "":
		errs = append(errs, errNoConnector)
	case err != nil:
		errs = append(errs, fmt.Errorf("connector: %w", err))
	}
	errs = append(errs, validateEndpoints("pools.prefill.endpoints", c.Pools.Prefill.Endpoints)...)
	errs = append(errs, validateEndpoints("pools.decode.endpoints", c.Pools.Decode.Endpoints)...)
	if p := c.Pools.Prefill.BootstrapPort; p < 1 || p > 65535 {
		errs = append(errs, fmt.Errorf("pools.prefill.bootstrap_port: %d is not a port", p))
	}
	if c.Pools.Decode.BootstrapPort != 0 {
		errs = append(errs, errors.New("pools.decode.bootstrap_port: only the prefill pool has a bootstrap port"))
	}
	if c.Pools.Prefill.Fallbacks > 0 {
		errs = append(errs, errors.New("pools.prefill.fallbacks: only the decode pool has fallbacks (prefill.attempts is the prefill retry budget)"))
	}
	for _, n := range []struct {
		key   string
		value int64
	}{
		{"prefill.timeout", int64(c.Prefill.Timeout)},
		{"prefill.max_idle_conns_per_endpoint", int64(c.Prefill.MaxIdleConnsPerEndpoint)},
		{"prefill.max_conns_per_endpoint", int64(c.Prefill.MaxConnsPerEndpoint)},
		{"prefill.max_background", int64(c.Prefill.MaxBackground)},
		{"limits.max_body_bytes", c.Limits.MaxBodyBytes},
		{"limits.max_concurrent_streams", int64(c.Limits.MaxConcurrentStreams)},
		{"limits.body_timeout", int64(c.Limits.BodyTimeout)},
	} {
		if n.value < 0 {
			errs = append(errs, fmt.Errorf("%s: must not be negative", n.key)) // 0: the default, or no bound
		}
	}
	if connector != nil && connector.Paired() && (c.PD.Mode == PDNever || c.PD.MinPromptTokens > 0 || len(c.PD.cacheKeys("pd")) > 0) {
		errs = append(errs, fmt.Errorf("pd.mode, pd.min_prompt_tokens, pd.min_uncached_tokens, pd.max_uncached_ratio, pd.load: "+
			"%s cannot send a request decode-only (its decode engines serve only prefill/decode pairs)", c.Connector))
	}
	errs = append(errs, c.validateCacheRules(), c.validateAdmission())
	errs = append(errs, c.validateEngineAccess())
	errs = append(errs, c.Prefill.TLS.Validate("prefill.tls"), c.Pools.Decode.TLS.Validate("pools.decode.tls"), c.Response.Validate("response"))
	if c.Prefill.OnFailure != OnFailureDecodeOnly && c.Prefill.OnFailure != OnFailureFail {
		errs = append(errs, fmt.Errorf("prefill.on_failure: %q is not %q or %q", c.Prefill.OnFailure, OnFailureDecodeOnly, OnFailureFail))
	}
	if c.Limits.MaxBodyBytes > MaxMaxBodyBytes {
		errs = append(errs, fmt.Errorf("limits.max_body_bytes: %d is above %d: a gRPC message, which carries a BUFFERED body whole, "+
			"holds at most 2 GiB", c.Limits.MaxBodyBytes, MaxMaxBodyBytes))
	}
	if c.Limits.MaxBufferedBytes < c.Limits.MaxBodyBytes {
		errs = append(errs, fmt.Errorf("limits.max_buffered_bytes: %d is below limits.max_body_bytes (%d): no body of that size could be held",
			c.Limits.MaxBufferedBytes, c.Limits.MaxBodyBytes))
	}
	if c.Limits.RetryAfter < Duration(time.Second) {
		errs = append(errs, errors.New("limits.retry_after: must be at least 1s (Retry-After is in whole seconds)"))
	}
	if c.Envoy.OverrideAfter < 0 || c.Envoy.OverrideMessageTimeout < 0 {
		errs = append(errs, errors.New("envoy.override_after, envoy.override_message_timeout: must not be negative"))
	}
	if c.Envoy.OverrideMessageTimeout > Duration(maxEnvoyMessageTimeout) {
		errs = append(errs, fmt.Errorf("envoy.override_message_timeout: %s is above Envoy's bound on max_message_timeout, 1h: Envoy would ignore it",
			c.Envoy.OverrideMessageTimeout.D()))
	}
	errs = append(errs, c.Tracing.Validate("tracing"),
		c.Pools.Prefill.Kubernetes.Validate("pools.prefill.kubernetes"),
		c.Pools.Decode.Kubernetes.Validate("pools.decode.kubernetes"),
		c.Pools.Prefill.PoolScheduling.Validate("pools.prefill"),
		c.Pools.Decode.PoolScheduling.Validate("pools.decode"),
		c.PD.Validate("pd"),
		c.Routes.Validate("routes", c.Connector, connector),
		c.Prefill.PrefillAttempts.Validate("prefill", c.Prefill.Timeout))
	return errors.Join(errs...)
}

// Duration is a time.Duration written as a Go duration string ("30s", "150ms").
type Duration time.Duration

// D returns the value as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// UnmarshalJSON accepts a duration string.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return badValue[Duration](b, `a duration such as "30s"`)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return badValue[Duration](b, `a duration such as "30s": `+strings.TrimPrefix(err.Error(), "time: "))
	}
	*d = Duration(v)
	return nil
}

// keyOf is the key a value sits under, from encoding/json's path to its
// field, which names embedded structs too (pools.decode.PoolScheduling.
// metrics): the config's keys are lower case, Go's field names are not.
func keyOf(field string) string {
	parts := strings.Split(field, ".")
	return strings.Join(slices.DeleteFunc(parts, func(p string) bool { return p != "" && unicode.IsUpper(rune(p[0])) }), ".")
}

// badValue is raw refused by a type of ours, as encoding/json's own type
// errors are, so that the error names the key the value sits under
// (encoding/json adds it to such an error only): want says what would do.
func badValue[T any](raw []byte, want string) error {
	return &json.UnmarshalTypeError{Value: strings.TrimSpace(string(raw)) + " (want " + want + ")", Type: reflect.TypeFor[T]()}
}

// MarshalJSON writes the duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }
