// Package envoyemu is an Envoy emulator for tests: an HTTP/1.1 listener that
// behaves like Envoy's HTTP connection manager with the ext_proc filter and
// the router in front of an ORIGINAL_DST cluster, and that refuses what
// Envoy refuses. It is driven by a real Envoy bootstrap
// (config/envoy/envoy.yaml). Section numbers (§) refer to
// shared/reference/envoy-ext-proc.md.
//
//	cfg, err := envoyemu.LoadConfig(".../config/envoy/envoy.yaml")
//	p, err := envoyemu.Start(cfg, extProcAddr)
//	defer p.Close()
//	resp, err := http.Post(p.URL()+"/v1/completions", ...)
//	p.Upstreams() // where each request went
//
// Emulator-only additions: local replies carry Envoy's response code
// details in DetailsHeader; Config.InitialMetadata stands for metadata an
// earlier filter would set; Config.Logf traces decisions.
//
// Refused rather than guessed (LoadConfig errors): observability mode,
// CEL attributes, mode_override, http_service, GRPC body mode, other HTTP
// filters, non-ORIGINAL_DST route clusters.
package envoyemu

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"sigs.k8s.io/yaml"

	// Types that appear inside Any fields of our bootstraps: protojson
	// resolves them through the global registry.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
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
)

// Config is what the emulator takes from an Envoy bootstrap. Tests may change
// fields after LoadConfig; Start validates the result again.
type Config struct {
	// ListenAddr is where the emulator listens; default 127.0.0.1:0. The
	// bootstrap's own listener address is not used: tests need free ports.
	ListenAddr string

	// Processing mode of the ext_proc filter (§2). Header and trailer modes
	// use DEFAULT like Envoy: headers DEFAULT = SEND, trailers DEFAULT = SKIP.
	RequestHeaderMode   extprocfilterv3.ProcessingMode_HeaderSendMode
	RequestBodyMode     extprocfilterv3.ProcessingMode_BodySendMode
	RequestTrailerMode  extprocfilterv3.ProcessingMode_HeaderSendMode
	ResponseHeaderMode  extprocfilterv3.ProcessingMode_HeaderSendMode
	ResponseBodyMode    extprocfilterv3.ProcessingMode_BodySendMode
	ResponseTrailerMode extprocfilterv3.ProcessingMode_HeaderSendMode

	// SendBodyWithoutWaitingForHeaderResponse applies to STREAMED only (§2.4).
	SendBodyWithoutWaitingForHeaderResponse bool

	FailureModeAllow  bool          // §5
	MessageTimeout    time.Duration // §5, default 200ms
	MaxMessageTimeout time.Duration // §5, default 0 = override disabled
	StatusOnError     int           // §5, default 500

	ReceivingNamespaces  []string // §3.7 metadata_options.receiving_namespaces.untyped
	ForwardingNamespaces []string // §1.4 metadata_options.forwarding_namespaces.untyped

	MutationRules            *mutationrulesv3.HeaderMutationRules // §3.3, nil = defaults
	HeaderPrefix             string                               // bootstrap header_prefix, default x-envoy
	DisableImmediateResponse bool                                 // §4
	AllowContentLengthHeader bool                                 // keeps Content-Length in the §3.5 cases (newer Envoy)
	RouteCacheAction         extprocfilterv3.ExternalProcessor_RouteCacheAction
	DisableClearRouteCache   bool
	ForwardRules             *extprocfilterv3.HeaderForwardingRules // §1.3

	// MaxReceiveMessageLength is grpc_service.envoy_grpc.max_receive_message_length
	// (0 = unlimited).
	MaxReceiveMessageLength int

	// InitialMetadata is dynamic metadata that earlier filters put on the
	// stream (for example an envoy.lb.subset_hint). Emulator-only knob.
	InitialMetadata map[string]*structpb.Struct

	// HTTP connection manager and listener.
	BufferLimitBytes  int           // listener per_connection_buffer_limit_bytes (§2.3)
	StreamIdleTimeout time.Duration // 0 = disabled
	MaxHeadersCount   int
	MaxHeadersKB      int

	Routes   []Route
	Clusters map[string]*Cluster

	// Logf, when set, receives debug lines (e.g. t.Logf).
	Logf func(format string, args ...any)
}

