package deploy

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/internal/chart"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
	"github.com/pd-extproc/pd-extproc/internal/testpki"
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// What the chart's Envoy Gateway objects promise (its envoy-gateway example: release pd-extproc,
// namespace pd-extproc, gateway.name pd-gateway).
const (
	gatewayXDSKey        = "pd-extproc/pd-gateway"      // egctl output key: <namespace>/<gateway>
	gatewayRouteConfig   = "pd-extproc/pd-gateway/http" // <namespace>/<gateway>/<listener>
	gatewayListenerPort  = 8080
	inferenceRoutePrefix = "httproute/pd-extproc/pd-gateway-inference/"
	extprocServicePort   = 9002
)

// gatewayPaths are the paths the HTTPRoute must send through pd-extproc: every
// built-in API's and every entry's of the default pass-through list (a path
// below a prefix entry for it).
func gatewayPaths(t *testing.T) []string {
	t.Helper()
	var paths []string
	for _, a := range api.Builtin {
		paths = append(paths, a.Path)
	}
	routes, err := api.ParseRoutes("routes.passthrough", api.DefaultPassthrough)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range routes {
		if r.Prefix {
			paths = append(paths, r.Path+"some-id")
		} else {
			paths = append(paths, r.Path)
		}
	}
	return paths
}

// gatewayManifests is the chart's rendering with Envoy Gateway in front (its envoy-gateway
// example, its top-level keys replaced by those of overrides, YAML), after the namespace helm
// install --create-namespace makes, without the cert-manager objects: one stream, the form
// `egctl x translate --file` takes.
func gatewayManifests(t *testing.T, overrides string) []byte {
	t.Helper()
	ex := example(t, "envoy-gateway")
	values, err := ex.ValuesMap()
	if err == nil {
		err = yaml.Unmarshal([]byte(overrides), &values)
	}
	if err != nil {
		t.Fatal(err)
	}
	out, err := chart.Render(testbed.MustRepoPath(t, chart.Dir), ex.Release, values)
	if err != nil {
		t.Fatal(err)
	}
	stream := fmt.Appendf(nil, "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: %s}\n", ex.Release.Namespace)
	for _, doc := range splitYAML(out) {
		// egctl knows no cert-manager kinds; the test adds the Secret they would issue.
		if !regexp.MustCompile(`(?m)^apiVersion: cert-manager\.io/`).Match(doc) {
			stream = append(append(stream, "---\n"...), doc...)
		}
	}
	return stream
}

