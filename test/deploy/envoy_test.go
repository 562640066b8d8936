package deploy

import (
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/yaml"

	defaultconfig "github.com/pd-extproc/pd-extproc/config"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
	extprocconfig "github.com/pd-extproc/pd-extproc/pkg/config"
)

// envoyConfig is one Envoy bootstrap in the repository, already converted to JSON.
type envoyConfig struct {
	rel  string // repository-relative path, for messages
	json []byte
}

// notEnvoy names YAML files in config/envoy that are not Envoy bootstraps.
var notEnvoy = []string{"docker-compose*.yaml", "extproc*.yaml"}

// envoyConfigs finds every Envoy bootstrap: the shipped ones in config/envoy and the fixtures
// in testdata. A new config file is picked up (and checked) without touching this test.
func envoyConfigs(t *testing.T) []envoyConfig {
	t.Helper()
	root := testbed.MustRepoRoot(t)
	var paths []string
	for _, pattern := range []string{"config/envoy/*.yaml", "config/envoy/*.yml", "test/deploy/testdata/envoy-*.yaml"} {
		m, err := filepath.Glob(filepath.Join(root, filepath.FromSlash(pattern)))
		if err != nil {
			t.Fatal(err)
		}
		paths = append(paths, m...)
	}
	var out []envoyConfig
	for _, p := range paths {
		if slices.ContainsFunc(notEnvoy, func(pat string) bool {
			ok, _ := filepath.Match(pat, filepath.Base(p))
			return ok
		}) {
			continue
		}
		raw, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		js, err := yaml.YAMLToJSON(raw)
		if err != nil {
			t.Fatalf("%s: not YAML: %v", p, err)
		}
		rel, _ := filepath.Rel(root, p)
		out = append(out, envoyConfig{rel: filepath.ToSlash(rel), json: js})
	}
	return out
}

// localReplyConfig is the local_reply_config of the connection manager that runs ext_proc in
// the bootstrap js.
func localReplyConfig(t *testing.T, js []byte) *hcmv3.LocalReplyConfig {
	t.Helper()
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(js, &b); err != nil {
		t.Fatal(err)
	}
	var r report
	for _, u := range modelFromBootstrap(&b, &r).hcms {
		if len(extProcFilters(u.hcm)) > 0 {
			return u.hcm.GetLocalReplyConfig()
		}
	}
	t.Fatal("no connection manager runs ext_proc")
	return nil
}

// shippedLocalReplies is config/envoy/envoy.yaml's local_reply_config, of configs
// (envoyConfigs), which every way of running Envoy in front of pd-extproc shares.
func shippedLocalReplies(t *testing.T, configs []envoyConfig) *hcmv3.LocalReplyConfig {
	t.Helper()
	i := slices.IndexFunc(configs, func(c envoyConfig) bool { return c.rel == "config/envoy/envoy.yaml" })
	if i < 0 {
		t.Fatal("config/envoy/envoy.yaml is missing")
	}
	return localReplyConfig(t, configs[i].json)
}

// defaultServiceLimits takes the limits Envoy must accommodate from the config embedded in
// the extproc binary, through the service's own parser (so its defaults apply too): raising
// them there without adjusting Envoy fails here.
func defaultServiceLimits(t *testing.T) serviceLimits {
	t.Helper()
	c, err := extprocconfig.Unconfigured(defaultconfig.DefaultYAML)
	if err != nil {
		t.Fatalf("embedded config/extproc.yaml: %v", err)
	}
	return serviceLimits{
		maxBodyBytes:           uint64(c.Limits.MaxBodyBytes),
		maxConcurrentStreams:   c.Limits.MaxConcurrentStreams,
		overrideMessageTimeout: time.Duration(c.Envoy.OverrideMessageTimeout),
	}
}

