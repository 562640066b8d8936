package deploy

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/envoyproxy/go-control-plane/envoy/annotations"
	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/anypb"
)

// The service contract (docs/architecture.md, Contracts users depend on) that every Envoy config must honour. These mirror what
// pd-extproc sends; a config that disagrees routes nowhere or drops the routing decision.
const (
	// destinationHeader is the request header pd-extproc sets to the chosen decode ip:port.
	destinationHeader = "x-gateway-destination-endpoint"
	// lbMetadataNamespace is the dynamic-metadata namespace pd-extproc writes the same value to.
	lbMetadataNamespace = "envoy.lb"
	// minInferenceRouteTimeout: a non-zero route timeout shorter than this cuts long generations.
	minInferenceRouteTimeout = 300 * time.Second
)

// Envoy defaults that matter when a field is unset.
const (
	envoyDefaultMessageTimeout = 200 * time.Millisecond
	envoyDefaultRouteTimeout   = 15 * time.Second
	envoyDefaultBufferLimit    = 1 << 20 // per_connection_buffer_limit_bytes
	httpProtocolOptionsKey     = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
)

// serviceLimits are the values of pd-extproc's own config that Envoy must accommodate.
type serviceLimits struct {
	maxBodyBytes           uint64        // limits.max_body_bytes
	maxConcurrentStreams   int           // limits.max_concurrent_streams
	overrideMessageTimeout time.Duration // envoy.override_message_timeout (BUFFERED mode)
}

// report collects problems rather than stopping at the first, so one test run shows every
// mistake in a config.
type report struct {
	errs     []string
	warnings []string
}

func (r *report) errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func (r *report) warnf(format string, args ...any) {
	r.warnings = append(r.warnings, fmt.Sprintf(format, args...))
}

// checkEnvoyBootstrapJSON is the whole validator for one static Envoy bootstrap: parse as Envoy
// does (unknown fields and unresolvable Any types are errors), run Envoy's generated
// proto-validate rules on every message including the ones packed in Any, then the semantic
// rules pd-extproc relies on.
func checkEnvoyBootstrapJSON(data []byte, limits serviceLimits) report {
	var r report
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(data, &b); err != nil {
		r.errorf("not a valid Envoy bootstrap: %v", err)
		return r
	}
	validateDeep(&b, &r)
	m := modelFromBootstrap(&b, &r)
	checkAdmin(&b, m, &r)
	m.check(limits, &r)
	m.checkLink(&r)
	return r
}

// validateDeep runs ValidateAll on msg and on every message packed in an Any below it.
// Generated ValidateAll recurses into ordinary sub-messages but only checks that an Any is
// present, so typed_config (HCM, ext_proc, router, protocol options) would go unchecked.
func validateDeep(msg proto.Message, r *report) {
	validateOne(msg, "", r)
	walkMessage(msg.ProtoReflect(), "", r)
}

func validateOne(msg proto.Message, path string, r *report) {
	v, ok := msg.(interface{ ValidateAll() error })
	if !ok {
		return
	}
	if err := v.ValidateAll(); err != nil {
		where := path
		if where == "" {
			where = string(msg.ProtoReflect().Descriptor().FullName())
		}
		r.errorf("%s: %v", where, err)
	}
}

// walkMessage visits every set field; it unpacks each Any, validates what is inside and keeps
// walking there, and flags fields Envoy deprecates.
func walkMessage(m protoreflect.Message, path string, r *report) {
	if a, ok := m.Interface().(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil {
			r.errorf("%s: cannot unpack %s: %v", path, a.GetTypeUrl(), err)
			return
		}
		innerPath := fmt.Sprintf("%s<%s>", path, inner.ProtoReflect().Descriptor().Name())
		validateOne(inner, innerPath, r)
		walkMessage(inner.ProtoReflect(), innerPath, r)
		return
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		p := path + "." + string(fd.Name())
		checkDeprecation(fd, v, p, r)
		switch {
		case fd.IsMap():
			if fd.MapValue().Kind() == protoreflect.MessageKind {
				v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
					walkMessage(mv.Message(), fmt.Sprintf("%s[%v]", p, k.Interface()), r)
					return true
				})
			}
		case fd.IsList():
			if fd.Kind() == protoreflect.MessageKind {
				l := v.List()
				for i := range l.Len() {
					walkMessage(l.Get(i).Message(), fmt.Sprintf("%s[%d]", p, i), r)
				}
			}
		case fd.FullName() == "envoy.config.route.v3.FilterConfig.config" && isEmptyAny(v.Message()):
			// An empty config only switches a filter on for the route; Envoy Gateway
			// enables route-level policies this way and Envoy accepts it.
		case fd.Kind() == protoreflect.MessageKind:
			walkMessage(v.Message(), p, r)
		}
		return true
	})
}