// translateGateway runs Envoy Gateway's own translator on the manifests. --to gateway-api,xds
// returns the resources with their status (is each policy accepted?) and the xDS Envoy would
// receive; --add-missing-resources gives Services the cluster IP an API server would.
func translateGateway(t *testing.T, egctl string, manifests []byte) (map[string]any, error) {
	t.Helper()
	in := filepath.Join(t.TempDir(), "gateway.yaml")
	if err := os.WriteFile(in, manifests, 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := runTool(t, "", egctl, "x", "translate",
		"--from", "gateway-api", "--to", "gateway-api,xds", "--type", "all",
		"--output", "json", "--add-missing-resources", "--file", in)
	if err != nil {
		return nil, fmt.Errorf("egctl x translate: %w", err)
	}
	var res map[string]any
	if err := json.Unmarshal(out, &res); err != nil {
		return nil, fmt.Errorf("egctl output is not JSON: %w", err)
	}
	return res, nil
}

func TestEnvoyGatewayTranslation(t *testing.T) {
	egctl := testbed.FindTool("egctl")
	if egctl == "" {
		t.Skip("egctl not found on PATH or in " + strings.Join(testbed.ToolDirs(), ", ") + "; run `make tools` " +
			"(go install github.com/envoyproxy/gateway/cmd/egctl@v1.9.1) to check the Envoy Gateway manifests")
	}
	limits, paths, replies := defaultServiceLimits(t), gatewayPaths(t), shippedLocalReplies(t, envoyConfigs(t))
	// The Secret users create (README, "Secure by default"), here from a test CA: Envoy Gateway
	// refuses the policies that name it until it exists.
	secret := clientTLSSecret(t)
	shipped := append(gatewayManifests(t, ""), secret...)
	tests := []struct {
		name     string
		values   string   // YAML over the example's values: rendered anew
		old, new string   // the edit: the first old in the manifests becomes new
		wants    []string // empty: the translation must be clean
	}{
		{name: "as shipped"},
		{name: "a larger gateway.bufferLimit", values: "gateway: {enabled: true, bufferLimit: 64Mi}"},
		// FULL_DUPLEX_STREAMED holds no body in Envoy: a buffer below limits.max_body_bytes is
		// flow control, not a cap on the body.
		{name: "a gateway.bufferLimit below limits.max_body_bytes", values: "gateway: {enabled: true, bufferLimit: 1Mi}"},
		{
			// BUFFERED holds the whole body in Envoy: there the buffer caps it, with a 413.
			name:   "BUFFERED behind a gateway.bufferLimit below limits.max_body_bytes",
			values: "gateway: {enabled: true, bufferLimit: 1Mi}",
			old:    "request:\n          body: FullDuplexStreamed",
			new:    "request:\n          body: Buffered",
			wants:  []string{"BUFFERED ext_proc with a 1048576-byte Envoy buffer limit, below pd-extproc's limits.max_body_bytes 33554432"},
		},
		{
			// Envoy Gateway reports a patch whose target does not exist only in the policy
			// status; the route silently keeps its Service cluster and pd-extproc's choice of
			// decode endpoint is ignored.
			name:  "patch targets a route config that does not exist",
			old:   "name: " + gatewayRouteConfig,
			new:   "name: pd-extproc/pd-gateway/https",
			wants: []string{"is not an ORIGINAL_DST cluster"},
		},
		{
			// The same silence for the stream's session header: the cluster hashes a header
			// no stream carries, and every stream goes to a random replica.
			name:  "session patch names another ext_proc filter",
			old:   "/extproc/0')].typed_config.grpc_service",
			new:   "/extproc/1')].typed_config.grpc_service",
			wants: []string{"the session-affinity EnvoyPatchPolicy did not apply", "which grpc_service.initial_metadata does not put on the stream"},
		},
		{
			name:  "local-replies patch names another listener",
			old:   "name: pd-extproc/pd-gateway/http\n      operation:\n        op: add\n        jsonPath: \"..filters",
			new:   "name: pd-extproc/pd-gateway/https\n      operation:\n        op: add\n        jsonPath: \"..filters",
			wants: []string{"the local-replies EnvoyPatchPolicy did not apply"},
		},
		{
			// A path of the API table that no route matches gets Envoy's own 404:
			// the pass-through list is only as good as the HTTPRoute's matches.
			name:  "a pass-through path without a route match",
			old:   "        - path: {type: PathPrefix, value: /v1/embeddings}\n",
			new:   "",
			wants: []string{"no inference route for /v1/embeddings"},
		},
		{
			name:  "stored responses without a route match",
			old:   "{type: PathPrefix, value: /v1/responses}",
			new:   "{type: Exact, value: /v1/responses}",
			wants: []string{"no inference route for /v1/responses/some-id"},
		},
		{
			// The EnvoyExtensionPolicy's backendSettings reach the ext_proc cluster Envoy
			// Gateway builds; without them its defaults (1,024) apply.
			name:  "ext_proc cluster at the default request limit",
			old:   "maxParallelRequests: 16384",
			new:   "maxParallelRequests: 1024",
			wants: []string{"circuit_breakers max_requests 1024 is below 10000", "not above limits.max_concurrent_streams"},
		},
		{
			// No policy reaches the cluster the EnvoyPatchPolicy adds: its thresholds are
			// in the patch.
			name:  "decode cluster at the default request limit",
			old:   "max_requests: 16384",
			new:   "max_requests: 1024",
			wants: []string{`ORIGINAL_DST cluster "pd_original_dst": circuit_breakers max_requests 1024 is below 10000`},
		},
		{
			// The client certificate comes from the EnvoyProxy the Gateway names.
			name:  "EnvoyProxy without a client certificate",
			old:   "  backendTLS:\n    clientCertificateRef:\n      kind: Secret\n      name: pd-extproc-client-tls\n",
			new:   "  backendTLS: {}\n",
			wants: []string{"sends no client certificate"},
		},
		{
			name:  "no BackendTLSPolicy on the pd-extproc Service",
			old:   "      name: pd-extproc\n      sectionName: grpc\n",
			new:   "      name: pd-gateway-decode\n      sectionName: http\n",
			wants: []string{"is plaintext"},
		},
		{
			name:  "BackendTLSPolicy for another name",
			old:   "hostname: pd-extproc.pd-extproc.svc",
			new:   "hostname: extproc.example.com",
			wants: []string{"does not require the SAN pd-extproc.pd-extproc.svc"},
		},
		{
			name:  "clients' request ids replaced",
			old:   "    requestID: PreserveOrGenerate\n",
			new:   "    requestID: Generate\n",
			wants: []string{"preserve_external_request_id is not true"},
		},
		{
			// Envoy Gateway v1.9.1 has no InferencePool translation (validateBackendRefGroup in
			// internal/gatewayapi/validate.go): the route is refused and answers 500, so the
			// chart cannot attach pd-extproc as an endpointPickerRef (README).
			name:  "an InferencePool as the route's backend",
			old:   "backendRefs:\n        - name: pd-gateway-decode\n",
			new:   "backendRefs:\n        - group: inference.networking.k8s.io\n          kind: InferencePool\n          name: pd-gateway-decode\n",
			wants: []string{"condition ResolvedRefs is False (InvalidKind): Failed to process route rule 0 backendRef 0: Group is invalid"},
		},
		{
			name:  "envoy.lb not writable by the processor",
			old:   "- envoy.lb",
			new:   "- pd-extproc",
			wants: []string{`receiving_namespaces.untyped lacks "envoy.lb"`},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each case is one egctl process; run them side by side
			manifests := string(shipped)
			if tc.values != "" {
				manifests = string(append(gatewayManifests(t, tc.values), secret...))
			}
			if tc.old != "" {
				edited := strings.Replace(manifests, tc.old, tc.new, 1)
				if edited == manifests {
					t.Fatal("edit changed nothing; the manifests no longer contain what this case breaks")
				}
				manifests = edited
			}
			res, err := translateGateway(t, egctl, []byte(manifests))
			if err != nil {
				t.Fatal(err)
			}
			var r report
			checkGatewayStatus(res, &r)
			checkGatewayXDS(res, limits, paths, replies, &r)
			for _, w := range r.warnings {
				t.Logf("warning: %s", w)
			}
			if len(tc.wants) == 0 {
				for _, e := range r.errs {
					t.Error(e)
				}
				return
			}
			all := strings.Join(r.errs, "\n")
			for _, want := range tc.wants {
				if !strings.Contains(all, want) {
					t.Errorf("report does not mention %q; got:\n%s", want, all)
				}
			}
		})
	}
}