func TestEnvoyConfigsAreValid(t *testing.T) {
	configs := envoyConfigs(t)
	limits := defaultServiceLimits(t)
	replies := shippedLocalReplies(t, configs)
	// The shipped configs and the body mode each must keep; the e2e emulator and the docs
	// depend on envoy.yaml being the FULL_DUPLEX one.
	want := map[string]extprocv3.ProcessingMode_BodySendMode{
		"config/envoy/envoy.yaml":          extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		"config/envoy/envoy-buffered.yaml": extprocv3.ProcessingMode_BUFFERED,
		// The response path skipped (README, "The response path"), the request as in envoy.yaml.
		"config/envoy/envoy-no-response.yaml": extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
	}
	for rel := range want {
		if !slices.ContainsFunc(configs, func(c envoyConfig) bool { return c.rel == rel }) {
			t.Errorf("%s is missing", rel)
		}
	}
	for _, c := range configs {
		t.Run(c.rel, func(t *testing.T) {
			r := checkEnvoyBootstrapJSON(c.json, limits)
			for _, w := range r.warnings {
				t.Logf("warning: %s", w)
			}
			for _, e := range r.errs {
				t.Error(e)
			}
			if _, ok := want[c.rel]; ok {
				// Envoy's own errors in OpenAI's JSON (docs/envoy.md §15), alike in every
				// shipped config.
				if got := localReplyConfig(t, c.json); got == nil || !proto.Equal(got, replies) {
					t.Errorf("local_reply_config = %v, want config/envoy/envoy.yaml's", got)
				}
			}
			if mode, ok := want[c.rel]; ok {
				got := requestBodyModes(t, c.json)
				if len(got) == 0 || slices.ContainsFunc(got, func(m extprocv3.ProcessingMode_BodySendMode) bool { return m != mode }) {
					t.Errorf("ext_proc request_body_mode = %v, want %v", got, mode)
				}
			}
		})
	}
}

func requestBodyModes(t *testing.T, js []byte) []extprocv3.ProcessingMode_BodySendMode {
	t.Helper()
	var doc map[string]any
	if err := json.Unmarshal(js, &doc); err != nil {
		t.Fatal(err)
	}
	var modes []extprocv3.ProcessingMode_BodySendMode
	for _, ep := range extProcsIn(doc) {
		name := digString(ep, "processing_mode", "request_body_mode")
		modes = append(modes, extprocv3.ProcessingMode_BodySendMode(extprocv3.ProcessingMode_BodySendMode_value[name]))
	}
	return modes
}

// eachObject calls fn on every JSON object in v, parents before children.
func eachObject(v any, fn func(map[string]any)) {
	switch x := v.(type) {
	case map[string]any:
		fn(x)
		for _, k := range slices.Sorted(maps.Keys(x)) {
			eachObject(x[k], fn)
		}
	case []any:
		for _, e := range x {
			eachObject(e, fn)
		}
	}
}

// hasType reports whether a JSON object is a packed Any of the given proto type.
func hasType(m map[string]any, fullName string) bool {
	s, _ := m["@type"].(string)
	return strings.HasSuffix(s, "/"+fullName)
}

// breakage turns a valid config into one with a single known mistake; it reports false when
// the config has nothing to break that way (e.g. a BUFFERED rule on a FULL_DUPLEX config).
type breakage func(doc map[string]any) bool

