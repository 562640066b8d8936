package pdsim

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"
)

// Config describes one simulated engine. Zero durations mean "no latency".
type Config struct {
	Role     string // "prefill" | "decode" (default: a decode, which alone is an ordinary engine)
	Protocol string // "vllm-nixl" (default) | "sglang" | "shared-storage" | "vllm-mooncake"
	Model    string // served model name; default "pdsim"
	Addr     string // HTTP listen address; default "127.0.0.1:0"

	// KVAddr is the NIXL side-channel listener of a vllm-nixl prefill
	// (VLLM_NIXL_SIDE_CHANNEL_PORT), or the worker a vllm-mooncake prefill's
	// blocks are pulled from; default "127.0.0.1:0".
	KVAddr string
	// BootstrapAddr is the bootstrap server of an sglang or vllm-mooncake
	// prefill (VLLM_MOONCAKE_BOOTSTRAP_PORT); default "127.0.0.1:0".
	BootstrapAddr string
	// AdvertiseHost is the host put in remote_host (VLLM_NIXL_SIDE_CHANNEL_HOST).
	// Default: the listener's IP, or this machine's first non-loopback IP when the
	// listener binds all interfaces.
	AdvertiseHost string
	// SharedDir is the directory shared by prefill and decode (shared-storage);
	// default $TMPDIR/pdsim-shared.
	SharedDir string

	TTFT       time.Duration // prefill compute before the first token
	TPOT       time.Duration // between output tokens
	KVTransfer time.Duration // replaces TTFT on a decode that loads remote KV
	// OutputTokens is the natural answer length: the simulated model emits EOS
	// after this many tokens (default 16). max_tokens caps it (finish_reason
	// "length"), min_tokens extends it.
	OutputTokens int
	// MaxModelLen is the model's context in tokens (vLLM's --max-model-len,
	// SGLang's --context-length), listed at /v1/models; a request whose
	// prompt and output limit exceed it is refused (context.go). Default 32768.
	MaxModelLen int
	// StopOneToken ends a prefill's one-token answer on a stop token
	// (stoptoken.go).
	StopOneToken bool
	// HandshakeTimeout bounds the sglang bootstrap handshake on both legs; default 30s.
	HandshakeTimeout time.Duration
	// PromptTokensDetails adds usage.prompt_tokens_details.cached_tokens to
	// the answers, as vLLM does with --enable-prompt-tokens-details: only
	// when it is not 0, as most releases do.
	PromptTokensDetails bool
	// PrefixCacheBlocks is how many blocks of blockSize tokens the engine's
	// prefix cache keeps, the least recently used evicted first; default
	// kvCapacityBlocks.
	PrefixCacheBlocks int
	// KVBlocks is the GPU's KV cache in blocks, the whole of its reported
	// KV cache use; default kvCapacityBlocks.
	KVBlocks int
	// KVEvents publishes the prefix cache's changes as vLLM's KV events;
	// off unless KVEvents.Endpoint is set.
	KVEvents KVEvents
	// NoRender leaves out vLLM's render endpoints, as older vLLM releases
	// do (SGLang has none either).
	NoRender bool
	// RefuseServerInfo answers SGLang's server info with 401, as an SGLang
	// server started with --api-key does to a caller without its key.
	RefuseServerInfo bool
	// APIKey, when set, is the key the engine asks of its callers, as
	// vLLM's and SGLang's --api-key (apikey.go).
	APIKey string
	// MaxRecords bounds the requests Requests (and /pdsim/requests) keep,
	// bodies included: past it the older half is forgotten, so that a
	// simulator left under load does not grow without end. Default
	// DefaultMaxRecords.
	MaxRecords int
	// LoRA names the LoRA adapters served besides Model (vLLM's
	// --lora-modules): a request that names one is served, and its blocks
	// are keyed by the adapter's name as vLLM keys them.
	LoRA []string

	FailStatus        int           // answer this status to faulty requests
	FailEvery         int           // every FailEvery-th inference request is faulty (<=1: all)
	Delay             time.Duration // extra delay before answering any inference request
	DropConnections   bool          // faulty requests get their TCP connection closed instead
	DropKVEventsEvery int           // every DropKVEventsEvery-th batch of KV events is not sent (0: none)

	Log io.Writer // one line per request; default os.Stderr
}

// DefaultMaxRecords is Config.MaxRecords's default.
const DefaultMaxRecords = 10_000

// Roles and protocols accepted in Config.
const (
	RolePrefill = "prefill"
	RoleDecode  = "decode"

	ProtocolNIXL          = "vllm-nixl"
	ProtocolSGLang        = "sglang"
	ProtocolSharedStorage = "shared-storage"
	ProtocolMooncake      = "vllm-mooncake"
)

func withDefaults(c Config) (Config, error) {
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	def(&c.Role, RoleDecode)
	def(&c.Protocol, ProtocolNIXL)
	if c.Role != RolePrefill && c.Role != RoleDecode {
		return c, fmt.Errorf("pdsim: role %q: want %s or %s", c.Role, RolePrefill, RoleDecode)
	}
	switch c.Protocol {
	case ProtocolNIXL, ProtocolSGLang, ProtocolSharedStorage, ProtocolMooncake:
	default:
		return c, fmt.Errorf("pdsim: protocol %q: want %s, %s, %s or %s", c.Protocol, ProtocolNIXL, ProtocolSGLang, ProtocolSharedStorage, ProtocolMooncake)
	}
	def(&c.Model, "pdsim")
	def(&c.Addr, "127.0.0.1:0")
	def(&c.KVAddr, "127.0.0.1:0")
	def(&c.BootstrapAddr, "127.0.0.1:0")
	def(&c.SharedDir, filepath.Join(os.TempDir(), "pdsim-shared"))
	if c.OutputTokens <= 0 {
		c.OutputTokens = 16
	}
	if c.MaxModelLen <= 0 {
		c.MaxModelLen = defaultMaxModelLen
	}
	if c.KVBlocks <= 0 {
		c.KVBlocks = kvCapacityBlocks
	}
	if c.PrefixCacheBlocks <= 0 {
		c.PrefixCacheBlocks = kvCapacityBlocks
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = 30 * time.Second
	}
	if c.MaxRecords <= 0 {
		c.MaxRecords = DefaultMaxRecords
	}
	var err error
	c.KVEvents, err = c.KVEvents.withDefaults()
	return c, err
}
