package envoyemu

import (
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

func TestLoadConfigShippedFiles(t *testing.T) {
	const (
		fd       = extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
		buffered = extprocfilterv3.ProcessingMode_BUFFERED
		none     = extprocfilterv3.ProcessingMode_NONE
		send     = extprocfilterv3.ProcessingMode_SEND
		skip     = extprocfilterv3.ProcessingMode_SKIP
	)
	tests := []struct {
		file                   string
		respHeaders            extprocfilterv3.ProcessingMode_HeaderSendMode
		reqBody, respBody      extprocfilterv3.ProcessingMode_BodySendMode
		reqTrailer, respTrailr extprocfilterv3.ProcessingMode_HeaderSendMode
		msgTimeout, maxTimeout time.Duration
		bufferLimit            int
	}{
		{"envoy.yaml", send, fd, fd, send, send, 10 * time.Second, 0, 64 << 20},
		// BUFFERED: the buffer equals pd-extproc's limits.max_body_bytes.
		{"envoy-buffered.yaml", send, buffered, none, send, skip, time.Second, 120 * time.Second, 32 << 20},
		{"envoy-no-response.yaml", skip, fd, none, send, skip, 10 * time.Second, 0, 64 << 20},
	}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			cfg := loadShippedAsIs(t, tc.file)
			if cfg.Modes.Request.Headers != send || cfg.Modes.Response.Headers != tc.respHeaders {
				t.Errorf("header modes = %v/%v, want SEND/%v", cfg.Modes.Request.Headers, cfg.Modes.Response.Headers, tc.respHeaders)
			}
			// mTLS to pd-extproc, as the README's "Secure by default" says, its certificate and CA
			// by file-based SDS (followed as they rotate), and Envoy as the edge.
			tls := cfg.Clusters[cfg.ExtProcCluster].TLS
			wantCert := SDSSecret{Name: "extproc_client_cert", Path: "/etc/envoy/sds/client-cert.yaml", WatchedDir: "/etc/envoy/sds"}
			wantCA := SDSSecret{Name: "extproc_trusted_ca", Path: "/etc/envoy/sds/trusted-ca.yaml", WatchedDir: "/etc/envoy/sds"}
			if tls == nil || tls.CertFile != "" || tls.CAFile != "" || tls.CertSDS == nil || *tls.CertSDS != wantCert || tls.CASDS == nil || *tls.CASDS != wantCA ||
				!slices.Equal(tls.SubjectAltNames, []SANMatcher{{Type: "DNS", Op: "exact", Value: "pd-extproc.pd-extproc.svc"}}) {
				t.Errorf("ext_proc cluster TLS = %+v, want the client certificate and the CA by SDS (%+v, %+v) and pd-extproc's SAN", tls, wantCert, wantCA)
			}
			if ch := cfg.ClientHeaders; !ch.UseRemoteAddress || !ch.PreserveExternalRequestID {
				t.Errorf("client headers = %+v, want use_remote_address and preserve_external_request_id", ch)
			}
			if cfg.Modes.Request.Body != tc.reqBody || cfg.Modes.Response.Body != tc.respBody {
				t.Errorf("body modes = %v/%v, want %v/%v", cfg.Modes.Request.Body, cfg.Modes.Response.Body, tc.reqBody, tc.respBody)
			}
			if cfg.Modes.Request.Trailers != tc.reqTrailer || cfg.Modes.Response.Trailers != tc.respTrailr {
				t.Errorf("trailer modes = %v/%v, want %v/%v", cfg.Modes.Request.Trailers, cfg.Modes.Response.Trailers, tc.reqTrailer, tc.respTrailr)
			}
			if cfg.Failure.FailureModeAllow {
				t.Error("failure_mode_allow = true")
			}
			if cfg.Failure.MessageTimeout != tc.msgTimeout || cfg.Failure.MaxMessageTimeout != tc.maxTimeout {
				t.Errorf("timeouts = %v/%v, want %v/%v", cfg.Failure.MessageTimeout, cfg.Failure.MaxMessageTimeout, tc.msgTimeout, tc.maxTimeout)
			}
			if !slices.Equal(cfg.Metadata.ReceivingNamespaces, []string{"envoy.lb"}) {
				t.Errorf("receiving namespaces = %v, want [envoy.lb]", cfg.Metadata.ReceivingNamespaces)
			}
			if cfg.Limits.BufferLimitBytes != tc.bufferLimit {
				t.Errorf("buffer limit = %d, want %d", cfg.Limits.BufferLimitBytes, tc.bufferLimit)
			}
			if cfg.Limits.MaxReceiveMessageLength != 64<<20 {
				t.Errorf("max_receive_message_length = %d, want 64 MiB", cfg.Limits.MaxReceiveMessageLength)
			}
			// Sessions on one replica (§14): the client's session headers (ours, Claude
			// Code's, Codex's, Open WebUI's) on every stream, each hashed and terminal,
			// then the client's address.
			var want []MetadataValue
			var hashes []HashHeader
			for _, h := range handlers.SessionHeaders {
				want = append(want, MetadataValue{h, "%REQ(" + h + ")%"})
				hashes = append(hashes, HashHeader{h, true})
			}
			want = append(want, MetadataValue{handlers.ClientAddressHeader, "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"})
			hashes = append(hashes, HashHeader{handlers.ClientAddressHeader, false})
			if !slices.Equal(cfg.InitialMetadata, want) {
				t.Errorf("initial_metadata = %v, want %v", cfg.InitialMetadata, want)
			}
			if got := cfg.Clusters[cfg.ExtProcCluster].HashHeaders; !slices.Equal(got, hashes) {
				t.Errorf("ext_proc cluster hashes %v, want %v under a ring hash", got, hashes)
			}
			if len(cfg.Routes) == 0 {
				t.Fatal("no routes")
			}
			if r := matchRoute(cfg.Routes, "/v1/chat/completions"); r == nil || r.Timeout != 0 || r.Cluster != "pd_original_dst" {
				t.Errorf("/v1/ route = %+v, want pd_original_dst with no timeout", r)
			}
			if r := matchRoute(cfg.Routes, "/metrics"); r == nil || r.Cluster != "pd_original_dst" {
				t.Errorf("catch-all route = %+v, want pd_original_dst", r)
			}
			sized := Thresholds{MaxConnections: 16384, MaxPendingRequests: 16384, MaxRequests: 16384, MaxRetries: 3}
			if cfg.ExtProcCluster != "extproc" {
				t.Errorf("ext_proc cluster = %q, want extproc", cfg.ExtProcCluster)
			}
			for _, name := range []string{"pd_original_dst", "extproc"} {
				if got := cfg.Clusters[name].Breakers; got != sized {
					t.Errorf("%s circuit breakers = %+v, want %+v", name, got, sized)
				}
			}
			if got := cfg.Clusters["extproc"].StreamsPerConnection; got != 16384 {
				t.Errorf("extproc HTTP/2 streams per connection = %d, want 16384", got)
			}
			if got := cfg.Clusters["pd_original_dst"].StreamsPerConnection; got != 1 {
				t.Errorf("pd_original_dst streams per connection = %d, want 1 (HTTP/1)", got)
			}
			od := cfg.Clusters["pd_original_dst"].OriginalDst
			if !od.UseHTTPHeader || od.HeaderName != "x-gateway-destination-endpoint" ||
				od.MetadataNamespace != "envoy.lb" || !slices.Equal(od.MetadataPath, []string{"x-gateway-destination-endpoint"}) {
				t.Errorf("ORIGINAL_DST = %+v", od)
			}
		})
	}
}