// checkGatewayStatus fails on any False condition Envoy Gateway set on a resource, such as a
// policy whose target is missing or a route whose backend cannot be resolved, and on any
// Warning it set, such as a policy using a deprecated field.
func checkGatewayStatus(res map[string]any, r *report) {
	for kind, v := range res {
		if kind == "xds" {
			continue
		}
		objs, ok := v.([]any)
		if !ok {
			objs = []any{v}
		}
		for _, o := range objs {
			name := digString(o, "metadata", "name")
			var conds []any
			if c, ok := dig(o, "status", "conditions").([]any); ok {
				conds = append(conds, c...)
			}
			for _, group := range []string{"parents", "ancestors", "listeners"} {
				list, _ := dig(o, "status", group).([]any)
				for _, e := range list {
					if c, ok := dig(e, "conditions").([]any); ok {
						conds = append(conds, c...)
					}
				}
			}
			for _, c := range conds {
				if digString(c, "status") == "False" || digString(c, "type") == "Warning" && digString(c, "status") == "True" {
					r.errorf("%s %s: condition %s is %s (%s): %s", kind, name, digString(c, "type"), digString(c, "status"), digString(c, "reason"), digString(c, "message"))
				}
			}
		}
	}
}

// affinityMetadata is the initial_metadata the chart's policies put on the ext_proc stream
// (docs/envoy.md §14): each client session header's value (handlers.SessionHeaders, which
// pd-extproc reads too), and the client's address.
func affinityMetadata() map[string]string {
	m := map[string]string{handlers.ClientAddressHeader: "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"}
	for _, h := range handlers.SessionHeaders {
		m[h] = "%REQ(" + h + ")%"
	}
	return m
}