func TestEnvoyValidatorRejectsBrokenConfigs(t *testing.T) {
	configs := envoyConfigs(t)
	limits := defaultServiceLimits(t)
	tests := []struct {
		name  string
		brk   breakage
		wants []string // substrings the report must contain, naming the problem
	}{
		{
			name: "route to a missing cluster",
			brk: forEachRouteAction(func(ra map[string]any) bool {
				if _, ok := ra["cluster"]; !ok {
					return false
				}
				ra["cluster"] = "no-such-cluster"
				return true
			}),
			wants: []string{`cluster "no-such-cluster" is not defined`},
		},
		{
			name: "FULL_DUPLEX with failure_mode_allow true",
			brk: forEachExtProc(func(ep map[string]any) bool {
				if !isFullDuplex(ep) {
					return false
				}
				ep["failure_mode_allow"] = true
				return true
			}),
			wants: []string{"failure_mode_allow is true: when pd-extproc is unreachable (in FULL_DUPLEX_STREAMED"},
		},
		{
			name: "FULL_DUPLEX with request trailers skipped",
			brk: forEachExtProc(func(ep map[string]any) bool {
				pm, _ := ep["processing_mode"].(map[string]any)
				if digString(pm, "request_body_mode") != "FULL_DUPLEX_STREAMED" {
					return false
				}
				pm["request_trailer_mode"] = "SKIP"
				return true
			}),
			wants: []string{"request_trailer_mode is SKIP; FULL_DUPLEX_STREAMED requires SEND"},
		},
		{
			name: "BUFFERED failing open lets clients steer ORIGINAL_DST",
			brk: forEachExtProc(func(ep map[string]any) bool {
				if isFullDuplex(ep) {
					return false
				}
				ep["failure_mode_allow"] = true
				return true
			}),
			wants: []string{"failure_mode_allow is true", destinationHeader},
		},
		{
			name: "ORIGINAL_DST keyed on another header",
			brk: forEachOriginalDstCluster(func(c map[string]any) bool {
				cfg, _ := c["original_dst_lb_config"].(map[string]any)
				if cfg == nil {
					return false
				}
				cfg["http_header_name"] = "target-pod"
				return true
			}),
			wants: []string{"reads header target-pod, but pd-extproc sets " + destinationHeader},
		},
		{
			name: "ORIGINAL_DST without use_http_header",
			brk: forEachOriginalDstCluster(func(c map[string]any) bool {
				delete(c, "original_dst_lb_config")
				return true
			}),
			wants: []string{"use_http_header must be true"},
		},
		{
			name: "ORIGINAL_DST with round robin",
			brk: forEachOriginalDstCluster(func(c map[string]any) bool {
				c["lb_policy"] = "ROUND_ROBIN"
				return true
			}),
			wants: []string{"lb_policy is ROUND_ROBIN; Envoy requires CLUSTER_PROVIDED"},
		},
		{
			name:  "HTTP/1 ext_proc cluster",
			brk:   http1ExtProcCluster,
			wants: []string{"is not HTTP/2, but gRPC needs HTTP/2"},
		},
		{
			name: "ext_proc grpc cluster missing",
			brk: forEachExtProc(func(ep map[string]any) bool {
				g, _ := dig(ep, "grpc_service", "envoy_grpc").(map[string]any)
				if g == nil {
					return false
				}
				g["cluster_name"] = "no-such-extproc"
				return true
			}),
			wants: []string{`grpc_service cluster "no-such-extproc" is not defined`},
		},
		{
			name: "envoy.lb not a receiving namespace",
			brk: forEachExtProc(func(ep map[string]any) bool {
				delete(ep, "metadata_options")
				return true
			}),
			wants: []string{`receiving_namespaces.untyped lacks "envoy.lb"`},
		},
		{
			name: "inference route keeps the 15 s default timeout",
			brk: forEachRouteAction(func(ra map[string]any) bool {
				delete(ra, "timeout")
				return true
			}),
			wants: []string{"no timeout, so Envoy's default 15s route timeout"},
		},
		{
			name: "inference route with a 60 s timeout",
			brk: forEachRouteAction(func(ra map[string]any) bool {
				ra["timeout"] = "60s"
				return true
			}),
			wants: []string{"timeout 1m0s cuts long generations"},
		},
		{
			name: "BUFFERED without max_message_timeout",
			brk: forEachExtProc(func(ep map[string]any) bool {
				if digString(ep, "processing_mode", "request_body_mode") != "BUFFERED" {
					return false
				}
				delete(ep, "max_message_timeout")
				return true
			}),
			wants: []string{"needs max_message_timeout (0s) > message_timeout"},
		},
		{
			name: "BUFFERED max_message_timeout below what pd-extproc asks for",
			brk: forEachExtProc(func(ep map[string]any) bool {
				if digString(ep, "processing_mode", "request_body_mode") != "BUFFERED" {
					return false
				}
				ep["max_message_timeout"] = "30s"
				return true
			}),
			wants: []string{"max_message_timeout 30s is below the 1m0s pd-extproc asks for"},
		},
		{
			name: "BUFFERED behind Envoy's 1 MiB default buffer",
			brk: func(doc map[string]any) bool {
				if !slices.ContainsFunc(extProcsIn(doc), func(ep map[string]any) bool {
					return digString(ep, "processing_mode", "request_body_mode") == "BUFFERED"
				}) {
					return false
				}
				return forEachObject(func(m map[string]any) bool {
					changed := false
					for _, k := range []string{"per_connection_buffer_limit_bytes", "per_request_buffer_limit_bytes", "request_body_buffer_limit"} {
						if _, ok := m[k]; ok {
							delete(m, k)
							changed = true
						}
					}
					return changed
				})(doc)
			},
			wants: []string{"1048576-byte Envoy buffer limit", "413"},
		},
		{
			name: "ext_proc disabled on the inference route",
			brk: func(doc map[string]any) bool {
				names := extProcFilterNames(doc)
				if len(names) == 0 {
					return false
				}
				return forEachRoute(func(rt map[string]any) bool {
					rt["typed_per_filter_config"] = map[string]any{names[0]: map[string]any{
						"@type":    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
						"disabled": true,
					}}
					return true
				})(doc)
			},
			wants: []string{"disables ext_proc", "client-supplied " + destinationHeader},
		},
		{
			name: "router filter before ext_proc",
			brk: forEachObject(func(m map[string]any) bool {
				fs, ok := m["http_filters"].([]any)
				if ok && len(fs) > 1 {
					slices.Reverse(fs)
				}
				return ok && len(fs) > 1
			}),
			wants: []string{"comes after the router, so it never runs"},
		},
		{
			// Proves Any contents are validated: stat_prefix is required by the HCM's own
			// proto rules, and the HCM only exists packed in the listener's typed_config.
			name: "proto rule broken inside a packed Any",
			brk: forEachHCM(func(hcm map[string]any) bool {
				hcm["stat_prefix"] = ""
				return true
			}),
			wants: []string{"HttpConnectionManager.StatPrefix"},
		},
		{
			name: "unknown typed_config type",
			brk: forEachObject(func(m map[string]any) bool {
				if !hasType(m, "envoy.extensions.filters.http.router.v3.Router") {
					return false
				}
				m["@type"] = "type.googleapis.com/envoy.extensions.filters.http.no_such.v3.NoSuchFilter"
				return true
			}),
			wants: []string{"NoSuchFilter"},
		},
		{
			name: "ORIGINAL_DST at Envoy's default circuit breakers",
			brk: forEachOriginalDstCluster(func(c map[string]any) bool {
				delete(c, "circuit_breakers")
				return true
			}),
			wants: []string{`ORIGINAL_DST cluster "pd_original_dst" sets no circuit_breakers`},
		},
		{
			name: "ext_proc cluster admitting no more streams than pd-extproc",
			brk: forEachExtProcCluster(func(c map[string]any) bool {
				c["circuit_breakers"] = map[string]any{"thresholds": []any{map[string]any{"max_requests": 1024}}}
				return true
			}),
			wants: []string{"max_requests 1024 is below 10000", "max_connections 1024 is below 10000", "not above limits.max_concurrent_streams 1024"},
		},
		{
			name: "decode-leg connections kept idle longer than the engines keep them",
			brk: forEachOriginalDstCluster(func(c map[string]any) bool {
				delete(c, "typed_extension_protocol_options")
				return true
			}),
			wants: []string{`ORIGINAL_DST cluster "pd_original_dst": idle connections kept 0s, not closed before the engines close them`},
		},
		{
			name: "ext_proc replicas kept after DNS drops them",
			brk: forEachExtProcCluster(func(c map[string]any) bool {
				delete(c, "ignore_health_on_host_removal")
				return c["health_checks"] != nil
			}),
			wants: []string{"health_checks without ignore_health_on_host_removal"},
		},
		{
			name: "ext_proc HTTP/2 connections that cannot carry the streams",
			brk: forEachExtProcH2(func(c, h2 map[string]any) bool {
				h2["max_concurrent_streams"] = 100
				c["circuit_breakers"] = map[string]any{"thresholds": []any{map[string]any{
					"max_connections": 16, "max_pending_requests": 16384, "max_requests": 16384}}}
				return true
			}),
			wants: []string{"16 connections of 100 HTTP/2 streams cannot carry max_requests 16384"},
		},
		{
			name: "ext_proc connections that Envoy never pings",
			brk: forEachExtProcH2(func(_, h2 map[string]any) bool {
				delete(h2, "connection_keepalive")
				return true
			}),
			wants: []string{"sets no http2_protocol_options.connection_keepalive"},
		},
		{
			name: "ext_proc connections pinged faster than pd-extproc takes",
			brk: forEachExtProcH2(func(_, h2 map[string]any) bool {
				h2["connection_keepalive"] = map[string]any{"interval": "5s", "timeout": "20s"}
				return true
			}),
			wants: []string{"pings every 5s, more often than pd-extproc takes pings"},
		},
		{
			name: "admin interface on every address",
			brk: func(doc map[string]any) bool {
				sa, _ := dig(doc, "admin", "address", "socket_address").(map[string]any)
				if sa == nil {
					return false
				}
				sa["address"] = "0.0.0.0"
				return true
			},
			wants: []string{`admin listens on "0.0.0.0"`},
		},
		{
			name: "stats listener opened to the whole admin interface",
			brk: forEachRoute(func(rt map[string]any) bool {
				if digString(rt, "route", "cluster") != "envoy_admin" {
					return false
				}
				rt["match"] = map[string]any{"prefix": "/"}
				return true
			}),
			wants: []string{"reaches the admin interface; it may serve only GET /stats/prometheus"},
		},
		{
			name: "unknown field",
			brk: forEachExtProc(func(ep map[string]any) bool {
				ep["failure_mode_alow"] = false
				return true
			}),
			wants: []string{"failure_mode_alow"},
		},
		{
			name: "plaintext ext_proc cluster",
			brk: forEachExtProcCluster(func(c map[string]any) bool {
				delete(c, "transport_socket")
				return true
			}),
			wants: []string{`ext_proc cluster "extproc" is plaintext`},
		},
		{
			name: "ext_proc TLS that verifies nothing",
			brk: forEachExtProcTLS(func(ctc map[string]any) bool {
				delete(ctc, "validation_context")
				delete(ctc, "combined_validation_context")
				return true
			}),
			wants: []string{"does not verify pd-extproc's certificate", "does not require the SAN pd-extproc.pd-extproc.svc"},
		},
		{
			name: "ext_proc TLS accepting another service's certificate",
			brk: forEachExtProcTLS(func(ctc map[string]any) bool {
				sans, _ := dig(ctc, "combined_validation_context", "default_validation_context", "match_typed_subject_alt_names").([]any)
				if len(sans) == 0 {
					return false
				}
				sans[0].(map[string]any)["matcher"] = map[string]any{"exact": "vllm-decode.pd-extproc.svc"}
				return true
			}),
			wants: []string{"does not require the SAN pd-extproc.pd-extproc.svc"},
		},
		{
			name: "ext_proc TLS without a client certificate",
			brk: forEachExtProcTLS(func(ctc map[string]any) bool {
				delete(ctc, "tls_certificate_sds_secret_configs")
				delete(ctc, "tls_certificates")
				return true
			}),
			wants: []string{"sends no client certificate"},
		},
		{
			// Envoy reads certificate files named in the bootstrap once: a renewed Secret then
			// needs a restart, and without one every request fails once the old one expires.
			name: "ext_proc client certificate from plain files",
			brk: forEachExtProcTLS(func(ctc map[string]any) bool {
				delete(ctc, "tls_certificate_sds_secret_configs")
				ctc["tls_certificates"] = []any{map[string]any{
					"certificate_chain": map[string]any{"filename": "/etc/envoy/certs/tls.crt"},
					"private_key":       map[string]any{"filename": "/etc/envoy/certs/tls.key"},
				}}
				return true
			}),
			wants: []string{"names its client certificate's files in the bootstrap"},
		},
		{
			name: "ext_proc TLS offering HTTP/1.1 only",
			brk: forEachExtProcTLS(func(ctc map[string]any) bool {
				ctc["alpn_protocols"] = []any{"http/1.1"}
				return true
			}),
			wants: []string{"without h2"},
		},
		{
			name: "Envoy not the edge",
			brk: forEachHCM(func(hcm map[string]any) bool {
				if extProcsIn(hcm) == nil {
					return false
				}
				hcm["use_remote_address"] = false
				delete(hcm, "preserve_external_request_id")
				return true
			}),
			wants: []string{"use_remote_address is not true", "preserve_external_request_id is not true"},
		},
		{
			name: "BUFFERED buffer above what pd-extproc accepts",
			brk: func(doc map[string]any) bool {
				if !slices.ContainsFunc(extProcsIn(doc), func(ep map[string]any) bool {
					return digString(ep, "processing_mode", "request_body_mode") == "BUFFERED"
				}) {
					return false
				}
				for _, l := range dig(doc, "static_resources", "listeners").([]any) {
					if _, ok := l.(map[string]any)["per_connection_buffer_limit_bytes"]; ok && extProcsIn(l.(map[string]any)) != nil {
						l.(map[string]any)["per_connection_buffer_limit_bytes"] = 67108864
						return true
					}
				}
				return false
			},
			wants: []string{"above pd-extproc's limits.max_body_bytes 33554432", "500 instead of a 413"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			applied := 0
			for _, c := range configs {
				var doc map[string]any
				if err := json.Unmarshal(c.json, &doc); err != nil {
					t.Fatal(err)
				}
				if !tc.brk(doc) {
					continue
				}
				applied++
				broken, err := json.Marshal(doc)
				if err != nil {
					t.Fatal(err)
				}
				r := checkEnvoyBootstrapJSON(broken, limits)
				all := strings.Join(r.errs, "\n")
				for _, want := range tc.wants {
					if !strings.Contains(all, want) {
						t.Errorf("%s broken: report does not mention %q; got:\n%s", c.rel, want, all)
					}
				}
			}
			if applied == 0 {
				t.Fatalf("no config to break this way; the case tests nothing")
			}
		})
	}
}