func isEmptyAny(m protoreflect.Message) bool {
	a, ok := m.Interface().(*anypb.Any)
	return ok && a.GetTypeUrl() == "" && len(a.GetValue()) == 0
}

// checkDeprecation mirrors Envoy's loader: fields and enum values marked
// disallowed_by_default are rejected at startup, plain deprecated ones only log a warning.
func checkDeprecation(fd protoreflect.FieldDescriptor, v protoreflect.Value, path string, r *report) {
	if opts, ok := fd.Options().(*descriptorpb.FieldOptions); ok && opts != nil {
		switch {
		case proto.GetExtension(opts, annotations.E_DisallowedByDefault).(bool):
			r.errorf("%s: field is deprecated and disallowed by default; Envoy rejects it", path)
		case opts.GetDeprecated():
			r.warnf("%s: field is deprecated", path)
		}
	}
	if fd.Kind() != protoreflect.EnumKind || fd.IsList() || fd.IsMap() {
		return
	}
	ev := fd.Enum().Values().ByNumber(v.Enum())
	if ev == nil {
		return
	}
	if opts, ok := ev.Options().(*descriptorpb.EnumValueOptions); ok && opts != nil {
		switch {
		case proto.GetExtension(opts, annotations.E_DisallowedByDefaultEnum).(bool):
			r.errorf("%s: enum value %s is deprecated and disallowed by default; Envoy rejects it", path, ev.Name())
		case opts.GetDeprecated():
			r.warnf("%s: enum value %s is deprecated", path, ev.Name())
		}
	}
}

// envoyModel is the part of a config the semantic rules look at, gathered from a static
// bootstrap or from an xDS dump (Envoy Gateway), so both go through the same rules.
type envoyModel struct {
	clusters      map[string]*clusterv3.Cluster
	endpoints     map[string]*endpointv3.ClusterLoadAssignment // EDS (Envoy Gateway); a static cluster has its own
	routeConfigs  map[string]*routev3.RouteConfiguration       // by name, for HCMs that use RDS
	hcms          []hcmUse
	adminClusters map[string]bool // clusters whose endpoint is the admin interface
}

// hcmUse is one HTTP connection manager and where it sits.
type hcmUse struct {
	where    string
	listener *listenerv3.Listener
	hcm      *hcmv3.HttpConnectionManager
}

func modelFromBootstrap(b *bootstrapv3.Bootstrap, r *report) *envoyModel {
	m := newEnvoyModel()
	for _, c := range b.GetStaticResources().GetClusters() {
		m.addCluster(c, r)
	}
	for _, l := range b.GetStaticResources().GetListeners() {
		m.addListener(l)
	}
	return m
}

func newEnvoyModel() *envoyModel {
	return &envoyModel{
		clusters:      map[string]*clusterv3.Cluster{},
		endpoints:     map[string]*endpointv3.ClusterLoadAssignment{},
		routeConfigs:  map[string]*routev3.RouteConfiguration{},
		adminClusters: map[string]bool{},
	}
}

func (m *envoyModel) addCluster(c *clusterv3.Cluster, r *report) {
	if _, dup := m.clusters[c.GetName()]; dup {
		r.errorf("cluster %q is defined twice", c.GetName())
	}
	m.clusters[c.GetName()] = c
}

func (m *envoyModel) addListener(l *listenerv3.Listener) {
	chains := slices.Clone(l.GetFilterChains())
	if dc := l.GetDefaultFilterChain(); dc != nil {
		chains = append(chains, dc)
	}
	for ci, fc := range chains {
		for _, f := range fc.GetFilters() {
			var hcm hcmv3.HttpConnectionManager
			if f.GetTypedConfig() == nil || f.GetTypedConfig().UnmarshalTo(&hcm) != nil {
				continue
			}
			m.hcms = append(m.hcms, hcmUse{
				where:    fmt.Sprintf("listener %q filter_chain %d", l.GetName(), ci),
				listener: l,
				hcm:      &hcm,
			})
		}
	}
}

// extProcUse is one ext_proc HTTP filter and the name routes use to configure it per route.
type extProcUse struct {
	name   string
	config *extprocv3.ExternalProcessor
	// disabled: the filter is off unless a route turns it on (Envoy Gateway attaches
	// route-level policies this way).
	disabled bool
}

