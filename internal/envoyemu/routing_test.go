package envoyemu

import (
	"net/http"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// TestOriginalDst is §8.1 as the shipped envoy.yaml configures it: envoy.lb
// metadata first (only when received), then the header's first value;
// strict IP:port, else 503 "no healthy upstream" (in OpenAI's error JSON, §15).
func TestOriginalDst(t *testing.T) {
	a, b := startUpstream(t), startUpstream(t)
	list := func(vs ...string) *structpb.Struct {
		items := make([]any, len(vs))
		for i, v := range vs {
			items[i] = v
		}
		s, _ := structpb.NewStruct(map[string]any{"envoy.lb": map[string]any{"x-gateway-destination-endpoint": items}})
		return s
	}
	tests := []struct {
		name   string
		header string // x-gateway-destination-endpoint set by the server ("" = none)
		md     *structpb.Struct
		want   *upstream // nil = 503
	}{
		{name: "metadata only", md: lbMetadata("envoy.lb", a.addr), want: a},
		{name: "header only", header: a.addr, want: a},
		{name: "metadata wins over the header", header: b.addr, md: lbMetadata("envoy.lb", a.addr), want: a},
		{name: "metadata list: first element", md: list(b.addr, a.addr), want: b},
		{name: "invalid metadata falls through to the header", header: b.addr, md: lbMetadata("envoy.lb", "localhost:1"), want: b},
		{name: "metadata outside receiving_namespaces is dropped", md: lbMetadata("pd", a.addr)},
		{name: "comma-separated list in the header", header: a.addr + "," + b.addr},
		{name: "hostname in the header", header: "localhost:" + strings.Split(a.addr, ":")[1]},
		{name: "no port", header: "127.0.0.1"},
		{name: "nothing"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cr := &extprocv3.CommonResponse{}
			if tc.header != "" {
				cr = setHeaders(rawHeader("x-gateway-destination-endpoint", tc.header))
			}
			p := startProxy(t, loadShipped(t, "envoy.yaml"), fullDuplexRouter(cr, tc.md, nil))
			before := len(a.requests()) + len(b.requests())
			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
			if tc.want == nil {
				if want := envoyError(503, "no healthy upstream", "upstream_error"); res.status != http.StatusServiceUnavailable || res.body != want {
					t.Fatalf("response = %d %q, want 503 %q", res.status, res.body, want)
				}
				if len(p.Upstreams()) != 0 || len(a.requests())+len(b.requests()) != before {
					t.Fatalf("a request was forwarded: %v", p.Upstreams())
				}
				return
			}
			if res.status != http.StatusOK {
				t.Fatalf("status = %d %q", res.status, res.body)
			}
			if ups := p.Upstreams(); len(ups) != 1 || ups[0] != tc.want.addr {
				t.Fatalf("Upstreams() = %v, want [%s]", ups, tc.want.addr)
			}
		})
	}
}

// TestImmediateResponse is §4: status (<200 becomes 200), headers and body
// reach the client as given; nothing goes upstream.
func TestImmediateResponse(t *testing.T) {
	const errJSON = `{"error":{"message":"no capacity","type":"overloaded","code":429}}`
	tests := []struct {
		name       string
		onBody     bool // reply to the body instead of the headers
		code       typev3.StatusCode
		wantStatus int
	}{
		{"429 to the headers", false, typev3.StatusCode_TooManyRequests, 429},
		{"503 to a body chunk", true, typev3.StatusCode_ServiceUnavailable, 503},
		{"status below 200 becomes 200", false, typev3.StatusCode_Continue, 200},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up := startUpstream(t)
			p := startProxy(t, loadShipped(t, "envoy.yaml"), func(s *procStream) error {
				s.next()
				if tc.onBody {
					s.next()
				}
				s.reply(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
					Status:  &typev3.HttpStatus{Code: tc.code},
					Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{rawHeader("content-type", "application/json")}},
					Body:    []byte(errJSON),
					Details: "no capacity left",
				}}})
				<-s.Context().Done()
				return nil
			})
			res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, map[string]string{"x-gateway-destination-endpoint": up.addr})
			if res.status != tc.wantStatus || res.body != errJSON || res.header.Get("Content-Type") != "application/json" {
				t.Fatalf("response = %d %q %v", res.status, res.body, res.header)
			}
			if d := res.header.Get(DetailsHeader); d != "no_capacity_left" {
				t.Errorf("details = %q, want whitespace replaced by _", d)
			}
			if n := len(up.requests()); n != 0 {
				t.Errorf("upstream saw %d requests", n)
			}
		})
	}
}

// TestRouteTimeout: the route timeout (here short) ends a slow upstream
// with 504; envoy.yaml itself sets none (§5, envoy#35812).
func TestRouteTimeout(t *testing.T) {
	up := startUpstreamWith(t, func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
	})
	cfg := loadShipped(t, "envoy.yaml")
	for i := range cfg.Routes {
		cfg.Routes[i].Timeout = 100 * time.Millisecond
	}
	p := startProxy(t, cfg, fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil, nil))
	res := do(t, p, http.MethodPost, "/v1/completions", `{}`, nil)
	if want := envoyError(504, "upstream request timeout", "timeout_error"); res.status != http.StatusGatewayTimeout || res.body != want {
		t.Fatalf("response = %d %q, want 504 %q", res.status, res.body, want)
	}
}

// TestFullDuplexRoutingPoint is §2.11: in FULL_DUPLEX the LB uses what the
// headers reply set; metadata arriving with a later body reply is too late,
// even when the headers were still held.
func TestFullDuplexRoutingPoint(t *testing.T) {
	p, _ := startOnBody(t, func(s *procStream, upstream string, body []byte) error {
		s.reply(requestHeadersReply(&extprocv3.CommonResponse{}, nil))
		r := requestBodyReply(streamedMutation(body, true))
		r.DynamicMetadata = lbMetadata("envoy.lb", upstream)
		s.reply(r)
		passResponse(s)
		return nil
	})
	res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
	if res.status != http.StatusServiceUnavailable {
		t.Fatalf("status = %d %q, want 503: body-reply metadata must not route", res.status, res.body)
	}
}
