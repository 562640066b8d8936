package envoyemu

import (
	"net/http"
	"strings"
	"testing"

	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// TestHeaderMutations is §3.2–3.3 as the engine sees it: raw_value only,
// append bool only, the default rules table, ":"/host never removed.
func TestHeaderMutations(t *testing.T) {
	tests := []struct {
		name    string
		rules   *mutationrulesv3.HeaderMutationRules
		set     []*corev3.HeaderValueOption
		remove  []string
		check   func(t *testing.T, r seenRequest)
		wantErr string // non-empty: 500 whose details contain this
	}{
		{
			name: "value without raw_value becomes empty (envoy#31555)",
			set:  []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "x-model", Value: "llama"}}},
			check: func(t *testing.T, r seenRequest) {
				if v, ok := r.Header["X-Model"]; !ok || v[0] != "" {
					t.Errorf("x-model = %q, want present and empty", v)
				}
			},
		},
		{
			name: "append true adds a value",
			set:  []*corev3.HeaderValueOption{appendHeader("x-custom", "two")},
			check: func(t *testing.T, r seenRequest) {
				if v := r.Header.Values("X-Custom"); len(v) != 2 || v[0] != "one" || v[1] != "two" {
					t.Errorf("x-custom = %q, want [one two]", v)
				}
			},
		},
		{
			name: "append_action is ignored: overwrite",
			set: []*corev3.HeaderValueOption{{
				Header:       &corev3.HeaderValue{Key: "x-custom", RawValue: []byte("two")},
				AppendAction: corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD,
			}},
			check: func(t *testing.T, r seenRequest) {
				if v := r.Header.Values("X-Custom"); len(v) != 1 || v[0] != "two" {
					t.Errorf("x-custom = %q, want [two]", v)
				}
			},
		},
		{
			name: "routing and x-envoy headers are silently refused, :path is allowed",
			set: []*corev3.HeaderValueOption{
				rawHeader(":authority", "evil.example"), rawHeader("host", "evil.example"),
				rawHeader("x-envoy-debug", "1"), rawHeader(":path", "/v1/rewritten"),
			},
			remove: []string{":path", "host", "x-custom"},
			check: func(t *testing.T, r seenRequest) {
				if strings.Contains(r.Host, "evil") || r.Header.Get("X-Envoy-Debug") != "" {
					t.Errorf("host %q, x-envoy-debug %q: disallowed mutations applied", r.Host, r.Header.Get("X-Envoy-Debug"))
				}
				if r.Path != "/v1/rewritten" {
					t.Errorf("path = %q, want /v1/rewritten", r.Path)
				}
				if r.Header.Get("X-Custom") != "" {
					t.Errorf("x-custom not removed")
				}
			},
		},
		{
			name:    "disallow_is_error turns a refused mutation into a 500",
			rules:   &mutationrulesv3.HeaderMutationRules{DisallowIsError: wrapperspb.Bool(true)},
			set:     []*corev3.HeaderValueOption{rawHeader(":authority", "evil.example")},
			wantErr: "Invalid attempt to modify :authority",
		},
		{
			// Checker::isAllowed refuses removing ":" headers and host "no matter
			// what", so disallow_is_error fails the stream on it too.
			name:    "disallow_is_error: removing a pseudo-header is a 500",
			rules:   &mutationrulesv3.HeaderMutationRules{DisallowIsError: wrapperspb.Bool(true)},
			remove:  []string{":path"},
			wantErr: "Invalid attempt to remove :path",
		},
		{
			name:    "disallow_is_error: removing host is a 500, even where allow_expression names it",
			rules:   &mutationrulesv3.HeaderMutationRules{DisallowIsError: wrapperspb.Bool(true), AllowExpression: &matcherv3.RegexMatcher{Regex: "host"}},
			remove:  []string{"host"},
			wantErr: "Invalid attempt to remove host",
		},
		{
			name:    "CR/LF in a value",
			set:     []*corev3.HeaderValueOption{rawHeader("x-bad", "a\r\nb")},
			wantErr: "Invalid character in set_headers mutation",
		},
		{
			name:    "value and raw_value both set",
			set:     []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "x-a", Value: "1", RawValue: []byte("1")}}},
			wantErr: "Only one of value or raw_value",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := startUpstream(t)
			cfg := loadShipped(t, "envoy-buffered.yaml")
			cfg.Mutations.Rules = tc.rules
			p := startProxy(t, cfg, func(s *procStream) error {
				s.next()
				set := append([]*corev3.HeaderValueOption{rawHeader("x-gateway-destination-endpoint", up.addr)}, tc.set...)
				s.reply(requestHeadersReply(&extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
					SetHeaders: set, RemoveHeaders: tc.remove,
				}}, nil))
				if s.next() == nil {
					return nil
				}
				s.reply(requestBodyReply(&extprocv3.CommonResponse{}))
				passResponse(s)
				return nil
			})
			res := do(t, p, http.MethodPost, "/v1/completions", `{}`, map[string]string{"X-Custom": "one"})
			if tc.wantErr != "" {
				if res.status != http.StatusInternalServerError || !strings.Contains(res.header.Get(DetailsHeader), tc.wantErr) {
					t.Fatalf("response = %d (%s), want 500 mentioning %q", res.status, res.header.Get(DetailsHeader), tc.wantErr)
				}
				return
			}
			if res.status != http.StatusOK {
				t.Fatalf("status = %d %q (%s)", res.status, res.body, res.header.Get(DetailsHeader))
			}
			reqs := up.requests()
			if len(reqs) != 1 {
				t.Fatalf("upstream saw %d requests", len(reqs))
			}
			tc.check(t, reqs[0])
		})
	}
}