func (m *envoyModel) check(limits serviceLimits, r *report) {
	for _, name := range slices.Sorted(maps.Keys(m.clusters)) {
		if c := m.clusters[name]; c.GetType() == clusterv3.Cluster_ORIGINAL_DST {
			checkOriginalDstCluster(c, r)
			checkBreakers(c, "ORIGINAL_DST", limits, r)
			checkIdleTimeout(c, r)
		}
	}
	for _, u := range m.hcms {
		m.checkHCM(u, limits, r)
	}
}

// checkOriginalDstCluster: the cluster must take its host from the header pd-extproc sets.
func checkOriginalDstCluster(c *clusterv3.Cluster, r *report) {
	name := c.GetName()
	if c.GetLbPolicy() != clusterv3.Cluster_CLUSTER_PROVIDED {
		r.errorf("ORIGINAL_DST cluster %q: lb_policy is %s; Envoy requires CLUSTER_PROVIDED", name, c.GetLbPolicy())
	}
	if c.GetLoadAssignment() != nil {
		r.errorf("ORIGINAL_DST cluster %q has a load_assignment; Envoy rejects that", name)
	}
	cfg := c.GetOriginalDstLbConfig()
	if !cfg.GetUseHttpHeader() {
		r.errorf("ORIGINAL_DST cluster %q: original_dst_lb_config.use_http_header must be true, or the %s header pd-extproc sets is ignored", name, destinationHeader)
	}
	if got := cfg.GetHttpHeaderName(); got != destinationHeader {
		if got == "" {
			got = "x-envoy-original-dst-host (default)"
		}
		r.errorf("ORIGINAL_DST cluster %q reads header %s, but pd-extproc sets %s", name, got, destinationHeader)
	}
}

// extProcFilters lists the ext_proc filters of an HTTP connection manager, in filter order.
func extProcFilters(h *hcmv3.HttpConnectionManager) []extProcUse {
	var out []extProcUse
	for _, f := range h.GetHttpFilters() {
		var ep extprocv3.ExternalProcessor
		if tc := f.GetTypedConfig(); tc.MessageIs(&ep) && tc.UnmarshalTo(&ep) == nil {
			out = append(out, extProcUse{name: f.GetName(), config: &ep, disabled: f.GetDisabled()})
		}
	}
	return out
}

func (m *envoyModel) checkHCM(u hcmUse, limits serviceLimits, r *report) {
	extProcs := extProcFilters(u.hcm)
	routerAt := -1
	filters := u.hcm.GetHttpFilters()
	for i, f := range filters {
		tc := f.GetTypedConfig()
		if tc.MessageIs(&routerv3.Router{}) {
			routerAt = i
		}
		if tc.MessageIs(&extprocv3.ExternalProcessor{}) && routerAt >= 0 {
			r.errorf("%s: ext_proc filter %q comes after the router, so it never runs", u.where, f.GetName())
		}
	}
	if routerAt < 0 {
		r.errorf("%s: no envoy.filters.http.router filter", u.where)
	} else if routerAt != len(filters)-1 {
		r.errorf("%s: the router filter must be the last HTTP filter", u.where)
	}
	for _, ep := range extProcs {
		m.checkExtProc(u.where, ep, limits, r)
	}

	rc := u.hcm.GetRouteConfig()
	if rc == nil && u.hcm.GetRds() != nil {
		rc = m.routeConfigs[u.hcm.GetRds().GetRouteConfigName()]
		if rc == nil {
			r.errorf("%s: RDS route config %q not found", u.where, u.hcm.GetRds().GetRouteConfigName())
			return
		}
	}
	for _, vh := range rc.GetVirtualHosts() {
		for _, rt := range vh.GetRoutes() {
			m.checkRoute(u, vh, rt, extProcs, limits, r)
		}
	}
}