// checkGatewayXDS parses the xDS egctl produced into Envoy's types, runs the same proto and
// semantic rules as the standalone configs, and then checks what the manifests promise.
func checkGatewayXDS(res map[string]any, limits serviceLimits, paths []string, replies *hcmv3.LocalReplyConfig, r *report) {
	configs, _ := dig(res, "xds", gatewayXDSKey, "configs").([]any)
	if len(configs) == 0 {
		r.errorf("egctl produced no xDS for %s", gatewayXDSKey)
		return
	}
	m := newEnvoyModel()
	for _, c := range configs {
		dump, err := unpackJSONAny(c)
		if err != nil {
			r.errorf("xDS config dump: %v", err)
			continue
		}
		validateDeep(dump, r)
		switch d := dump.(type) {
		case *adminv3.ClustersConfigDump:
			for _, dc := range d.GetDynamicActiveClusters() {
				var cl clusterv3.Cluster
				if unpackInto(dc.GetCluster(), &cl, r) {
					m.addCluster(&cl, r)
				}
			}
		case *adminv3.ListenersConfigDump:
			for _, dl := range d.GetDynamicListeners() {
				var l listenerv3.Listener
				if unpackInto(dl.GetActiveState().GetListener(), &l, r) {
					m.addListener(&l)
				}
			}
		case *adminv3.RoutesConfigDump:
			for _, dr := range d.GetDynamicRouteConfigs() {
				var rc routev3.RouteConfiguration
				if unpackInto(dr.GetRouteConfig(), &rc, r) {
					m.routeConfigs[rc.GetName()] = &rc
				}
			}
		case *adminv3.EndpointsConfigDump:
			for _, de := range d.GetDynamicEndpointConfigs() {
				var cla endpointv3.ClusterLoadAssignment
				if unpackInto(de.GetEndpointConfig(), &cla, r) {
					m.endpoints[cla.GetClusterName()] = &cla
				}
			}
		}
	}
	m.check(limits, r)
	m.checkLink(r)
	checkGatewayPromises(m, paths, replies, r)
}

