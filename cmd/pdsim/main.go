// Command pdsim runs a simulated vLLM or SGLang engine for prefill/decode
// disaggregation: start one with --role prefill and one with --role decode,
// put a P/D router in front, and watch the x-pdsim-kv* response headers.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdsim:", err)
		os.Exit(1)
	}
}

// run serves until ctx ends, then stops the engine (in-flight requests are cancelled).
func run(ctx context.Context, args []string, stderr io.Writer) error {
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	cfg.Log = stderr
	s, err := pdsim.Start(cfg)
	if err != nil {
		return err
	}
	<-ctx.Done()
	return s.Close()
}

func parseFlags(args []string, stderr io.Writer) (pdsim.Config, error) {
	var c pdsim.Config
	fs := flag.NewFlagSet("pdsim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.Role, "role", pdsim.RoleDecode, "prefill | decode")
	fs.StringVar(&c.Protocol, "protocol", pdsim.ProtocolNIXL, "vllm-nixl | sglang | shared-storage | vllm-mooncake")
	fs.StringVar(&c.Model, "model", "pdsim", "served model name")
	fs.Func("lora-modules", "LoRA adapters served besides --model, as vLLM's --lora-modules names them (name or name=path, comma-separated; no weights are read); their blocks are keyed by their names", func(v string) error {
		for _, m := range strings.Split(v, ",") {
			name, _, _ := strings.Cut(m, "=")
			c.LoRA = append(c.LoRA, name)
		}
		return nil
	})
	fs.StringVar(&c.APIKey, "api-key", os.Getenv("VLLM_API_KEY"), "ask callers for Authorization: Bearer <key> on every path but /health, /ping, /load, /version, /metrics (401 without), as vLLM's --api-key; default $VLLM_API_KEY")
	fs.StringVar(&c.Addr, "addr", ":8000", "HTTP (OpenAI API) listen address")
	fs.StringVar(&c.KVAddr, "kv-addr", ":5600", "vllm-nixl prefill: NIXL side-channel listen address (VLLM_NIXL_SIDE_CHANNEL_PORT); vllm-mooncake prefill: the worker the decode pulls KV from")
	fs.StringVar(&c.BootstrapAddr, "bootstrap-addr", ":8998", "sglang or vllm-mooncake prefill: bootstrap server listen address (VLLM_MOONCAKE_BOOTSTRAP_PORT)")
	fs.StringVar(&c.AdvertiseHost, "advertise-host", "", "host to hand out as remote_host (VLLM_NIXL_SIDE_CHANNEL_HOST); default: the listen IP, or the first non-loopback IP")
	fs.StringVar(&c.SharedDir, "shared-dir", filepath.Join(os.TempDir(), "pdsim-shared"), "shared-storage: directory shared by prefill and decode")
	fs.DurationVar(&c.TTFT, "ttft", 100*time.Millisecond, "prefill compute time before the first token")
	fs.DurationVar(&c.TPOT, "tpot", 10*time.Millisecond, "time per output token after the first")
	fs.DurationVar(&c.KVTransfer, "kv-transfer", 20*time.Millisecond, "KV transfer time, replacing --ttft on a decode that loads remote KV")
	fs.IntVar(&c.MaxModelLen, "max-model-len", 32768, "the model's context in tokens, as vLLM's --max-model-len or SGLang's --context-length: listed at GET /v1/models; a chat, completions (or, vLLM, Messages) request whose prompt and output limit exceed it gets the engine's 400")
	fs.BoolVar(&c.StopOneToken, "stop-one-token", false, "prefill: end a one-token answer on a stop token (finish_reason stop) unless the request sets min_tokens >= 1 or ignore_eos; a vllm-nixl prefill then gives no kv_transfer_params, as older NixlConnector releases, and a vllm-mooncake prefill keeps no KV, as MooncakeConnector")
	fs.IntVar(&c.OutputTokens, "output-tokens", 16, "tokens the model emits before EOS; max_tokens caps it, min_tokens extends it")
	fs.DurationVar(&c.HandshakeTimeout, "handshake-timeout", 30*time.Second, "sglang, vllm-mooncake: how long each leg waits for the other")
	fs.IntVar(&c.PrefixCacheBlocks, "prefix-cache-blocks", 8192, "blocks of 16 tokens the prefix cache keeps, the least recently used evicted first")
	fs.BoolVar(&c.PromptTokensDetails, "enable-prompt-tokens-details", false, "report usage.prompt_tokens_details.cached_tokens, as vLLM's flag of that name does")
	fs.IntVar(&c.MaxRecords, "max-records", pdsim.DefaultMaxRecords, "requests kept for GET /pdsim/requests, bodies included; past it the older half is forgotten")
	fs.IntVar(&c.FailStatus, "fail-status", 0, "answer this HTTP status to faulty requests (0: none)")
	fs.IntVar(&c.FailEvery, "fail-every", 1, "every N-th inference request is faulty")
	fs.DurationVar(&c.Delay, "delay", 0, "extra delay before answering each inference request")
	fs.BoolVar(&c.DropConnections, "drop-connections", false, "close faulty requests' TCP connections without answering")
	fs.StringVar(&c.KVEvents.Endpoint, "kv-events-endpoint", "", "publish the prefix cache's changes as vLLM's KV events on this ZeroMQ PUB endpoint "+
		"(vLLM's --kv-events-config endpoint): tcp://*:5557 binds, tcp://host:5557 connects to a subscriber that binds; empty: none")
	fs.StringVar(&c.KVEvents.ReplayEndpoint, "kv-events-replay-endpoint", "", "bind a ZeroMQ ROUTER here that replays buffered KV event batches from a sequence number (replay_endpoint), e.g. tcp://*:5558")
	fs.StringVar(&c.KVEvents.Topic, "kv-events-topic", "", "topic of the KV event messages; default kv@<advertised host>:<http port>@<model>")
	fs.StringVar(&c.KVEvents.Encoding, "kv-events-encoding", pdsim.KVEncodingMap, "KV event msgpack layout: map (current vLLM) | map-events (map events in an array batch, vLLM 0.26) | array (older vLLM's array_like)")
	fs.BoolVar(&c.KVEvents.IntHashes, "kv-events-int-hashes", false, "send block hashes as 64-bit ints, as vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, not as 32 sha256 bytes")
	fs.IntVar(&c.KVEvents.BufferSteps, "kv-events-buffer-steps", 10_000, "KV event batches kept for replay (buffer_steps)")
	fs.IntVar(&c.DropKVEventsEvery, "kv-events-drop-every", 0, "leave every N-th KV event batch unsent (its sequence number still passes; replay has it); 0: none")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	return c, nil
}