// checkExtProc holds the ext_proc rules from docs/envoy.md §2.6, §3.7 and §5.
func (m *envoyModel) checkExtProc(where string, ep extProcUse, limits serviceLimits, r *report) {
	cfg := ep.config
	where = fmt.Sprintf("%s ext_proc %q", where, ep.name)
	if g := cfg.GetGrpcService().GetEnvoyGrpc(); g != nil {
		c, ok := m.clusters[g.GetClusterName()]
		switch {
		case !ok:
			r.errorf("%s: grpc_service cluster %q is not defined", where, g.GetClusterName())
		case !clusterSpeaksHTTP2(c):
			r.errorf("%s: cluster %q is not HTTP/2, but gRPC needs HTTP/2 (set typed_extension_protocol_options %s explicit_http_config.http2_protocol_options)", where, g.GetClusterName(), httpProtocolOptionsKey)
		default:
			checkBreakers(c, "ext_proc", limits, r)
			checkKeepalive(c, r)
			checkHostRemoval(c, r)
			checkSessionAffinity(where, cfg, c, r)
		}
	} else if cfg.GetGrpcService().GetGoogleGrpc() == nil {
		r.errorf("%s: no grpc_service; pd-extproc speaks gRPC", where)
	}

	pm := cfg.GetProcessingMode()
	for _, d := range []struct {
		dir     string
		body    extprocv3.ProcessingMode_BodySendMode
		trailer extprocv3.ProcessingMode_HeaderSendMode
	}{
		{"request", pm.GetRequestBodyMode(), pm.GetRequestTrailerMode()},
		{"response", pm.GetResponseBodyMode(), pm.GetResponseTrailerMode()},
	} {
		if d.body == extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED && d.trailer != extprocv3.ProcessingMode_SEND {
			r.errorf("%s: %s_trailer_mode is %s; FULL_DUPLEX_STREAMED requires SEND (Envoy rejects the listener)", where, d.dir, d.trailer)
		}
	}
	if cfg.GetFailureModeAllow() {
		r.errorf("%s: failure_mode_allow is true: when pd-extproc is unreachable (in FULL_DUPLEX_STREAMED, before the first body chunk reached it) the request goes on unrouted and the client's own %s header picks the upstream", where, destinationHeader)
	}
	if cfg.GetObservabilityMode() {
		r.errorf("%s: observability_mode ignores every reply, so pd-extproc's routing and body rewrite are lost", where)
	}
	if pm.GetRequestHeaderMode() == extprocv3.ProcessingMode_SKIP {
		r.errorf("%s: request_header_mode SKIP: the routing header is set in the request headers reply", where)
	}
	if !slices.Contains(cfg.GetMetadataOptions().GetReceivingNamespaces().GetUntyped(), lbMetadataNamespace) {
		r.errorf("%s: metadata_options.receiving_namespaces.untyped lacks %q, so Envoy drops the routing metadata pd-extproc sends", where, lbMetadataNamespace)
	}

	// The message timer runs in every request body mode but FULL_DUPLEX_STREAMED and NONE.
	// pd-extproc answers the body only after the prefill leg, so it extends the timer with
	// override_message_timeout, which Envoy honours only up to max_message_timeout.
	switch pm.GetRequestBodyMode() {
	case extprocv3.ProcessingMode_BUFFERED, extprocv3.ProcessingMode_BUFFERED_PARTIAL, extprocv3.ProcessingMode_STREAMED:
		msg := envoyDefaultMessageTimeout
		if cfg.GetMessageTimeout() != nil {
			msg = cfg.GetMessageTimeout().AsDuration()
		}
		maxT := cfg.GetMaxMessageTimeout().AsDuration()
		switch {
		case maxT <= msg:
			r.errorf("%s: request_body_mode %s needs max_message_timeout (%v) > message_timeout (%v); otherwise a prefill longer than the message timer ends in a 504", where, pm.GetRequestBodyMode(), maxT, msg)
		case maxT < limits.overrideMessageTimeout:
			r.errorf("%s: max_message_timeout %v is below the %v pd-extproc asks for (envoy.override_message_timeout); Envoy ignores the override and answers 504", where, maxT, limits.overrideMessageTimeout)
		}
	}
}