// checkGatewayPromises: the inference listener runs pd-extproc in FULL_DUPLEX over HTTP/2 to
// the extproc Service, answers Envoy's own errors as the standalone Envoy does (replies), and
// every path of the API table (paths) goes to the ORIGINAL_DST cluster.
func checkGatewayPromises(m *envoyModel, paths []string, replies *hcmv3.LocalReplyConfig, r *report) {
	var hcm *hcmUse
	for i, u := range m.hcms {
		if u.hcm.GetRds().GetRouteConfigName() == gatewayRouteConfig {
			hcm = &m.hcms[i]
		}
	}
	if hcm == nil {
		r.errorf("no listener uses route config %s", gatewayRouteConfig)
		return
	}
	if port := hcm.listener.GetAddress().GetSocketAddress().GetPortValue(); port != gatewayListenerPort {
		r.errorf("inference listener port = %d, want %d", port, gatewayListenerPort)
	}
	// FULL_DUPLEX_STREAMED (checked below) holds no body in Envoy, so the buffer limit caps
	// none; m.check holds it to limits.max_body_bytes if the request body is BUFFERED.
	bufferLimit := hcm.listener.GetPerConnectionBufferLimitBytes().GetValue()

	var extProc *extprocv3.ExternalProcessor
	var extProcName string
	for _, f := range hcm.hcm.GetHttpFilters() {
		var ep extprocv3.ExternalProcessor
		if f.GetTypedConfig().MessageIs(&ep) && f.GetTypedConfig().UnmarshalTo(&ep) == nil {
			extProc, extProcName = &ep, f.GetName()
		}
	}
	if extProc == nil {
		r.errorf("inference listener has no ext_proc filter")
		return
	}
	pm := extProc.GetProcessingMode()
	if pm.GetRequestBodyMode() != extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED || pm.GetResponseBodyMode() != extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		r.errorf("ext_proc body modes = %s/%s, want FULL_DUPLEX_STREAMED for both", pm.GetRequestBodyMode(), pm.GetResponseBodyMode())
	}
	grpcCluster := extProc.GetGrpcService().GetEnvoyGrpc().GetClusterName()
	if c, ok := m.clusters[grpcCluster]; !ok || !clusterSpeaksHTTP2(c) {
		r.errorf("ext_proc cluster %q missing or not HTTP/2", grpcCluster)
	}
	if !claHasPort(m.endpoints[grpcCluster], extprocServicePort) {
		r.errorf("ext_proc cluster %q has no endpoint on the extproc Service port %d", grpcCluster, extprocServicePort)
	}
	// A client's session header, else its address, keeps its requests on one replica
	// (docs/envoy.md §14): checkSessionAffinity says the cluster hashes only headers the
	// stream carries.
	carried := map[string]string{}
	for _, hv := range extProc.GetGrpcService().GetInitialMetadata() {
		carried[hv.GetKey()] = hv.GetValue()
	}
	if want := affinityMetadata(); !maps.Equal(carried, want) {
		r.errorf("ext_proc initial_metadata carries %v, want %v (the session-affinity EnvoyPatchPolicy did not apply)", carried, want)
	}
	c := m.clusters[grpcCluster]
	var hashed []string
	for _, hp := range httpProtocolOptions(c).GetHashPolicy() {
		hashed = append(hashed, hp.GetHeader().GetHeaderName())
	}
	if want := append(slices.Clone(handlers.SessionHeaders), handlers.ClientAddressHeader); !envoyemu.HashBalanced(c) || !slices.Equal(hashed, want) {
		r.errorf("ext_proc cluster %q hashes %v, want a hash load balancer on %v (the EnvoyExtensionPolicy's backendSettings.loadBalancer)", grpcCluster, hashed, want)
	}
	if got := hcm.hcm.GetLocalReplyConfig(); !proto.Equal(got, replies) {
		r.errorf("inference listener local_reply_config = %v, not config/envoy/envoy.yaml's (the local-replies EnvoyPatchPolicy did not apply): Envoy's own errors reach clients as text", got)
	}
	// Envoy Gateway's default refuses a request with an underscore in a header name; Codex
	// before May 2026 sends session_id with every request.
	if a := hcm.hcm.GetCommonHttpProtocolOptions().GetHeadersWithUnderscoresAction(); a != corev3.HttpProtocolOptions_DROP_HEADER {
		r.errorf("inference listener headers_with_underscores_action = %s, want DROP_HEADER (ClientTrafficPolicy headers.withUnderscoresAction): clients sending session_id get 400", a)
	}

	rc := m.routeConfigs[gatewayRouteConfig]
	var matches []*routev3.RouteMatch
	for _, vh := range rc.GetVirtualHosts() {
		for _, rt := range vh.GetRoutes() {
			if !strings.HasPrefix(rt.GetName(), inferenceRoutePrefix) {
				continue
			}
			matches = append(matches, rt.GetMatch())
			cluster := rt.GetRoute().GetCluster()
			if c, ok := m.clusters[cluster]; !ok || c.GetType() != clusterv3.Cluster_ORIGINAL_DST {
				r.errorf("route %s goes to %q, which is not an ORIGINAL_DST cluster: the EnvoyPatchPolicy did not apply", rt.GetName(), cluster)
			}
			if _, ok := rt.GetTypedPerFilterConfig()[extProcName]; !ok {
				r.errorf("route %s does not enable ext_proc %q", rt.GetName(), extProcName)
			}
			if rt.GetRoute().GetIdleTimeout() != nil && rt.GetRoute().GetIdleTimeout().AsDuration() == 0 {
				r.errorf("route %s has no stream idle timeout, so a hung engine holds the stream forever (BackendTrafficPolicy timeout.http.streamIdleTimeout)", rt.GetName())
			}
		}
	}
	for name, c := range m.clusters {
		if got := c.GetPerConnectionBufferLimitBytes().GetValue(); c.GetType() == clusterv3.Cluster_ORIGINAL_DST && got != bufferLimit {
			r.errorf("decode cluster %q buffer limit = %d bytes, not the inference listener's %d (gateway.bufferLimit)", name, got, bufferLimit)
		}
	}
	for _, p := range paths {
		if !slices.ContainsFunc(matches, func(m *routev3.RouteMatch) bool { return routeMatches(m, p) }) {
			r.errorf("no inference route for %s", p)
		}
	}
}