// TestLoadConfigBreakerDefaults: a cluster without circuit_breakers gets
// Envoy's defaults, a thresholds entry that sets some fields keeps the
// defaults of the others, and HTTP/2 without max_concurrent_streams carries
// 2^31 - 1 streams per connection.
func TestLoadConfigBreakerDefaults(t *testing.T) {
	s := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	for _, cut := range []struct{ old, new string }{
		// the decode cluster's thresholds entry keeps max_requests only
		{"      - max_connections: 16384\n        max_pending_requests: 16384\n        max_requests: 16384\n        max_retries: 3\n", "      - max_requests: 4096\n"},
		{"            max_concurrent_streams: 16384\n", ""},
	} {
		if !strings.Contains(s, cut.old) {
			t.Fatalf("envoy.yaml has no %q", cut.old)
		}
		s = strings.Replace(s, cut.old, cut.new, 1)
	}
	// The ext_proc cluster's circuit_breakers go entirely.
	i := strings.LastIndex(s, "    circuit_breakers:")
	j := strings.Index(s[i:], "    typed_extension_protocol_options:")
	s = s[:i] + s[i+j:]
	cfg, err := LoadConfig(writeFile(t, s))
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.Clusters["extproc"].Breakers; got != DefaultThresholds {
		t.Errorf("extproc without circuit_breakers = %+v, want %+v", got, DefaultThresholds)
	}
	want := DefaultThresholds
	want.MaxRequests = 4096
	if got := cfg.Clusters["pd_original_dst"].Breakers; got != want {
		t.Errorf("pd_original_dst with max_requests only = %+v, want %+v", got, want)
	}
	if got := cfg.Clusters["extproc"].StreamsPerConnection; got != defaultHTTP2Streams {
		t.Errorf("extproc streams per connection = %d, want %d", got, defaultHTTP2Streams)
	}
}

