package envoyemu

import (
	"cmp"
	"fmt"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

// With use_remote_address the connection manager appends its peer's IP to
// x-forwarded-for, or, when the peer is 127.0.0.1 or ::1 exactly, the node's
// own address (Network::Utility::getLocalAddress: the first non-loopback
// IPv4 address of the host); and, with no trusted hop, it overwrites the
// client's x-forwarded-proto with the connection's scheme. Without it both
// pass as the client sent them, x-forwarded-proto added when absent
// (mutateRequestHeaders in source/common/http/conn_manager_utility.cc). The
// processor sees them as the engine does; with preserve_external_request_id
// the client's x-request-id reaches both as it came.
func TestForwardedHeadersAtTheEdge(t *testing.T) {
	on := ClientHeaders{UseRemoteAddress: true, PreserveExternalRequestID: true}
	node := envoyNodeAddress(t)
	tests := []struct {
		name     string
		headers  ClientHeaders
		peer     string            // the client's source IP
		sent     map[string]string // the client's headers
		xff, xfp string            // what the processor and the engine get; "" for none
	}{
		{name: "off: the client's headers as they came", peer: "127.0.0.5",
			sent: map[string]string{"x-forwarded-for": "10.9.9.9", "x-forwarded-proto": "https"}, xff: "10.9.9.9", xfp: "https"},
		{name: "off, none sent: x-forwarded-proto added", peer: "127.0.0.5", xfp: "http"},
		{name: "on: the peer appended", headers: on, peer: "127.0.0.5",
			sent: map[string]string{"x-forwarded-for": "10.9.9.9"}, xff: "10.9.9.9,127.0.0.5", xfp: "http"},
		{name: "on, none sent: the peer alone", headers: on, peer: "127.0.0.5", xff: "127.0.0.5", xfp: "http"},
		{name: "on, peer 127.0.0.1: the node's address appended", headers: on, peer: "127.0.0.1",
			sent: map[string]string{"x-forwarded-for": "10.9.9.9"}, xff: "10.9.9.9," + node, xfp: "http"},
		{name: "on: the client's x-forwarded-proto overwritten", headers: on, peer: "127.0.0.5",
			sent: map[string]string{"x-forwarded-proto": "https"}, xff: "127.0.0.5", xfp: "http"},
		{name: "on with skip_xff_append", headers: ClientHeaders{UseRemoteAddress: true, PreserveExternalRequestID: true, SkipXFFAppend: true},
			peer: "127.0.0.1", sent: map[string]string{"x-forwarded-for": "10.9.9.9", "x-forwarded-proto": "https"}, xff: "10.9.9.9", xfp: "http"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := startUpstream(t)
			cfg := loadShipped(t, "envoy.yaml")
			cfg.ClientHeaders = tc.headers
			p, seen := startPassingProxy(t, cfg, up)
			sent := map[string]string{"x-request-id": "client-id-1"}
			maps.Copy(sent, tc.sent)
			if res := doFrom(t, p, tc.peer, http.MethodPost, "/v1/completions", `{"model":"m"}`, sent); res.status != http.StatusOK {
				t.Fatalf("status %d: %s", res.status, res.body)
			}
			for who, got := range map[string]http.Header{"the processor": <-seen, "the engine": up.requests()[0].Header} {
				for key, want := range map[string]string{"X-Forwarded-For": tc.xff, "X-Forwarded-Proto": tc.xfp, "X-Request-Id": "client-id-1"} {
					if v := got.Values(key); !slices.Equal(v, nonEmpty(want)) {
						t.Errorf("%s got %s %q, want %q", who, key, v, want)
					}
				}
			}
		})
	}
}

func nonEmpty(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}

// envoyNodeAddress is the address Envoy's getLocalAddress(v4) finds: the
// first IPv4 interface address other than 127.0.0.1, else 127.0.0.1.
func envoyNodeAddress(t *testing.T) string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.Equal(net.IPv4(127, 0, 0, 1)) {
			return ipn.IP.String()
		}
	}
	t.Log("no IPv4 address but 127.0.0.1: the loopback row cannot tell the node from the peer")
	return "127.0.0.1"
}

