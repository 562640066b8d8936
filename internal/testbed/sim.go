package testbed

import (
	"cmp"
	"io"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// Timings are a simulator's latencies and answer length.
type Timings struct {
	TTFT, TPOT, KVTransfer time.Duration
	OutputTokens           int           // the natural answer length (max_tokens caps it)
	HandshakeTimeout       time.Duration // the kv-sglang bootstrap handshake bound of both legs
}

// SimConfig is one engine simulator on loopback.
type SimConfig struct {
	Role, Protocol string // pdsim.RolePrefill or RoleDecode; pdsim.ProtocolNIXL, ...
	// IP is where every listener of the simulator is; default 127.0.0.1.
	// Simulators on IPs of their own are like engines on their own hosts:
	// SGLang prefills can then share one bootstrap port, as a pool config says.
	IP string
	// Addr is the HTTP listen address; default IP:0 (a restart passes the
	// address the simulator had).
	Addr string
	// KVPort and BootstrapPort are the NIXL side channel's and the SGLang
	// bootstrap server's ports on IP; 0: any free one.
	KVPort, BootstrapPort int
	SharedDir             string // kv-shared-storage's directory
	// PromptTokensDetails reports cached tokens in the usage (vLLM's
	// --enable-prompt-tokens-details).
	PromptTokensDetails bool
	// KVEventsPort, when set, has the simulator publish its KV cache events
	// on IP:KVEventsPort (bound, as vLLM's tcp://*:5557), with a replay
	// socket on IP:KVReplayPort when that is set, in KVEncoding (default
	// vLLM's current one).
	KVEventsPort, KVReplayPort int
	KVEncoding                 string
	PrefixCacheBlocks          int      // the prefix cache's size; 0: pdsim's default
	KVBlocks                   int      // the KV cache's size; 0: pdsim's default
	NoRender                   bool     // no render endpoints, as older vLLM releases
	RefuseServerInfo           bool     // SGLang's server info refused (401), as with --api-key
	APIKey                     string   // the key it asks of its callers (--api-key)
	Model                      string   // the served model's name; default pdsim's, "pdsim"
	LoRA                       []string // LoRA adapters served besides the model
	MaxModelLen                int      // the model's context; 0: pdsim's default
	StopOneToken               bool     // a prefill's one-token answer stops, where the request allows
	Timings
	Log io.Writer // a line per request; nil discards them
}

// StartSim starts an engine simulator in this process and hands its Close to c.
func StartSim(c Cleaner, cfg SimConfig) (*pdsim.Server, error) {
	ip := cmp.Or(cfg.IP, "127.0.0.1")
	var events pdsim.KVEvents
	if cfg.KVEventsPort > 0 {
		// Block hashes as ints, vLLM's default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
		events = pdsim.KVEvents{Endpoint: "tcp://" + hostPort(ip, cfg.KVEventsPort), Encoding: cfg.KVEncoding, Bind: true, IntHashes: true}
		if cfg.KVReplayPort > 0 {
			events.ReplayEndpoint = "tcp://" + hostPort(ip, cfg.KVReplayPort)
		}
	}
	s, err := pdsim.Start(pdsim.Config{
		KVEvents: events, PrefixCacheBlocks: cfg.PrefixCacheBlocks, KVBlocks: cfg.KVBlocks, NoRender: cfg.NoRender, Model: cfg.Model, LoRA: cfg.LoRA,
		RefuseServerInfo: cfg.RefuseServerInfo, APIKey: cfg.APIKey, MaxModelLen: cfg.MaxModelLen, StopOneToken: cfg.StopOneToken,
		Role: cfg.Role, Protocol: cfg.Protocol, SharedDir: cfg.SharedDir,
		Addr:          cmp.Or(cfg.Addr, hostPort(ip, 0)),
		KVAddr:        hostPort(ip, cfg.KVPort),
		BootstrapAddr: hostPort(ip, cfg.BootstrapPort),
		TTFT:          cfg.TTFT, TPOT: cfg.TPOT, KVTransfer: cfg.KVTransfer,
		OutputTokens: cfg.OutputTokens, HandshakeTimeout: cfg.HandshakeTimeout, PromptTokensDetails: cfg.PromptTokensDetails,
		Log: cmp.Or[io.Writer](cfg.Log, io.Discard),
	})
	if err != nil {
		return nil, err
	}
	c.Cleanup(func() { s.Close() })
	return s, nil
}

func hostPort(ip string, port int) string { return net.JoinHostPort(ip, strconv.Itoa(port)) }

// QuoteAll writes addrs as the items of a YAML flow list: each quoted, joined
// by ", ".
func QuoteAll(addrs []string) string {
	q := make([]string, len(addrs))
	for i, a := range addrs {
		q[i] = strconv.Quote(a)
	}
	return strings.Join(q, ", ")
}

// Addrs lists the simulators' HTTP addresses: a pool's endpoints.
func Addrs(sims []*pdsim.Server) []string {
	out := make([]string, len(sims))
	for i, s := range sims {
		out[i] = s.Addr()
	}
	return out
}