// TestLoadConfigRetryPolicy: a route's retry_policy, else its virtual
// host's, with num_retries 1 unless set; what the emulator does not retry
// on is refused.
func TestLoadConfigRetryPolicy(t *testing.T) {
	raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	const route = `route: {cluster: pd_original_dst, timeout: 0s}`
	const vhost = "            - name: inference\n" + `              domains: ["*"]` + "\n"
	tests := []struct {
		name, old, new string
		want           [2]*RetryPolicy // the two routes'
		err            string
	}{
		{name: "none", old: route, new: route},
		{name: "the route's", old: route,
			new:  `route: {cluster: pd_original_dst, timeout: 0s, retry_policy: {retry_on: "connect-failure,retriable-status-codes", num_retries: 2, retriable_status_codes: [503]}}`,
			want: [2]*RetryPolicy{{On: []string{"connect-failure", "retriable-status-codes"}, NumRetries: 2, StatusCodes: []int{503}}}},
		{name: "the virtual host's", old: vhost, new: vhost + `              retry_policy: {retry_on: reset}` + "\n",
			want: [2]*RetryPolicy{{On: []string{"reset"}, NumRetries: 1}, {On: []string{"reset"}, NumRetries: 1}}},
		{name: "a condition not emulated", old: route, new: `route: {cluster: pd_original_dst, retry_policy: {retry_on: refused-stream}}`,
			err: `retry_on "refused-stream" is not emulated`},
		{name: "a per-try timeout", old: route, new: `route: {cluster: pd_original_dst, retry_policy: {retry_on: reset, per_try_timeout: 1s}}`,
			err: "only retry_on, num_retries, retriable_status_codes and retry_back_off"},
		{name: "retry_back_off", old: route,
			new:  `route: {cluster: pd_original_dst, timeout: 0s, retry_policy: {retry_on: reset, retry_back_off: {base_interval: 0.1s, max_interval: 1s}}}`,
			want: [2]*RetryPolicy{{On: []string{"reset"}, NumRetries: 1, BaseInterval: 100 * time.Millisecond, MaxInterval: time.Second}}},
		{name: "retry_back_off below a millisecond counts one", old: route,
			new:  `route: {cluster: pd_original_dst, timeout: 0s, retry_policy: {retry_on: reset, retry_back_off: {base_interval: 0.0001s, max_interval: 0.0002s}}}`,
			want: [2]*RetryPolicy{{On: []string{"reset"}, NumRetries: 1, BaseInterval: time.Millisecond, MaxInterval: time.Millisecond}}},
		{name: "a max interval below the base", old: route,
			new: `route: {cluster: pd_original_dst, retry_policy: {retry_on: reset, retry_back_off: {base_interval: 1s, max_interval: 0.5s}}}`,
			err: "max_interval 500ms is below base_interval 1s"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if !strings.Contains(raw, tc.old) {
				t.Fatalf("envoy.yaml has no %q", tc.old)
			}
			cfg, err := LoadConfig(writeFile(t, strings.Replace(raw, tc.old, tc.new, 1)))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("LoadConfig error = %v, want one mentioning %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for i, want := range tc.want {
				if got := cfg.Routes[i].Retry; !reflect.DeepEqual(got, want) {
					t.Errorf("route %d: retry %+v, want %+v", i, got, want)
				}
			}
		})
	}
}