// checkSessionAffinity: the ext_proc cluster's hash policy sees the stream's own headers,
// which are the gRPC client's and grpc_service.initial_metadata, never the client's request
// (docs/envoy.md §14). A header it hashes that initial_metadata does not carry gives no
// hash, and every stream goes to a random replica; a hash policy under a load balancer that
// is not a hash's is ignored.
func checkSessionAffinity(where string, ep *extprocv3.ExternalProcessor, c *clusterv3.Cluster, r *report) {
	carried := map[string]bool{}
	for _, hv := range ep.GetGrpcService().GetInitialMetadata() {
		carried[strings.ToLower(hv.GetKey())] = true
	}
	hps := httpProtocolOptions(c).GetHashPolicy()
	if len(hps) > 0 && !envoyemu.HashBalanced(c) {
		r.errorf("%s: cluster %q has a hash_policy but no RING_HASH or MAGLEV load balancer, which ignores it", where, c.GetName())
	}
	for i, hp := range hps {
		h := strings.ToLower(hp.GetHeader().GetHeaderName())
		if h != "" && !carried[h] {
			r.errorf("%s: cluster %q hashes header %q, which grpc_service.initial_metadata does not put on the stream: no stream has it", where, c.GetName(), h)
		}
		// The client's address picks the replica only for a request that names no session:
		// every policy before it must end the list when it yields a hash, or a session would
		// be hashed with its address and move whenever its address does.
		if h != handlers.ClientAddressHeader {
			continue
		}
		if i != len(hps)-1 {
			r.errorf("%s: cluster %q hashes %s before other headers: it must come last", where, c.GetName(), h)
		}
		for _, before := range hps[:i] {
			if !before.GetTerminal() {
				r.errorf("%s: cluster %q hashes %q without terminal before %s: a session would be hashed with its client's address", where, c.GetName(), before.GetHeader().GetHeaderName(), h)
			}
		}
	}
}

// checkBufferLimit: in BUFFERED mode Envoy holds the whole body before pd-extproc sees
// it, so its buffer limit must admit what pd-extproc admits, or clients get Envoy's 413, and
// no more, or a body pd-extproc refuses travels as a gRPC message it rejects (a 500).
func checkBufferLimit(u hcmUse, vh *routev3.VirtualHost, rt *routev3.Route, where string, limits serviceLimits, r *report) {
	limit := uint64(envoyDefaultBufferLimit)
	if v := u.listener.GetPerConnectionBufferLimitBytes(); v != nil {
		limit = uint64(v.GetValue())
	}
	for _, override := range []interface {
		GetValue() uint32
	}{vh.GetPerRequestBufferLimitBytes(), rt.GetPerRequestBufferLimitBytes()} {
		if override != nil && override.GetValue() != 0 {
			limit = uint64(override.GetValue())
		}
	}
	for _, v := range []uint64{vh.GetRequestBodyBufferLimit().GetValue(), rt.GetRequestBodyBufferLimit().GetValue()} {
		if v != 0 {
			limit = v
		}
	}
	switch {
	case limits.maxBodyBytes == 0:
	case limit < limits.maxBodyBytes:
		r.errorf("%s: BUFFERED ext_proc with a %d-byte Envoy buffer limit, below pd-extproc's limits.max_body_bytes %d: larger prompts get 413 from Envoy", where, limit, limits.maxBodyBytes)
	case limit > limits.maxBodyBytes:
		r.errorf("%s: BUFFERED ext_proc with a %d-byte Envoy buffer limit, above pd-extproc's limits.max_body_bytes %d: bodies in between reach pd-extproc, which refuses the gRPC message, and the client gets a 500 instead of a 413; keep the two equal", where, limit, limits.maxBodyBytes)
	}
}

func (m *envoyModel) checkRoute(u hcmUse, vh *routev3.VirtualHost, rt *routev3.Route, extProcs []extProcUse, limits serviceLimits, r *report) {
	ra := rt.GetRoute()
	if ra == nil {
		return // direct_response or redirect: no upstream
	}
	where := fmt.Sprintf("%s route %s", u.where, describeRoute(rt))

	var targets []string
	if c := ra.GetCluster(); c != "" {
		targets = append(targets, c)
	}
	for _, wc := range ra.GetWeightedClusters().GetClusters() {
		targets = append(targets, wc.GetName())
	}
	originalDst := ""
	for _, name := range targets {
		c, ok := m.clusters[name]
		if !ok {
			r.errorf("%s: cluster %q is not defined", where, name)
			continue
		}
		if m.adminClusters[name] {
			checkAdminRoute(rt, where, r)
		}
		if c.GetType() == clusterv3.Cluster_ORIGINAL_DST {
			originalDst = name
		}
	}

	if originalDst == "" && !isInferencePath(rt.GetMatch()) {
		return
	}
	// Inference route: long-running, and routed by pd-extproc.
	switch t := ra.GetTimeout(); {
	case t == nil:
		r.errorf("%s: no timeout, so Envoy's default %v route timeout cuts long generations; set 0s or at least %v", where, envoyDefaultRouteTimeout, minInferenceRouteTimeout)
	case t.AsDuration() != 0 && t.AsDuration() < minInferenceRouteTimeout:
		r.errorf("%s: timeout %v cuts long generations; set 0s or at least %v", where, t.AsDuration(), minInferenceRouteTimeout)
	}
	if originalDst == "" {
		return
	}
	// The ORIGINAL_DST header is not sanitised: if ext_proc does not run, the client's own
	// header picks the upstream host.
	for _, ep := range extProcs {
		if extProcDisabledFor(ep, vh, rt) {
			r.errorf("%s: disables ext_proc %q but sends to ORIGINAL_DST cluster %q, so a client-supplied %s header picks the upstream", where, ep.name, originalDst, destinationHeader)
			continue
		}
		if ep.config.GetProcessingMode().GetRequestBodyMode() == extprocv3.ProcessingMode_BUFFERED {
			checkBufferLimit(u, vh, rt, where, limits, r)
		}
	}
	if len(extProcs) == 0 {
		r.errorf("%s: sends to ORIGINAL_DST cluster %q with no ext_proc filter in front, so a client-supplied %s header picks the upstream", where, originalDst, destinationHeader)
	}
}

