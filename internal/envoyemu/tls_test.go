package envoyemu

import (
	"crypto/tls"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tap/v3" // a transport socket the emulator refuses
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/pd-extproc/pd-extproc/internal/testpki"
)

// tlsBootstrap is a bootstrap whose ext_proc cluster has the transport
// socket given (YAML, indented for the cluster's keys).
func tlsBootstrap(t *testing.T, socket string) string {
	t.Helper()
	const tmpl = `static_resources:
  listeners:
  - name: inference
    address: {socket_address: {address: 0.0.0.0, port_value: 8080}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          route_config:
            virtual_hosts:
            - {name: all, domains: ["*"], routes: [{match: {prefix: /}, route: {cluster: pd_original_dst, timeout: 0s}}]}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: extproc}}
              processing_mode: {request_body_mode: FULL_DUPLEX_STREAMED, request_trailer_mode: SEND}
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: pd_original_dst
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config: {use_http_header: true}
  - name: extproc
    type: STRICT_DNS
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment: {cluster_name: extproc, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: extproc, port_value: 9002}}}}]}]}
`
	return writeFile(t, tmpl+socket)
}

const upstreamTLS = `    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: pd-extproc.pd-extproc.svc
`

// LoadConfig reads the ext_proc cluster's TLS settings as Envoy would, and
// refuses what Envoy refuses at load, or what the emulator does not model,
// rather than dialling plaintext.
func TestLoadConfigReadsTheExtProcClusterTLS(t *testing.T) {
	const certs = `        common_tls_context:
          tls_certificates:
          - certificate_chain: {filename: /etc/envoy/certs/tls.crt}
            private_key: {filename: /etc/envoy/certs/tls.key}
`
	const validation = `          validation_context:
            trusted_ca: {filename: /etc/envoy/certs/ca.crt}
            match_typed_subject_alt_names:
            - {san_type: DNS, matcher: {exact: pd-extproc.pd-extproc.svc}}
            - {san_type: URI, matcher: {prefix: "spiffe://pd-extproc/", ignore_case: true}}
`
	t.Run("as shipped: mTLS with the server's SAN checked", func(t *testing.T) {
		cfg, err := LoadConfig(tlsBootstrap(t, upstreamTLS+certs+validation+"          tls_params: {tls_maximum_protocol_version: TLSv1_3}\n"))
		if err != nil {
			t.Fatal(err)
		}
		got := cfg.Clusters[cfg.ExtProcCluster].TLS
		want := &UpstreamTLS{
			CertFile: "/etc/envoy/certs/tls.crt", KeyFile: "/etc/envoy/certs/tls.key", CAFile: "/etc/envoy/certs/ca.crt",
			SubjectAltNames: []SANMatcher{{Type: "DNS", Op: "exact", Value: "pd-extproc.pd-extproc.svc"}, {Type: "URI", Op: "prefix", Value: "spiffe://pd-extproc/", IgnoreCase: true}},
			SNI:             "pd-extproc.pd-extproc.svc", MaxVersion: tls.VersionTLS13,
		}
		if got == nil || got.CertFile != want.CertFile || got.KeyFile != want.KeyFile || got.CAFile != want.CAFile ||
			!slices.Equal(got.SubjectAltNames, want.SubjectAltNames) || got.SNI != want.SNI || got.MaxVersion != want.MaxVersion || got.MinVersion != 0 {
			t.Errorf("TLS = %+v, want %+v", got, want)
		}
	})
	refused := []struct{ name, socket, want string }{
		{"SAN checks without a trusted CA", upstreamTLS + `        common_tls_context:
          validation_context:
            match_typed_subject_alt_names: [{san_type: DNS, matcher: {exact: x}}]
`, "SAN-based verification of peer certificates without trusted CA is insecure and not allowed"},
		{"two client certificates", upstreamTLS + certs + `          - certificate_chain: {filename: /b.crt}
            private_key: {filename: /b.key}
`, "Multiple TLS certificates are not supported for client contexts"},
		{"a certificate without its key", upstreamTLS + `        common_tls_context:
          tls_certificates: [{certificate_chain: {filename: /a.crt}}]
`, "certificate_chain and private_key go together"},
		{"a CA given inline", upstreamTLS + `        common_tls_context:
          validation_context: {trusted_ca: {inline_string: "PEM"}}
`, "only a filename data source is emulated"},
		{"certificates by SDS from a server", upstreamTLS + `        common_tls_context:
          tls_certificate_sds_secret_configs: [{name: client, sds_config: {ads: {}}}]
`, "only sds_config.path_config_source (file-based SDS) is emulated"},
		{"certificates by SDS and from a file", upstreamTLS + certs + `          tls_certificate_sds_secret_configs:
          - {name: client, sds_config: {path_config_source: {path: /etc/envoy/sds/client-cert.yaml}}}
`, "Multiple TLS certificates are not supported for client contexts"},
		{"a CA in the default context and by SDS", upstreamTLS + `        common_tls_context:
          combined_validation_context:
            default_validation_context: {trusted_ca: {filename: /ca.crt}}
            validation_context_sds_secret_config: {name: ca, sds_config: {path_config_source: {path: /etc/envoy/sds/trusted-ca.yaml}}}
`, "a trusted_ca in both"},
		{"a SAN regex", upstreamTLS + `        common_tls_context:
          validation_context:
            trusted_ca: {filename: /ca.crt}
            match_typed_subject_alt_names: [{san_type: DNS, matcher: {safe_regex: {regex: ".*"}}}]
`, "safe_regex"},
		{"ALPN without h2", upstreamTLS + `        common_tls_context: {alpn_protocols: [http/1.1]}
`, "alpn_protocols without h2"},
		{"another transport socket", `    transport_socket:
      name: envoy.transport_sockets.tap
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tap.v3.Tap
        transport_socket: {name: raw, typed_config: {"@type": type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer}}
        common_config: {static_config: {output_config: {sinks: [{format: JSON_BODY_AS_STRING, file_per_tap: {path_prefix: /tmp/tap}}]}}}
`, "is not emulated"},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LoadConfig(tlsBootstrap(t, tc.socket))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("LoadConfig: %v; want a refusal naming %q", err, tc.want)
			}
		})
	}
}