// TestLoadConfigRejects breaks envoy.yaml one way at a time: what Envoy
// refuses to load, LoadConfig refuses too.
func TestLoadConfigRejects(t *testing.T) {
	raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	tests := []struct {
		name, old, new, want string
	}{
		{"FULL_DUPLEX without request trailers", "request_trailer_mode: SEND", "request_trailer_mode: SKIP", "request_trailer_mode SEND"},
		{"FULL_DUPLEX without response trailers", "response_trailer_mode: SEND", "response_trailer_mode: SKIP", "response_trailer_mode SEND"},
		{"ORIGINAL_DST with round robin", "lb_policy: CLUSTER_PROVIDED", "lb_policy: ROUND_ROBIN", "CLUSTER_PROVIDED"},
		{"header name without use_http_header", "use_http_header: true", "use_http_header: false", "requires use_http_header"},
		{"unknown field", "failure_mode_allow: false", "failure_mode_alow: false", "failure_mode_alow"},
		{"message_timeout over the maximum", "message_timeout: 10s", "message_timeout: 7200s", "MessageTimeout"},
		{"a route's buffer limit", "route: {cluster: pd_original_dst, timeout: 0s}",
			"route: {cluster: pd_original_dst, timeout: 0s}\n                per_request_buffer_limit_bytes: 1024", "per_request_buffer_limit_bytes"},
		{"a virtual host's body buffer limit", "- name: inference\n              domains:",
			"- name: inference\n              request_body_buffer_limit: 1024\n              domains:", "request_body_buffer_limit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if !strings.Contains(raw, tc.old) {
				t.Fatalf("envoy.yaml has no %q to break", tc.old)
			}
			_, err := LoadConfig(writeFile(t, strings.Replace(raw, tc.old, tc.new, 1)))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("LoadConfig error = %v, want one mentioning %q", err, tc.want)
			}
		})
	}
}

// TestStartRejectsTweakedConfig: Start re-validates, so a test cannot run a
// combination Envoy would refuse.
func TestStartRejectsTweakedConfig(t *testing.T) {
	cfg := loadShipped(t, "envoy-buffered.yaml")
	cfg.Modes.Request.Body = extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	cfg.Modes.Request.Trailers = extprocfilterv3.ProcessingMode_SKIP
	if p, err := Start(cfg, "127.0.0.1:1"); err == nil {
		_ = p.Close()
		t.Fatal("Start accepted FULL_DUPLEX_STREAMED with request trailers skipped")
	}
}

// TestMutationRulesThatSteerTheRouterAreRefused: Envoy's router obeys the
// x-envoy-* request headers it strips from clients (x-envoy-retry-on,
// x-envoy-max-retries, x-envoy-upstream-rq-timeout-ms, ...) when a filter
// sets them; the emulator's router reads none, so mutation_rules that let the
// processor set one are refused (RetryStateImpl::create in
// source/common/router/retry_state_impl.cc, FilterUtility::finalTimeout in
// router.cc).
func TestMutationRulesThatSteerTheRouterAreRefused(t *testing.T) {
	tests := []struct {
		name   string
		rules  *mutationrulesv3.HeaderMutationRules
		prefix string // header_prefix; "" for x-envoy
		want   string // "" for accepted
	}{
		{name: "the default rules"},
		{name: "allow_envoy", rules: &mutationrulesv3.HeaderMutationRules{AllowEnvoy: wrapperspb.Bool(true)}, want: "x-envoy-retriable-status-codes"},
		{name: "allow_expression naming one", rules: &mutationrulesv3.HeaderMutationRules{AllowExpression: &matcherv3.RegexMatcher{Regex: "x-envoy-max-retries"}},
			want: "x-envoy-max-retries"},
		{name: "allow_envoy less the steering headers", rules: &mutationrulesv3.HeaderMutationRules{AllowEnvoy: wrapperspb.Bool(true),
			DisallowExpression: &matcherv3.RegexMatcher{Regex: "x-envoy-(retr.*|max-retries|upstream-.*|expected-rq-timeout-ms|force-trace|ip-tags|original-url|hedge-on-per-try-timeout)"}}},
		{name: "allow_expression naming one, under another header_prefix", prefix: "x-gw",
			rules: &mutationrulesv3.HeaderMutationRules{AllowExpression: &matcherv3.RegexMatcher{Regex: "x-envoy-max-retries"}}},
		{name: "allow_envoy under another header_prefix", prefix: "x-gw", rules: &mutationrulesv3.HeaderMutationRules{AllowEnvoy: wrapperspb.Bool(true)},
			want: "x-gw-retriable-status-codes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := loadShipped(t, "envoy.yaml")
			cfg.Mutations.Rules = tc.rules
			if tc.prefix != "" {
				cfg.Mutations.HeaderPrefix = tc.prefix
			}
			err := cfg.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("Validate: %v, want it accepted", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("Validate error = %v, want one naming %q", err, tc.want)
			}
		})
	}
}