func isFullDuplex(ep map[string]any) bool {
	return digString(ep, "processing_mode", "request_body_mode") == "FULL_DUPLEX_STREAMED" ||
		digString(ep, "processing_mode", "response_body_mode") == "FULL_DUPLEX_STREAMED"
}

func extProcsIn(doc map[string]any) []map[string]any {
	var out []map[string]any
	eachObject(doc, func(m map[string]any) {
		if hasType(m, "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor") {
			out = append(out, m)
		}
	})
	return out
}

func forEachExtProc(fn func(ep map[string]any) bool) breakage {
	return func(doc map[string]any) bool {
		changed := false
		for _, ep := range extProcsIn(doc) {
			changed = fn(ep) || changed
		}
		return changed
	}
}

// forEachRoute visits every route that forwards upstream (has a "route" action).
func forEachRoute(fn func(rt map[string]any) bool) breakage {
	return forEachObject(func(m map[string]any) bool {
		_, isRoute := m["match"]
		_, forwards := m["route"].(map[string]any)
		return isRoute && forwards && fn(m)
	})
}

// forEachObject visits every object of the document, however deep.
func forEachObject(fn func(m map[string]any) bool) breakage {
	return func(doc map[string]any) bool {
		changed := false
		eachObject(doc, func(m map[string]any) { changed = fn(m) || changed })
		return changed
	}
}