// TestDynamicMetadataForwarding: forwarding namespaces ride on every message
// (§1.4), receiving namespaces are kept (§3.7) and visible on later messages.
func TestDynamicMetadataForwarding(t *testing.T) {
	up := startUpstream(t)
	cfg := loadShipped(t, "envoy-buffered.yaml")
	cfg.Metadata.ForwardingNamespaces = []string{"envoy.lb", "pd"}
	cfg.Metadata.ReceivingNamespaces = []string{"envoy.lb"}
	cfg.Metadata.Initial = map[string]*structpb.Struct{"pd": lbMetadata("x", "hint").GetFields()["x"].GetStructValue()}
	seen := make(chan *corev3.Metadata, 2)
	p := startProxy(t, cfg, func(s *procStream) error {
		m := s.next()
		seen <- m.GetMetadataContext()
		md := lbMetadata("envoy.lb", up.addr)
		md.Fields["pd"] = lbMetadata("pd", "dropped").Fields["pd"] // not a receiving namespace
		s.reply(requestHeadersReply(&extprocv3.CommonResponse{}, md))
		m = s.next()
		seen <- m.GetMetadataContext()
		s.reply(requestBodyReply(&extprocv3.CommonResponse{}))
		passResponse(s)
		return nil
	})
	if res := do(t, p, http.MethodPost, "/v1/completions", `{}`, nil); res.status != http.StatusOK {
		t.Fatalf("status = %d %q", res.status, res.body)
	}
	first, second := <-seen, <-seen
	if got := first.GetFilterMetadata()["pd"].GetFields()["x-gateway-destination-endpoint"].GetStringValue(); got != "hint" {
		t.Errorf("first message pd metadata = %v", first)
	}
	if _, ok := first.GetFilterMetadata()["envoy.lb"]; ok {
		t.Errorf("first message already has envoy.lb: %v", first)
	}
	if got := second.GetFilterMetadata()["envoy.lb"].GetFields()["x-gateway-destination-endpoint"].GetStringValue(); got != up.addr {
		t.Errorf("body message envoy.lb = %v, want the received value", second)
	}
	if got := second.GetFilterMetadata()["pd"].GetFields()["x-gateway-destination-endpoint"].GetStringValue(); got != "hint" {
		t.Errorf("pd metadata changed to %q: a non-receiving namespace was applied", got)
	}
	if ups := p.Upstreams(); len(ups) != 1 || ups[0] != up.addr {
		t.Errorf("Upstreams() = %v: the received envoy.lb metadata should route", ups)
	}
}
