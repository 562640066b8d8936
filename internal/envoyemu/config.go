// Package envoyemu is an Envoy emulator for tests: an HTTP/1.1 listener that
// behaves like Envoy's HTTP connection manager with the ext_proc filter and
// the router in front of an ORIGINAL_DST cluster, and that refuses what
// Envoy refuses. It is driven by a real Envoy bootstrap
// (config/envoy/envoy.yaml). Section numbers (§) in this
// package and its subpackages refer to docs/envoy.md. What the filter makes of the server's
// replies, and of their header mutations, is the rules subpackage's model,
// which the handlers' fuzz checker shares.
//
//	cfg, err := envoyemu.LoadConfig(".../config/envoy/envoy.yaml")
//	p, err := envoyemu.Start(cfg, extProcAddr) // or several: the cluster's endpoints
//	defer p.Close()
//	resp, err := http.Post(p.URL()+"/v1/completions", ...)
//	p.Upstreams() // where each request went
//
// Emulator-only additions: local replies carry Envoy's response code
// details in DetailsHeader; Config.Metadata.Initial stands for metadata an
// earlier filter would set; Config.GatewayFallbacks stands for a gateway
// that takes the endpoint-picker fallback list (§8.2); Config.Logf traces
// decisions.
//
// Both clusters, ext_proc and ORIGINAL_DST, enforce their circuit breakers
// (§12); ClusterStats reads Envoy's overflow counters. The ext_proc cluster
// speaks TLS, mTLS included, from its transport_socket (§13), its
// certificates from files or by file-based SDS, which it follows as they
// rotate; Config.Mounts points the bootstrap's paths at a test's own files.
//
// Refused rather than guessed (LoadConfig errors): observability mode,
// CEL attributes, mode_override, http_service, GRPC body mode, other HTTP
// filters, non-ORIGINAL_DST route clusters, per-host circuit breakers and
// retry budgets, retry policies beyond retry_on, num_retries,
// retriable_status_codes and retry_back_off, route and virtual host buffer
// limits, TLS on a route cluster, TLS settings other than files,
// file-based SDS, versions, SNI, ALPN and typed SAN matchers, use_remote_address without
// preserve_external_request_id.
package envoyemu