// routeMatches reports whether an Envoy route match takes path, as Envoy's
// router matches paths (case-sensitive).
func routeMatches(m *routev3.RouteMatch, path string) bool {
	switch {
	case m.GetPath() != "":
		return path == m.GetPath()
	case m.GetPathSeparatedPrefix() != "":
		p := m.GetPathSeparatedPrefix()
		return path == p || strings.HasPrefix(path, p+"/")
	case m.GetPrefix() != "":
		return strings.HasPrefix(path, m.GetPrefix())
	}
	return false
}

func claHasPort(cla *endpointv3.ClusterLoadAssignment, port uint32) bool {
	for _, le := range cla.GetEndpoints() {
		for _, lb := range le.GetLbEndpoints() {
			if lb.GetEndpoint().GetAddress().GetSocketAddress().GetPortValue() == port {
				return true
			}
		}
	}
	return false
}

// unpackJSONAny turns one element of a config dump (JSON with "@type") into its message.
func unpackJSONAny(v any) (proto.Message, error) {
	js, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var a anypb.Any
	if err := protojson.Unmarshal(js, &a); err != nil {
		return nil, err
	}
	return a.UnmarshalNew()
}

func unpackInto(a *anypb.Any, m proto.Message, r *report) bool {
	if err := a.UnmarshalTo(m); err != nil {
		r.errorf("unpack %s: %v", a.GetTypeUrl(), err)
		return false
	}
	return true
}

// clientTLSSecret is the Secret pd-extproc-client-tls as cert-manager writes it (type
// kubernetes.io/tls with tls.crt, tls.key and ca.crt), for a certificate of a test CA.
func clientTLSSecret(t *testing.T) []byte {
	t.Helper()
	ca, err := testpki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	cert, key, err := ca.IssuePEM(testpki.Leaf{Name: "envoy", SANs: []string{testbed.ClientSAN}, Client: true})
	if err != nil {
		t.Fatal(err)
	}
	enc := base64.StdEncoding.EncodeToString
	return fmt.Appendf(nil, "---\napiVersion: v1\nkind: Secret\nmetadata: {name: pd-extproc-client-tls, namespace: %s}\ntype: kubernetes.io/tls\ndata:\n  tls.crt: %s\n  tls.key: %s\n  ca.crt: %s\n",
		manifestNamespace, enc(cert), enc(key), enc(ca.PEM))
}

// The decode cluster the EnvoyPatchPolicy adds takes gateway.bufferLimit in bytes, in each form
// of a quantity Envoy Gateway reads the same value from; a form the chart cannot count is
// refused, naming the key.
func TestGatewayBufferLimitInBytes(t *testing.T) {
	ex := example(t, "envoy-gateway")
	for _, tc := range []struct {
		limit any
		want  string // the cluster's per_connection_buffer_limit_bytes, or the refusal
	}{
		{"32Mi", "33554432"},
		{33554432, "33554432"},
		{"64M", "64000000"},
		{"1Gi", "1073741824"},
		{"0.5Gi", `gateway.bufferLimit: "0.5Gi" is not a whole number of bytes`},
	} {
		t.Run(fmt.Sprint(tc.limit), func(t *testing.T) {
			values := map[string]any{"envoy": map[string]any{"enabled": false}, "gateway": map[string]any{"enabled": true, "bufferLimit": tc.limit}}
			out, err := chart.Render(testbed.MustRepoPath(t, chart.Dir), ex.Release, values)
			if err != nil {
				if !strings.Contains(err.Error(), tc.want) {
					t.Errorf("render: %v, want %q", err, tc.want)
				}
				return
			}
			got := regexp.MustCompile(`(?m)^\s+per_connection_buffer_limit_bytes: (\S+)$`).FindSubmatch(out)
			if got == nil || string(got[1]) != tc.want {
				t.Errorf("decode cluster per_connection_buffer_limit_bytes = %q, want %s", got, tc.want)
			}
		})
	}
}