// Envoy would replace an external request's id with use_remote_address and
// without preserve_external_request_id, by rules the emulator does not
// model: the combination is refused.
func TestUseRemoteAddressWithoutPreservedRequestIDIsRefused(t *testing.T) {
	path := tlsBootstrap(t, "")
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ClientHeaders != (ClientHeaders{}) {
		t.Fatalf("ClientHeaders = %+v for a bootstrap that sets none", cfg.ClientHeaders)
	}
	yaml := strings.Replace(readFile(t, path), "stat_prefix: inference", "stat_prefix: inference\n          use_remote_address: true", 1)
	if _, err := LoadConfig(writeFile(t, yaml)); err == nil || !strings.Contains(err.Error(), "preserve_external_request_id") {
		t.Errorf("LoadConfig: %v; want a refusal naming preserve_external_request_id", err)
	}
	yaml = strings.Replace(yaml, "use_remote_address: true", "use_remote_address: true\n          preserve_external_request_id: true", 1)
	cfg, err = LoadConfig(writeFile(t, yaml))
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.ClientHeaders.UseRemoteAddress || !cfg.ClientHeaders.PreserveExternalRequestID {
		t.Errorf("ClientHeaders = %+v, want both read", cfg.ClientHeaders)
	}
}

// Without internal_address_config (refused at load) Envoy 1.33 and later
// deems every request external, and the connection manager removes the
// client's x-envoy-* headers that steer Envoy before any filter runs
// (cleanInternalHeaders in conn_manager_utility.cc); with use_remote_address
// the request is an edge one and three more go. So x-envoy-retry-on and its
// companions neither reach the engine nor make the router retry.
func TestExternalRequestsLoseEnvoysSteeringHeaders(t *testing.T) {
	removed := []string{"retry-on", "retry-grpc-on", "max-retries", "retriable-status-codes", "retriable-header-names",
		"upstream-rq-timeout-ms", "upstream-rq-per-try-timeout-ms", "upstream-rq-timeout-alt-response",
		"expected-rq-timeout-ms", "hedge-on-per-try-timeout", "upstream-alt-stat-name", "force-trace",
		"ip-tags", "original-url", "internal"}
	edgeOnly := []string{"decorator-operation", "downstream-service-cluster", "downstream-service-node"}
	values := map[string]string{"retry-on": "5xx", "max-retries": "3", "retriable-status-codes": "503",
		"upstream-rq-timeout-ms": "60000", "expected-rq-timeout-ms": "60000", "internal": "true"}
	tests := []struct {
		name string
		edge bool // use_remote_address
	}{
		{name: "an edge request (use_remote_address)", edge: true},
		{name: "an external request without use_remote_address"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := failingFirst(t, 1)
			p := retryProxy(t, nil, false, up.addr, func(cfg *Config) {
				cfg.ClientHeaders = ClientHeaders{UseRemoteAddress: tc.edge, PreserveExternalRequestID: tc.edge}
			})
			p.hooks.backoff = func(time.Duration) time.Duration { return 0 }
			hdr := map[string]string{"x-envoy-custom": "kept"}
			for _, n := range append(removed, edgeOnly...) {
				hdr["x-envoy-"+n] = cmp.Or(values[n], "v")
			}
			if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, hdr); res.status != http.StatusServiceUnavailable {
				t.Errorf("status %d %q, want the engine's 503 unretried", res.status, res.body)
			}
			got := up.requests()
			if len(got) != 1 {
				t.Fatalf("%d attempts, want 1: x-envoy-retry-on is not the client's to set", len(got))
			}
			for _, n := range removed {
				if v, ok := got[0].Header[http.CanonicalHeaderKey("x-envoy-"+n)]; ok {
					t.Errorf("the engine got x-envoy-%s: %q; Envoy removes it", n, v)
				}
			}
			for _, n := range edgeOnly {
				if _, ok := got[0].Header[http.CanonicalHeaderKey("x-envoy-"+n)]; ok == tc.edge {
					t.Errorf("x-envoy-%s reached the engine: %v, want %v", n, ok, !tc.edge)
				}
			}
			if v := got[0].Header.Get("X-Envoy-Custom"); v != "kept" {
				t.Errorf("x-envoy-custom = %q, want the client's", v)
			}
		})
	}
}