import (
	"time"

	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Envoy defaults used when the bootstrap leaves a field unset.
const (
	defaultMessageTimeout    = 200 * time.Millisecond // §5 DefaultMessageTimeoutMs
	defaultRouteTimeout      = 15 * time.Second       // §5 route timeout
	defaultStreamIdleTimeout = 5 * time.Minute        // §5 HCM stream_idle_timeout (UNCONFIRMED)
	defaultBufferLimit       = 1 << 20                // §2.3 (UNCONFIRMED 1 MiB)
	defaultMaxHeadersCount   = 100
	defaultMaxHeadersKB      = 60
	defaultOriginalDstHeader = "x-envoy-original-dst-host" // §8.1
	maxTimeout               = 3600 * time.Second          // §5: max for both message timeouts
	// defaultHTTP2Streams is http2_protocol_options.max_concurrent_streams
	// unset (protocol.proto): 2^31 - 1.
	defaultHTTP2Streams = 1<<31 - 1
)

// Config is what the emulator takes from an Envoy bootstrap, grouped as the
// ext_proc filter's settings are documented. Tests may change fields after
// LoadConfig; Start validates the result again.
type Config struct {
	// ListenAddr is where the emulator listens; default 127.0.0.1:0. The
	// bootstrap's own listener address is not used: tests need free ports.
	ListenAddr string

	Modes     Modes     // what the filter sends the server (§2)
	Failure   Failure   // how long it waits for a reply, and what a failure does (§5)
	Metadata  Metadata  // dynamic metadata to and from the server (§1.4, §3.7)
	Mutations Mutations // what the server's replies may change (§3, §4)
	// ForwardRules picks the headers the server sees (§1.3).
	ForwardRules *extprocfilterv3.HeaderForwardingRules
	Limits       Limits // the connection manager's, the listener's and the gRPC client's

	Routes   []Route
	Clusters map[string]*Cluster // every static cluster, by name
	// ExtProcCluster names the cluster of grpc_service.envoy_grpc; its
	// endpoints are the addresses given to Start, its circuit breakers and
	// HTTP/2 stream limit are the bootstrap's (Envoy's defaults without one).
	ExtProcCluster string
	// InitialMetadata is grpc_service.initial_metadata: headers sent on
	// every ext_proc stream, each value evaluated against the client's
	// request (session affinity, docs/envoy.md §14).
	InitialMetadata []MetadataValue
	// SuppressEnvoyHeaders is the router's suppress_envoy_headers: no
	// x-envoy-overloaded on an overflow reply (§12), no
	// x-envoy-expected-rq-timeout-ms upstream.
	SuppressEnvoyHeaders bool
	// ClientHeaders is what the connection manager does with the client's
	// forwarding headers and request id.
	ClientHeaders ClientHeaders
	// LocalReplies is the connection manager's local_reply_config (§15).
	LocalReplies LocalReplies
	// GatewayFallbacks makes the router a gateway of the endpoint-picker
	// protocol (§8.2) rather than plain Envoy: it reads the ORIGINAL_DST
	// value as a comma-separated list, sends to its first valid endpoint,
	// retries down the list as the route's retry policy says, and reports
	// the endpoint that answered in the stream's envoy.lb metadata
	// (x-gateway-destination-endpoint-served). Emulator-only knob.
	GatewayFallbacks bool

	// Mounts maps the directories the bootstrap names to the host's, as a
	// container's bind mounts do (/etc/envoy/certs to a test's directory):
	// every file the emulator reads, and every directory it watches, goes
	// through them. A path under none is read as it is.
	Mounts map[string]string

	// Logf, when set, receives debug lines (e.g. t.Logf).
	Logf func(format string, args ...any)
}

// logf writes a debug line when Logf is set.
func (cfg *Config) logf(format string, args ...any) {
	if cfg.Logf != nil {
		cfg.Logf("envoy-emulator: "+format, args...)
	}
}

// Modes is the filter's processing_mode (§2).
type Modes struct {
	Request, Response DirectionModes
	// SendBodyWithoutWaitingForHeaderResponse applies to STREAMED only (§2.4).
	SendBodyWithoutWaitingForHeaderResponse bool
}

// DirectionModes is one direction's processing mode. Header and trailer
// modes use DEFAULT like Envoy: headers DEFAULT = SEND, trailers DEFAULT =
// SKIP.
type DirectionModes struct {
	Headers  extprocfilterv3.ProcessingMode_HeaderSendMode
	Body     extprocfilterv3.ProcessingMode_BodySendMode
	Trailers extprocfilterv3.ProcessingMode_HeaderSendMode
}

// Failure is the filter's message timer and failure handling (§5).
type Failure struct {
	FailureModeAllow  bool
	MessageTimeout    time.Duration // default 200ms
	MaxMessageTimeout time.Duration // default 0 = override disabled
	StatusOnError     int           // default 500
}

// Metadata is metadata_options, and what earlier filters put on the stream.
type Metadata struct {
	ReceivingNamespaces  []string // §3.7 receiving_namespaces.untyped
	ForwardingNamespaces []string // §1.4 forwarding_namespaces.untyped
	// Initial is dynamic metadata that earlier filters put on the stream (for
	// example an envoy.lb.subset_hint). Emulator-only knob.
	Initial map[string]*structpb.Struct
}

// Mutations is what the server's replies may change, and how.
type Mutations struct {
	Rules                    *mutationrulesv3.HeaderMutationRules // §3.3, nil = defaults
	HeaderPrefix             string                               // bootstrap header_prefix, default x-envoy
	AllowContentLengthHeader bool                                 // keeps Content-Length in the §3.5 cases (newer Envoy)
	RouteCacheAction         extprocfilterv3.ExternalProcessor_RouteCacheAction
	DisableClearRouteCache   bool
	DisableImmediateResponse bool // §4
}

// Limits bound the exchange outside the filter's own rules.
type Limits struct {
	BufferLimitBytes  int           // listener per_connection_buffer_limit_bytes (§2.3), also the most body kept for a retry
	StreamIdleTimeout time.Duration // HCM stream_idle_timeout; 0 = disabled
	MaxHeadersCount   int           // HCM common_http_protocol_options.max_headers_count
	MaxHeadersKB      int           // HCM max_request_headers_kb
	// MaxReceiveMessageLength is grpc_service.envoy_grpc.max_receive_message_length
	// (0 = unlimited).
	MaxReceiveMessageLength int
}

// ClientHeaders are the HCM's use_remote_address and its companions. With
// UseRemoteAddress Envoy appends the peer's address (the node's for a peer
// on 127.0.0.1 or ::1) to x-forwarded-for (unless SkipXFFAppend) and
// overwrites x-forwarded-proto. The emulator keeps the client's x-request-id, which
// is what Envoy does with preserve_external_request_id, or without
// use_remote_address; the one other combination is refused at load.
type ClientHeaders struct {
	UseRemoteAddress          bool
	SkipXFFAppend             bool
	PreserveExternalRequestID bool
}

// Route is one route of the route table, matched in order.
type Route struct {
	Prefix  string // match.prefix, or
	Path    string // match.path (exact)
	Cluster string
	// Timeout is the route timeout; 0 means none (§5, envoy#35812).
	Timeout time.Duration
	Retry   *RetryPolicy // retry_policy, the route's or its virtual host's; nil: none
}

// Cluster is a static cluster of the bootstrap. Routes may target only
// ORIGINAL_DST clusters; the ext_proc cluster is the other one emulated.
type Cluster struct {
	Name        string
	OriginalDst *OriginalDst // nil: not an ORIGINAL_DST cluster
	// Breakers are its circuit breakers (§12); the zero value stands for
	// Envoy's defaults in a hand-made Config.
	Breakers Thresholds
	// StreamsPerConnection is 1 over HTTP/1 and http2_protocol_options'
	// max_concurrent_streams over HTTP/2; 0 means the protocol's default.
	StreamsPerConnection int
	// TLS is its transport_socket, nil for plaintext (§13). Only the ext_proc
	// cluster may have one.
	TLS *UpstreamTLS
	// HashHeaders are the headers its HttpProtocolOptions.hash_policy
	// hashes when its lb_policy is RING_HASH or MAGLEV, nil otherwise. A
	// stream carrying none of them is balanced as without a hash (§14).
	HashHeaders []HashHeader
}

// OriginalDst is original_dst_lb_config (§8.1).
type OriginalDst struct {
	UseHTTPHeader bool
	HeaderName    string // default x-envoy-original-dst-host
	// MetadataNamespace / MetadataPath form metadata_key; empty namespace =
	// metadata not consulted.
	MetadataNamespace string
	MetadataPath      []string
	PortOverride      uint32 // 0 = none
}