func forEachRouteAction(fn func(ra map[string]any) bool) breakage {
	return forEachRoute(func(rt map[string]any) bool { return fn(rt["route"].(map[string]any)) })
}

func forEachOriginalDstCluster(fn func(c map[string]any) bool) breakage {
	return func(doc map[string]any) bool {
		changed := false
		for _, c := range staticClusters(doc) {
			if c["type"] == "ORIGINAL_DST" {
				changed = fn(c) || changed
			}
		}
		return changed
	}
}

func staticClusters(doc map[string]any) []map[string]any {
	var out []map[string]any
	list, _ := dig(doc, "static_resources", "clusters").([]any)
	for _, c := range list {
		if m, ok := c.(map[string]any); ok {
			out = append(out, m)
		}
	}
	return out
}

// forEachExtProcCluster visits the static clusters the ext_proc filters stream to.
func forEachExtProcCluster(fn func(c map[string]any) bool) breakage {
	return func(doc map[string]any) bool {
		names := map[string]bool{}
		for _, ep := range extProcsIn(doc) {
			names[digString(ep, "grpc_service", "envoy_grpc", "cluster_name")] = true
		}
		changed := false
		for _, c := range staticClusters(doc) {
			if name, _ := c["name"].(string); names[name] {
				changed = fn(c) || changed
			}
		}
		return changed
	}
}