// The router tells the upstream the route timeout in
// x-envoy-expected-rq-timeout-ms unless suppress_envoy_headers is set
// (FilterUtility::finalTimeout and setTimeoutHeaders in router.cc).
func TestExpectedTimeoutHeaderFollowsSuppressEnvoyHeaders(t *testing.T) {
	tests := []struct {
		suppress bool
		want     []string
	}{
		{suppress: false, want: []string{"30000"}},
		{suppress: true},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprint("suppress_envoy_headers ", tc.suppress), func(t *testing.T) {
			up := startUpstream(t)
			p := retryProxy(t, nil, false, up.addr, func(cfg *Config) {
				cfg.SuppressEnvoyHeaders = tc.suppress
				for i := range cfg.Routes {
					cfg.Routes[i].Timeout = 30 * time.Second
				}
			})
			if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil); res.status != http.StatusOK {
				t.Fatalf("status %d: %s", res.status, res.body)
			}
			if got := up.requests()[0].Header["X-Envoy-Expected-Rq-Timeout-Ms"]; !slices.Equal(got, tc.want) {
				t.Errorf("x-envoy-expected-rq-timeout-ms = %q, want %q", got, tc.want)
			}
		})
	}
}

// With use_remote_address the connection manager deems every request
// external (Envoy 1.33 and later, without internal_address_config) and an
// edge request, and sets x-envoy-external-address (after the bootstrap's
// header_prefix) to its peer's IP, over any value the client sent; without
// it the client's value passes (mutateRequestHeaders in
// source/common/http/conn_manager_utility.cc). The processor sees it as the
// engine does.
func TestExternalAddressIsThePeers(t *testing.T) {
	on := ClientHeaders{UseRemoteAddress: true, PreserveExternalRequestID: true}
	tests := []struct {
		name    string
		headers ClientHeaders
		prefix  string            // header_prefix; "" for x-envoy
		sent    map[string]string // the client's headers
		want    string            // the header's value at the processor and the engine, "" for none
	}{
		{name: "on: the peer's IP", headers: on, want: "127.0.0.5"},
		{name: "on: the client's value replaced", headers: on,
			sent: map[string]string{"x-envoy-external-address": "203.0.113.9", "x-forwarded-for": "198.51.100.7"}, want: "127.0.0.5"},
		{name: "on, with a header_prefix", headers: on, prefix: "x-gw", want: "127.0.0.5"},
		{name: "off: none of Envoy's"},
		{name: "off: the client's value passes", sent: map[string]string{"x-envoy-external-address": "203.0.113.9"}, want: "203.0.113.9"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			key := cmp.Or(tc.prefix, "x-envoy") + "-external-address"
			up := startUpstream(t)
			cfg := loadShipped(t, "envoy.yaml")
			cfg.ClientHeaders = tc.headers
			if tc.prefix != "" {
				cfg.Mutations.HeaderPrefix = tc.prefix
			}
			p, seen := startPassingProxy(t, cfg, up)
			if res := doFrom(t, p, "127.0.0.5", http.MethodPost, "/v1/completions", `{"model":"m"}`, tc.sent); res.status != http.StatusOK {
				t.Fatalf("status %d: %s", res.status, res.body)
			}
			want := nonEmpty(tc.want)
			if got := (<-seen).Values(key); !slices.Equal(got, want) {
				t.Errorf("the processor saw %s %q, want %q", key, got, want)
			}
			if got := up.requests()[0].Header.Values(key); !slices.Equal(got, want) {
				t.Errorf("the engine got %s %q, want %q", key, got, want)
			}
		})
	}
}

// startPassingProxy starts the emulator with cfg and a processor that sends
// every request, unchanged, to the upstream up, and hands each request's
// headers as it saw them to seen.
func startPassingProxy(t *testing.T, cfg *Config, up *upstream) (*Proxy, chan http.Header) {
	seen := make(chan http.Header, 1)
	p := startProxy(t, cfg, func(s *procStream) error {
		h := http.Header{}
		for _, e := range s.next().GetRequestHeaders().GetHeaders().GetHeaders() {
			h.Add(e.GetKey(), string(e.GetRawValue()))
		}
		seen <- h
		body, _, ok := readRequestBody(s)
		if !ok {
			return nil
		}
		s.reply(requestHeadersReply(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil))
		s.reply(requestBodyReply(streamedMutation(body, true)))
		passResponse(s)
		return nil
	})
	return p, seen
}