// Route is one route of the route table, matched in order.
type Route struct {
	Prefix  string // match.prefix, or
	Path    string // match.path (exact)
	Cluster string
	// Timeout is the route timeout; 0 means none (§5, envoy#35812).
	Timeout time.Duration
}

// Cluster is an upstream cluster the routes may target. Only ORIGINAL_DST
// clusters are emulated.
type Cluster struct {
	Name        string
	OriginalDst *OriginalDst
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

// LoadConfig parses an Envoy bootstrap YAML with go-control-plane, validates
// it like Envoy would (proto constraints and §10.1 ext_proc rules) and
// extracts what the emulator needs.
func LoadConfig(path string) (*Config, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	bs := &bootstrapv3.Bootstrap{}
	if err := protojson.Unmarshal(js, bs); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if err := bs.ValidateAll(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	cfg, err := fromBootstrap(bs)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// validatable is what protoc-gen-validate generates.
type validatable interface{ ValidateAll() error }

// unpack unmarshals an Any and runs its proto constraints, which the
// bootstrap's ValidateAll does not reach.
func unpack(a *anypb.Any, m proto.Message) error {
	if err := a.UnmarshalTo(m); err != nil {
		return err
	}
	if v, ok := m.(validatable); ok {
		return v.ValidateAll()
	}
	return nil
}

func fromBootstrap(bs *bootstrapv3.Bootstrap) (*Config, error) {
	cfg := &Config{HeaderPrefix: bs.GetHeaderPrefix(), Clusters: map[string]*Cluster{}}
	if cfg.HeaderPrefix == "" {
		cfg.HeaderPrefix = "x-envoy"
	}
	for _, c := range bs.GetStaticResources().GetClusters() {
		cl, err := clusterFromProto(c)
		if err != nil {
			return nil, fmt.Errorf("cluster %q: %w", c.GetName(), err)
		}
		if cl != nil {
			cfg.Clusters[cl.Name] = cl
		}
	}
	var found bool
	for _, l := range bs.GetStaticResources().GetListeners() {
		ok, err := cfg.fromListener(l)
		if err != nil {
			return nil, fmt.Errorf("listener %q: %w", l.GetName(), err)
		}
		if ok {
			found = true
			break
		}
	}
	if !found {
		return nil, errors.New("no listener with an http_connection_manager that runs envoy.filters.http.ext_proc")
	}
	for _, r := range cfg.Routes {
		if cfg.Clusters[r.Cluster] == nil {
			return nil, fmt.Errorf("route to cluster %q: only static ORIGINAL_DST clusters are emulated", r.Cluster)
		}
	}
	return cfg, nil
}

// clusterFromProto keeps ORIGINAL_DST clusters (nil for others, e.g. the
// ext_proc cluster, which Start replaces by its extProcAddr argument) and
// applies Envoy's ORIGINAL_DST config checks (§8.1).
func clusterFromProto(c *clusterv3.Cluster) (*Cluster, error) {
	odc := c.GetOriginalDstLbConfig()
	if c.GetType() != clusterv3.Cluster_ORIGINAL_DST {
		if odc != nil {
			return nil, errors.New("original_dst_lb_config set on a cluster that is not ORIGINAL_DST")
		}
		return nil, nil
	}
	if c.GetLbPolicy() != clusterv3.Cluster_CLUSTER_PROVIDED {
		return nil, errors.New("ORIGINAL_DST cluster requires lb_policy CLUSTER_PROVIDED")
	}
	if c.GetLoadAssignment() != nil {
		return nil, errors.New("ORIGINAL_DST clusters must have no load_assignment")
	}
	od := &OriginalDst{HeaderName: defaultOriginalDstHeader}
	if odc != nil {
		if odc.GetHttpHeaderName() != "" && !odc.GetUseHttpHeader() {
			return nil, errors.New("original_dst_lb_config.http_header_name requires use_http_header")
		}
		od.UseHTTPHeader = odc.GetUseHttpHeader()
		if odc.GetHttpHeaderName() != "" {
			od.HeaderName = strings.ToLower(odc.GetHttpHeaderName())
		}
		od.PortOverride = odc.GetUpstreamPortOverride().GetValue()
		if mk := odc.GetMetadataKey(); mk != nil {
			od.MetadataNamespace = mk.GetKey()
			for _, seg := range mk.GetPath() {
				od.MetadataPath = append(od.MetadataPath, seg.GetKey())
			}
		}
	}
	return &Cluster{Name: c.GetName(), OriginalDst: od}, nil
}

// fromListener fills the HCM, route and ext_proc parts from the first
// listener whose HCM carries an ext_proc filter.
func (cfg *Config) fromListener(l *listenerv3.Listener) (bool, error) {
	for _, fc := range l.GetFilterChains() {
		for _, f := range fc.GetFilters() {
			ta := f.GetTypedConfig()
			if ta == nil || !ta.MessageIs(&hcmv3.HttpConnectionManager{}) {
				continue
			}
			hcm := &hcmv3.HttpConnectionManager{}
			if err := unpack(ta, hcm); err != nil {
				return false, err
			}
			ok, err := cfg.fromHCM(hcm)
			if err != nil || !ok {
				return ok, err
			}
			cfg.BufferLimitBytes = defaultBufferLimit
			if v := l.GetPerConnectionBufferLimitBytes(); v != nil {
				cfg.BufferLimitBytes = int(v.GetValue())
			}
			return true, nil
		}
	}
	return false, nil
}

func durationOr(d *durationpb.Duration, def time.Duration) time.Duration {
	if d == nil {
		return def
	}
	return d.AsDuration()
}

func (cfg *Config) fromHCM(hcm *hcmv3.HttpConnectionManager) (bool, error) {
	var extProc *extprocfilterv3.ExternalProcessor
	filters := hcm.GetHttpFilters()
	for i, hf := range filters {
		ta := hf.GetTypedConfig()
		if ta == nil {
			return false, fmt.Errorf("http filter %q: only typed_config is emulated", hf.GetName())
		}
		switch {
		case ta.MessageIs(&extprocfilterv3.ExternalProcessor{}):
			if extProc != nil {
				return false, errors.New("more than one ext_proc filter is not emulated (envoy#41654)")
			}
			extProc = &extprocfilterv3.ExternalProcessor{}
			if err := unpack(ta, extProc); err != nil {
				return false, fmt.Errorf("http filter %q: %w", hf.GetName(), err)
			}
		case ta.MessageIs(&routerv3.Router{}):
			if i != len(filters)-1 {
				return false, errors.New("the router must be the last http filter")
			}
			if err := unpack(ta, &routerv3.Router{}); err != nil {
				return false, err
			}
		default:
			return false, fmt.Errorf("http filter %q (%s) is not emulated", hf.GetName(), ta.GetTypeUrl())
		}
	}
	if extProc == nil {
		return false, nil
	}
	if len(filters) == 0 || !filters[len(filters)-1].GetTypedConfig().MessageIs(&routerv3.Router{}) {
		return false, errors.New("the last http filter must be envoy.filters.http.router")
	}
	if err := cfg.fromExtProc(extProc); err != nil {
		return false, err
	}

	cfg.StreamIdleTimeout = durationOr(hcm.GetStreamIdleTimeout(), defaultStreamIdleTimeout)
	cfg.MaxHeadersCount = defaultMaxHeadersCount
	if v := hcm.GetCommonHttpProtocolOptions().GetMaxHeadersCount(); v != nil {
		cfg.MaxHeadersCount = int(v.GetValue())
	}
	cfg.MaxHeadersKB = defaultMaxHeadersKB
	if v := hcm.GetMaxRequestHeadersKb(); v != nil {
		cfg.MaxHeadersKB = int(v.GetValue())
	}
	rc := hcm.GetRouteConfig()
	if rc == nil {
		return false, errors.New("only an inline route_config is emulated")
	}
	return true, cfg.fromRoutes(rc)
}

func (cfg *Config) fromRoutes(rc *routev3.RouteConfiguration) error {
	for _, vh := range rc.GetVirtualHosts() {
		if len(vh.GetDomains()) != 1 || vh.GetDomains()[0] != "*" {
			return fmt.Errorf("virtual host %q: only domains [\"*\"] is emulated", vh.GetName())
		}
		if len(vh.GetTypedPerFilterConfig()) > 0 || len(rc.GetTypedPerFilterConfig()) > 0 {
			return errors.New("typed_per_filter_config (ExtProcPerRoute, §6.2) is not emulated")
		}
		for _, r := range vh.GetRoutes() {
			if len(r.GetTypedPerFilterConfig()) > 0 {
				return errors.New("typed_per_filter_config (ExtProcPerRoute, §6.2) is not emulated")
			}
			ra := r.GetRoute()
			if ra == nil || ra.GetCluster() == "" {
				return errors.New("only route actions with a fixed cluster are emulated")
			}
			rt := Route{Cluster: ra.GetCluster(), Timeout: durationOr(ra.GetTimeout(), defaultRouteTimeout)}
			switch m := r.GetMatch().GetPathSpecifier().(type) {
			case *routev3.RouteMatch_Prefix:
				rt.Prefix = m.Prefix
			case *routev3.RouteMatch_Path:
				rt.Path = m.Path
			default:
				return fmt.Errorf("route match %T is not emulated", m)
			}
			if len(r.GetMatch().GetHeaders()) > 0 || len(r.GetMatch().GetQueryParameters()) > 0 {
				return errors.New("header and query matchers are not emulated")
			}
			cfg.Routes = append(cfg.Routes, rt)
		}
	}
	return nil
}

func (cfg *Config) fromExtProc(ep *extprocfilterv3.ExternalProcessor) error {
	switch {
	case ep.GetHttpService() != nil:
		return errors.New("ext_proc http_service is not emulated")
	case ep.GetGrpcService().GetEnvoyGrpc() == nil:
		return errors.New("ext_proc grpc_service must use envoy_grpc")
	case ep.GetObservabilityMode():
		return errors.New("ext_proc observability_mode is not emulated")
	case len(ep.GetRequestAttributes()) > 0 || len(ep.GetResponseAttributes()) > 0:
		return errors.New("ext_proc request/response attributes (CEL) are not emulated")
	case ep.GetAllowModeOverride():
		return errors.New("ext_proc allow_mode_override is not emulated")
	case ep.GetProcessingRequestModifier() != nil || ep.GetOnProcessingResponse() != nil:
		return errors.New("ext_proc processing_request_modifier / on_processing_response are not emulated")
	}
	pm := ep.GetProcessingMode()
	cfg.RequestHeaderMode = pm.GetRequestHeaderMode()
	cfg.RequestBodyMode = pm.GetRequestBodyMode()
	cfg.RequestTrailerMode = pm.GetRequestTrailerMode()
	cfg.ResponseHeaderMode = pm.GetResponseHeaderMode()
	cfg.ResponseBodyMode = pm.GetResponseBodyMode()
	cfg.ResponseTrailerMode = pm.GetResponseTrailerMode()
	cfg.SendBodyWithoutWaitingForHeaderResponse = ep.GetSendBodyWithoutWaitingForHeaderResponse()
	cfg.FailureModeAllow = ep.GetFailureModeAllow()
	cfg.MessageTimeout = durationOr(ep.GetMessageTimeout(), defaultMessageTimeout)
	cfg.MaxMessageTimeout = durationOr(ep.GetMaxMessageTimeout(), 0)
	cfg.StatusOnError = 500
	if s := ep.GetStatusOnError(); s != nil {
		cfg.StatusOnError = int(s.GetCode())
	}
	cfg.ReceivingNamespaces = ep.GetMetadataOptions().GetReceivingNamespaces().GetUntyped()
	cfg.ForwardingNamespaces = ep.GetMetadataOptions().GetForwardingNamespaces().GetUntyped()
	cfg.MutationRules = ep.GetMutationRules()
	cfg.DisableImmediateResponse = ep.GetDisableImmediateResponse()
	cfg.AllowContentLengthHeader = ep.GetAllowContentLengthHeader()
	cfg.RouteCacheAction = ep.GetRouteCacheAction()
	cfg.DisableClearRouteCache = ep.GetDisableClearRouteCache()
	cfg.ForwardRules = ep.GetForwardRules()
	cfg.MaxReceiveMessageLength = int(ep.GetGrpcService().GetEnvoyGrpc().GetMaxReceiveMessageLength().GetValue())
	return nil
}

func isFullDuplex(m extprocfilterv3.ProcessingMode_BodySendMode) bool {
	return m == extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// Validate applies the ext_proc config checks Envoy runs at load time (§2.6,
// §3.6, §5, §10.1). A config Envoy would reject must not run here either.
func (cfg *Config) Validate() error {
	// §2.6 / SRC-CFG verifyProcessingModeConfig.
	if isFullDuplex(cfg.RequestBodyMode) && cfg.RequestTrailerMode != extprocfilterv3.ProcessingMode_SEND {
		return errors.New("request_body_mode FULL_DUPLEX_STREAMED requires request_trailer_mode SEND")
	}
	if isFullDuplex(cfg.ResponseBodyMode) && cfg.ResponseTrailerMode != extprocfilterv3.ProcessingMode_SEND {
		return errors.New("response_body_mode FULL_DUPLEX_STREAMED requires response_trailer_mode SEND")
	}
	if (isFullDuplex(cfg.RequestBodyMode) || isFullDuplex(cfg.ResponseBodyMode)) && cfg.FailureModeAllow {
		return errors.New("failure_mode_allow must be false when a body mode is FULL_DUPLEX_STREAMED")
	}
	for _, m := range []extprocfilterv3.ProcessingMode_BodySendMode{cfg.RequestBodyMode, cfg.ResponseBodyMode} {
		if m == extprocfilterv3.ProcessingMode_GRPC {
			// §2.7: not-implemented-hide; refusing is safer than guessing.
			return errors.New("body mode GRPC is not emulated")
		}
	}
	if cfg.RouteCacheAction != extprocfilterv3.ExternalProcessor_DEFAULT && cfg.DisableClearRouteCache {
		return errors.New("route_cache_action and disable_clear_route_cache are mutually exclusive")
	}
	if cfg.MessageTimeout < 0 || cfg.MessageTimeout > maxTimeout {
		return fmt.Errorf("message_timeout %v out of [0s, 3600s]", cfg.MessageTimeout)
	}
	if cfg.MaxMessageTimeout < 0 || cfg.MaxMessageTimeout > maxTimeout {
		return fmt.Errorf("max_message_timeout %v out of [0s, 3600s]", cfg.MaxMessageTimeout)
	}
	if len(cfg.Routes) == 0 {
		return errors.New("no routes")
	}
	for _, r := range cfg.Routes {
		if cl := cfg.Clusters[r.Cluster]; cl == nil || cl.OriginalDst == nil {
			return fmt.Errorf("route to unknown or non-ORIGINAL_DST cluster %q", r.Cluster)
		}
	}
	return nil
}

// withDefaults fills zero values a hand-made Config may leave out.
func (cfg Config) withDefaults() Config {
	if cfg.StatusOnError == 0 {
		cfg.StatusOnError = 500
	}
	if cfg.BufferLimitBytes == 0 {
		cfg.BufferLimitBytes = defaultBufferLimit
	}
	if cfg.MaxHeadersCount == 0 {
		cfg.MaxHeadersCount = defaultMaxHeadersCount
	}
	if cfg.MaxHeadersKB == 0 {
		cfg.MaxHeadersKB = defaultMaxHeadersKB
	}
	if cfg.HeaderPrefix == "" {
		cfg.HeaderPrefix = "x-envoy"
	}
	return cfg
}