// extProcDisabledFor reports whether the ext_proc filter is off for a route: disabled in the
// HTTP filter list and not enabled per route, or switched off per route. The most specific
// level (route over virtual host over filter list) wins, as in Envoy.
func extProcDisabledFor(ep extProcUse, vh *routev3.VirtualHost, rt *routev3.Route) bool {
	disabled := ep.disabled
	for _, perFilter := range []map[string]*anypb.Any{vh.GetTypedPerFilterConfig(), rt.GetTypedPerFilterConfig()} {
		a, ok := perFilter[ep.name]
		if !ok {
			continue
		}
		msg, err := a.UnmarshalNew()
		if err != nil {
			continue
		}
		switch c := msg.(type) {
		case *extprocv3.ExtProcPerRoute:
			disabled = c.GetDisabled()
		case *routev3.FilterConfig:
			disabled = c.GetDisabled()
		}
	}
	return disabled
}

// clusterSpeaksHTTP2 accepts the current typed protocol options and the deprecated
// http2_protocol_options field. auto_config is not accepted: it negotiates HTTP/2 with ALPN,
// which needs TLS, and the ext_proc connection is cleartext.
func clusterSpeaksHTTP2(c *clusterv3.Cluster) bool { return http2Options(c) != nil }

// http2Options is a cluster's HTTP/2 options, in the deprecated http2_protocol_options field
// or the typed protocol options' explicit HTTP/2; nil when it sets neither.
func http2Options(c *clusterv3.Cluster) *corev3.Http2ProtocolOptions {
	if h2 := c.GetHttp2ProtocolOptions(); h2 != nil { //nolint:staticcheck // the deprecated form still works in Envoy
		return h2
	}
	return httpProtocolOptions(c).GetExplicitHttpConfig().GetHttp2ProtocolOptions()
}

// httpProtocolOptions is a cluster's typed HttpProtocolOptions; nil when it sets none (or
// options that do not unmarshal, which Envoy refuses).
func httpProtocolOptions(c *clusterv3.Cluster) *upstreamhttpv3.HttpProtocolOptions {
	var hpo upstreamhttpv3.HttpProtocolOptions
	if opts, ok := c.GetTypedExtensionProtocolOptions()[httpProtocolOptionsKey]; !ok || opts.UnmarshalTo(&hpo) != nil {
		return nil
	}
	return &hpo
}

// isInferencePath: the OpenAI-compatible API lives under /v1/.
func isInferencePath(m *routev3.RouteMatch) bool {
	for _, p := range []string{m.GetPrefix(), m.GetPath(), m.GetPathSeparatedPrefix()} {
		if strings.HasPrefix(p, "/v1/") || p == "/v1" {
			return true
		}
	}
	return false
}

func describeRoute(rt *routev3.Route) string {
	if rt.GetName() != "" {
		return fmt.Sprintf("%q", rt.GetName())
	}
	m := rt.GetMatch()
	switch {
	case m.GetPrefix() != "":
		return fmt.Sprintf("prefix %q", m.GetPrefix())
	case m.GetPath() != "":
		return fmt.Sprintf("path %q", m.GetPath())
	case m.GetPathSeparatedPrefix() != "":
		return fmt.Sprintf("path_separated_prefix %q", m.GetPathSeparatedPrefix())
	case m.GetSafeRegex() != nil:
		return fmt.Sprintf("regex %q", m.GetSafeRegex().GetRegex())
	}
	return "(unnamed)"
}