// forEachExtProcH2 visits each ext_proc cluster with its HTTP/2 options.
func forEachExtProcH2(fn func(c, h2 map[string]any) bool) breakage {
	return forEachExtProcCluster(func(c map[string]any) bool {
		h2, _ := dig(c, "typed_extension_protocol_options", httpProtocolOptionsKey, "explicit_http_config", "http2_protocol_options").(map[string]any)
		return h2 != nil && fn(c, h2)
	})
}

// forEachExtProcTLS visits the common_tls_context of each ext_proc cluster's TLS transport socket.
func forEachExtProcTLS(fn func(ctc map[string]any) bool) breakage {
	return forEachExtProcCluster(func(c map[string]any) bool {
		ctc, _ := dig(c, "transport_socket", "typed_config", "common_tls_context").(map[string]any)
		return ctc != nil && fn(ctc)
	})
}

// forEachHCM visits every HTTP connection manager config.
func forEachHCM(fn func(hcm map[string]any) bool) breakage {
	return forEachObject(func(m map[string]any) bool {
		return hasType(m, "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager") && fn(m)
	})
}

// http1ExtProcCluster strips HTTP/2 from the cluster ext_proc talks to, the way a config
// written for a plain HTTP upstream would look.
var http1ExtProcCluster = forEachExtProcCluster(func(c map[string]any) bool {
	delete(c, "http2_protocol_options")
	delete(c, "typed_extension_protocol_options")
	return true
})

// extProcFilterNames lists the HTTP filter names under which ext_proc filters are installed;
// per-route config refers to a filter by that name.
func extProcFilterNames(doc map[string]any) []string {
	var names []string
	eachObject(doc, func(m map[string]any) {
		tc, ok := m["typed_config"].(map[string]any)
		if ok && hasType(tc, "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor") {
			if n, _ := m["name"].(string); n != "" {
				names = append(names, n)
			}
		}
	})
	return names
}