// mtlsWorld is a CA, an ext_proc server certificate and an Envoy client
// certificate, as the shipped manifests name them.
type mtlsWorld struct {
	ca             *testpki.CA
	server, client testpki.Files
}

func newMTLSWorld(t *testing.T, serverSANs ...string) mtlsWorld {
	t.Helper()
	ca, err := testpki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	w := mtlsWorld{ca: ca}
	if w.server, err = ca.Issue(filepath.Join(dir, "server"), testpki.Leaf{Name: "extproc", SANs: serverSANs, Server: true}); err != nil {
		t.Fatal(err)
	}
	if w.client, err = ca.Issue(filepath.Join(dir, "client"), testpki.Leaf{Name: "envoy", SANs: []string{"envoy.pd-extproc"}, Client: true}); err != nil {
		t.Fatal(err)
	}
	return w
}

// startTLSExtProc is startExtProc over TLS with the world's server
// certificate, requiring a client certificate its CA signed; it counts the
// streams that reached the handler.
func startTLSExtProc(t *testing.T, w mtlsWorld, handle func(s *procStream) error) (string, *atomic.Int32) {
	t.Helper()
	var streams atomic.Int32
	addr, _ := serveTLS(t, w, "127.0.0.1:0", func(s *procStream) error {
		streams.Add(1)
		return handle(s)
	})
	return addr, &streams
}

// serveTLS serves ext_proc on addr over TLS with the world's server
// certificate, requiring a client certificate its CA signed, until stop or
// the end of the test.
func serveTLS(t *testing.T, w mtlsWorld, addr string, handle func(s *procStream) error) (string, func()) {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(w.server.Cert, w.server.Key)
	if err != nil {
		t.Fatal(err)
	}
	creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: w.ca.Roots(), ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(creds), grpc.WaitForHandlers(true))
	extprocv3.RegisterExternalProcessorServer(srv, &scriptedServer{t: t, handle: handle})
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	return ln.Addr().String(), srv.Stop
}

