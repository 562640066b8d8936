package envoyemu

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"sigs.k8s.io/yaml"

	// Types that appear inside Any fields of our bootstraps: protojson
	// resolves them through the global registry. The hash load balancers may
	// be named as a typed load_balancing_policy instead of lb_policy (§14).
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/maglev/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/ring_hash/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
)

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
	cfg := &Config{Mutations: Mutations{HeaderPrefix: bs.GetHeaderPrefix()}, Clusters: map[string]*Cluster{}}
	if cfg.Mutations.HeaderPrefix == "" {
		cfg.Mutations.HeaderPrefix = "x-envoy"
	}
	for _, c := range bs.GetStaticResources().GetClusters() {
		cl, err := clusterFromProto(c)
		if err != nil {
			return nil, fmt.Errorf("cluster %q: %w", c.GetName(), err)
		}
		cfg.Clusters[cl.Name] = cl
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
		if cl := cfg.Clusters[r.Cluster]; cl == nil || cl.OriginalDst == nil {
			return nil, fmt.Errorf("route to cluster %q: only static ORIGINAL_DST clusters are emulated", r.Cluster)
		}
	}
	return cfg, nil
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
			cfg.Limits.BufferLimitBytes = defaultBufferLimit
			if v := l.GetPerConnectionBufferLimitBytes(); v != nil {
				cfg.Limits.BufferLimitBytes = int(v.GetValue())
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
	router := &routerv3.Router{}
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
			if err := unpack(ta, router); err != nil {
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
	cfg.SuppressEnvoyHeaders = router.GetSuppressEnvoyHeaders()

	cfg.ClientHeaders = ClientHeaders{
		UseRemoteAddress:          hcm.GetUseRemoteAddress().GetValue(),
		SkipXFFAppend:             hcm.GetSkipXffAppend(),
		PreserveExternalRequestID: hcm.GetPreserveExternalRequestId(),
	}
	switch ch := cfg.ClientHeaders; {
	case ch.UseRemoteAddress && !ch.PreserveExternalRequestID:
		// Envoy would then replace the x-request-id of requests it deems
		// external, which depends on internal_address_config.
		return false, errors.New("use_remote_address without preserve_external_request_id is not emulated")
	case hcm.GetXffNumTrustedHops() > 0 || hcm.GetInternalAddressConfig() != nil || len(hcm.GetOriginalIpDetectionExtensions()) > 0:
		return false, errors.New("xff_num_trusted_hops, internal_address_config and original_ip_detection_extensions are not emulated")
	case !ch.UseRemoteAddress && slices.ContainsFunc(cfg.InitialMetadata, MetadataValue.CarriesAddress):
		// Envoy then takes the client's address from x-forwarded-for, which
		// the client may set.
		return false, fmt.Errorf("%%%s%% without use_remote_address is not emulated", remoteAddress)
	}

	var err error
	if cfg.LocalReplies, err = localRepliesFromProto(hcm.GetLocalReplyConfig()); err != nil {
		return false, err
	}

	lim := &cfg.Limits
	lim.StreamIdleTimeout = durationOr(hcm.GetStreamIdleTimeout(), defaultStreamIdleTimeout)
	lim.MaxHeadersCount = defaultMaxHeadersCount
	if v := hcm.GetCommonHttpProtocolOptions().GetMaxHeadersCount(); v != nil {
		lim.MaxHeadersCount = int(v.GetValue())
	}
	lim.MaxHeadersKB = defaultMaxHeadersKB
	if v := hcm.GetMaxRequestHeadersKb(); v != nil {
		lim.MaxHeadersKB = int(v.GetValue())
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
		if vh.GetPerRequestBufferLimitBytes() != nil || vh.GetRequestBodyBufferLimit() != nil { //nolint:staticcheck // deprecated, still honoured by Envoy
			return errors.New("per_request_buffer_limit_bytes and request_body_buffer_limit are not emulated: the listener's buffer limit is the stream's")
		}
		if len(vh.GetTypedPerFilterConfig()) > 0 || len(rc.GetTypedPerFilterConfig()) > 0 {
			return errors.New("typed_per_filter_config (ExtProcPerRoute, §6.2) is not emulated")
		}
		for _, r := range vh.GetRoutes() {
			if len(r.GetTypedPerFilterConfig()) > 0 {
				return errors.New("typed_per_filter_config (ExtProcPerRoute, §6.2) is not emulated")
			}
			if r.GetPerRequestBufferLimitBytes() != nil || r.GetRequestBodyBufferLimit() != nil { //nolint:staticcheck // deprecated, still honoured by Envoy
				return errors.New("per_request_buffer_limit_bytes and request_body_buffer_limit are not emulated: the listener's buffer limit is the stream's")
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
			rp := ra.GetRetryPolicy()
			if rp == nil {
				rp = vh.GetRetryPolicy()
			}
			var err error
			if rt.Retry, err = retryPolicyFrom(rp); err != nil {
				return err
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
	cfg.Modes = Modes{
		Request:                                 DirectionModes{pm.GetRequestHeaderMode(), pm.GetRequestBodyMode(), pm.GetRequestTrailerMode()},
		Response:                                DirectionModes{pm.GetResponseHeaderMode(), pm.GetResponseBodyMode(), pm.GetResponseTrailerMode()},
		SendBodyWithoutWaitingForHeaderResponse: ep.GetSendBodyWithoutWaitingForHeaderResponse(),
	}
	cfg.Failure = Failure{
		FailureModeAllow:  ep.GetFailureModeAllow(),
		MessageTimeout:    durationOr(ep.GetMessageTimeout(), defaultMessageTimeout),
		MaxMessageTimeout: durationOr(ep.GetMaxMessageTimeout(), 0),
		StatusOnError:     500,
	}
	if s := ep.GetStatusOnError(); s != nil {
		cfg.Failure.StatusOnError = int(s.GetCode())
	}
	cfg.Metadata.ReceivingNamespaces = ep.GetMetadataOptions().GetReceivingNamespaces().GetUntyped()
	cfg.Metadata.ForwardingNamespaces = ep.GetMetadataOptions().GetForwardingNamespaces().GetUntyped()
	m := &cfg.Mutations
	m.Rules = ep.GetMutationRules()
	m.DisableImmediateResponse = ep.GetDisableImmediateResponse()
	m.AllowContentLengthHeader = ep.GetAllowContentLengthHeader()
	m.RouteCacheAction = ep.GetRouteCacheAction()
	m.DisableClearRouteCache = ep.GetDisableClearRouteCache()
	cfg.ForwardRules = ep.GetForwardRules()
	cfg.Limits.MaxReceiveMessageLength = int(ep.GetGrpcService().GetEnvoyGrpc().GetMaxReceiveMessageLength().GetValue())
	cfg.ExtProcCluster = ep.GetGrpcService().GetEnvoyGrpc().GetClusterName()
	var err error
	cfg.InitialMetadata, err = metadataFromProto(ep.GetGrpcService().GetInitialMetadata())
	return err
}