// The emulator speaks TLS to the ext_proc cluster from the cluster's
// settings, and fails closed (500, the request never reaches an engine) on
// a handshake Envoy would fail.
func TestExtProcOverMTLS(t *testing.T) {
	const san = "pd-extproc.pd-extproc.svc"
	tests := []struct {
		name       string
		serverSANs []string
		tls        func(w mtlsWorld, other testpki.Files) *UpstreamTLS
		routed     bool
	}{
		{"the server's SAN matches", []string{san}, func(w mtlsWorld, _ testpki.Files) *UpstreamTLS {
			return &UpstreamTLS{CertFile: w.client.Cert, KeyFile: w.client.Key, CAFile: w.client.CA, SubjectAltNames: []SANMatcher{{Type: "DNS", Op: "exact", Value: san}}}
		}, true},
		{"a wildcard SAN covers one label", []string{"*.pd-extproc.svc"}, func(w mtlsWorld, _ testpki.Files) *UpstreamTLS {
			return &UpstreamTLS{CertFile: w.client.Cert, KeyFile: w.client.Key, CAFile: w.client.CA, SubjectAltNames: []SANMatcher{{Type: "DNS", Op: "exact", Value: san}}}
		}, true},
		{"the server's SAN is another", []string{"other.pd-extproc.svc"}, func(w mtlsWorld, _ testpki.Files) *UpstreamTLS {
			return &UpstreamTLS{CertFile: w.client.Cert, KeyFile: w.client.Key, CAFile: w.client.CA, SubjectAltNames: []SANMatcher{{Type: "DNS", Op: "exact", Value: san}}}
		}, false},
		{"the server's CA is not trusted", []string{san}, func(w mtlsWorld, other testpki.Files) *UpstreamTLS {
			return &UpstreamTLS{CertFile: w.client.Cert, KeyFile: w.client.Key, CAFile: other.CA, SubjectAltNames: []SANMatcher{{Type: "DNS", Op: "exact", Value: san}}}
		}, false},
		{"no client certificate", []string{san}, func(w mtlsWorld, _ testpki.Files) *UpstreamTLS {
			return &UpstreamTLS{CAFile: w.client.CA, SubjectAltNames: []SANMatcher{{Type: "DNS", Op: "exact", Value: san}}}
		}, false},
		{"a client certificate of another CA", []string{san}, func(w mtlsWorld, other testpki.Files) *UpstreamTLS {
			return &UpstreamTLS{CertFile: other.Cert, KeyFile: other.Key, CAFile: w.client.CA}
		}, false},
		// Without a validation context Envoy checks nothing of the server: a
		// certificate with any name (or of any CA) is accepted.
		{"no validation context", []string{"anything"}, func(w mtlsWorld, _ testpki.Files) *UpstreamTLS {
			return &UpstreamTLS{CertFile: w.client.Cert, KeyFile: w.client.Key}
		}, true},
	}
	otherCA, err := testpki.NewCA("another CA")
	if err != nil {
		t.Fatal(err)
	}
	other, err := otherCA.Issue(t.TempDir(), testpki.Leaf{Name: "stranger", SANs: []string{"envoy.pd-extproc"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newMTLSWorld(t, tc.serverSANs...)
			up := startUpstream(t)
			addr, streams := startTLSExtProc(t, w, fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil, nil))
			cfg := loadShipped(t, "envoy.yaml")
			cfg.Clusters[cfg.ExtProcCluster].TLS = tc.tls(w, other)
			cfg.Logf = t.Logf
			p, err := Start(cfg, addr)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.Close() })
			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
			if tc.routed {
				if res.status != http.StatusOK || len(up.requests()) != 1 {
					t.Fatalf("response %d %q (%s), %d upstream requests; want 200 through the engine", res.status, res.body, res.header.Get(DetailsHeader), len(up.requests()))
				}
				return
			}
			details := res.header.Get(DetailsHeader)
			if res.status != http.StatusInternalServerError || !strings.HasPrefix(details, "ext_proc_error_gRPC_error_14") {
				t.Errorf("response %d (%s), want 500 with ext_proc_error_gRPC_error_14 (UNAVAILABLE)", res.status, details)
			}
			if n := len(up.requests()); n != 0 || streams.Load() != 0 {
				t.Errorf("%d upstream requests and %d ext_proc streams; a refused handshake must reach neither", n, streams.Load())
			}
		})
	}
}

// A certificate file Envoy cannot read refuses the config: Start fails.
func TestStartRefusesUnreadableCertificates(t *testing.T) {
	w := newMTLSWorld(t, "x")
	for name, tc := range map[string]*UpstreamTLS{
		"missing client certificate": {CertFile: filepath.Join(t.TempDir(), "none.crt"), KeyFile: w.client.Key},
		"key of another certificate": {CertFile: w.client.Cert, KeyFile: w.server.Key},
		"missing CA":                 {CAFile: filepath.Join(t.TempDir(), "none.crt")},
		"a CA file with no PEM":      {CAFile: w.client.Key},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := loadShipped(t, "envoy.yaml")
			cfg.Clusters[cfg.ExtProcCluster].TLS = tc
			if p, err := Start(cfg, "127.0.0.1:1"); err == nil {
				p.Close()
				t.Fatal("Start accepted it")
			}
		})
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func writeFile(t *testing.T, data string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "envoy.yaml")
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
