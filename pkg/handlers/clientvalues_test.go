package handlers_test

// Values a client controls that must not steer the engines or blame them:
// headers only a router may set, request ids.

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/google/uuid"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// steeringHeaders are what a client would send to steer the engines past the
// service: SGLang's x-override-* family and both engines' data-parallel rank.
var steeringHeaders = []envoymsg.Header{
	{"x-override-bootstrap-host", "203.0.113.9"}, {"x-override-bootstrap-port", "1"}, {"x-override-bootstrap-room", "7"},
	{"x-override-routed-dp-rank", "3"}, {"x-override-disagg-prefill-dp-rank", "3"}, {"x-override-rid", "r"},
	{"x-data-parallel-rank", "0"},
}

// The decode leg is the request Envoy forwards: the routing reply removes the
// headers the connector's engines would be steered by, in every body mode and
// without a body. The prefill leg is ours: it carries the client's
// Authorization, and the headers vLLM reads for the request's scheduling
// (X-Vllm-Priority, X-Session-ID: they reach the decode leg with Envoy's
// request), and none of them.
func TestHeadersThatSteerTheEnginesReachNeither(t *testing.T) {
	tests := []struct {
		connector   string
		answer      http.HandlerFunc
		wantRemoved []string // the reply removes at least these
	}{
		{"kv-nixl", prefillOK, []string{"x-data-parallel-rank"}},
		{"kv-sglang", enginetest.JSON(200, `{}`), []string{"x-data-parallel-rank", "x-override-bootstrap-host", "x-override-bootstrap-port",
			"x-override-bootstrap-room", "x-override-routed-dp-rank", "x-override-disagg-prefill-dp-rank", "x-override-rid"}},
	}
	post := func(mode string) []*extprocv3.ProcessingRequest {
		hs := envoymsg.Post(chatPath, len(clientChat), append(slices.Clone(steeringHeaders), envoymsg.Header{"authorization", "Bearer k"},
			envoymsg.Header{"x-vllm-priority", "-5"}, envoymsg.Header{"x-session-id", "s1"}, envoymsg.Header{"x-team", "a"})...)
		if mode == "bodiless" {
			hs = append([]envoymsg.Header{{":method", "GET"}, {":path", "/v1/models"}}, steeringHeaders...)
			return []*extprocv3.ProcessingRequest{envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, true, hs...), fullDuplex, fullDuplex)}
		}
		body := buffered
		if mode == "full_duplex" {
			body = fullDuplex
		}
		return []*extprocv3.ProcessingRequest{
			envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, hs...), body, fullDuplex),
			envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
		}
	}
	for _, tt := range tests {
		for _, mode := range []string{"full_duplex", "buffered", "bodiless"} {
			t.Run(tt.connector+"/"+mode, func(t *testing.T) {
				prefill := enginetest.Start(t, tt.answer)
				p := newPipeline(t, fmt.Sprintf("connector: %s\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
					tt.connector, prefill.Addr(), fakeEndpoint))
				replies := drive(t, handlers.NewServer(p, handlers.Options{}, logr.Discard()), post(mode)...)

				routing := replies[0].GetRequestHeaders().GetResponse().GetHeaderMutation()
				if mode == "buffered" {
					routing = replies[1].GetRequestBody().GetResponse().GetHeaderMutation()
				}
				if got, _ := headerValue(routing, "x-gateway-destination-endpoint"); got != fakeEndpoint {
					t.Fatalf("not routed: %v", replies)
				}
				for _, h := range tt.wantRemoved {
					if !slices.Contains(routing.GetRemoveHeaders(), h) {
						t.Errorf("the routing reply does not remove %s (removes %v)", h, routing.GetRemoveHeaders())
					}
				}
				if mode == "bodiless" {
					return
				}
				prefill.Await(t)
				leg := prefill.Requests()[0].Header
				for _, h := range steeringHeaders {
					if v := leg.Get(h[0]); v != "" {
						t.Errorf("the prefill leg carries the client's %s: %q", h[0], v)
					}
				}
				for h, want := range map[string]string{"Authorization": "Bearer k", "X-Vllm-Priority": "-5", "X-Session-Id": "s1", "X-Team": ""} {
					if got := leg.Get(h); got != want {
						t.Errorf("the prefill leg's %s = %q, want %q", h, got, want)
					}
				}
			})
		}
	}
}

// A client's x-request-id is kept only when it is 1 to 128 bytes of
// [A-Za-z0-9._:-]; any other is replaced by a new UUID, said at -v 1. Both
// legs carry the id the service settled on, and the prefill endpoint stays
// healthy whatever the client sent (a control byte would make Go's client
// refuse the leg, once blamed on the endpoint).
func TestClientRequestIDsAreKeptOnlyWhenSafe(t *testing.T) {
	tests := []struct {
		name, id string
		kept     bool
	}{
		{"a UUID", "0b0c7a9e-1f2d-4000-8000-000000000001", true},
		{"every allowed byte", "Az09._:-", true},
		{"128 bytes", strings.Repeat("a", 128), true},
		{"129 bytes", strings.Repeat("a", 129), false},
		{"50,000 bytes", strings.Repeat("a", 50000), false},
		{"NUL", "r\x00", false},
		{"SOH", "r\x01", false},
		{"DEL", "r\x7f", false},
		{"right-to-left override", "a\u202eb", false},
		{"a quote", `a"b`, false},
		{"a space", "a b", false},
		{"a slash", "a/b", false},
	}
	prefill := enginetest.Start(t, prefillOK)
	p := newPipeline(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}", prefill.Addr(), fakeEndpoint))
	var mu sync.Mutex
	replaced := 0 // log lines that say an id was replaced
	s := handlers.NewServer(p, handlers.Options{}, funcr.New(func(_, args string) {
		mu.Lock()
		defer mu.Unlock()
		if strings.Contains(args, "replacing the client's x-request-id") {
			replaced++
		}
	}, funcr.Options{Verbosity: 1}))
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mu.Lock()
			before := replaced
			mu.Unlock()
			replies := drive(t, s,
				envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false,
					envoymsg.Post(chatPath, len(clientChat), envoymsg.Header{"x-request-id", tt.id})...), fullDuplex, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(clientChat), true))
			got, _ := headerValue(replies[0].GetRequestHeaders().GetResponse().GetHeaderMutation(), "x-request-id")
			switch {
			case tt.kept && got != tt.id:
				t.Errorf("x-request-id = %.40q, want the client's", got)
			case !tt.kept && uuid.Validate(got) != nil:
				t.Errorf("x-request-id = %.40q, want a new UUID in place of %.40q", got, tt.id)
			}
			prefill.Await(t)
			reqs := prefill.Requests()
			if leg := reqs[len(reqs)-1].Header.Get("X-Request-Id"); leg != got {
				t.Errorf("the prefill leg's X-Request-Id = %.40q, want the decode leg's %.40q", leg, got)
			}
			mu.Lock()
			n := replaced - before
			mu.Unlock()
			if want := map[bool]int{true: 0, false: 1}[tt.kept]; n != want {
				t.Errorf("%d lines say the id was replaced, want %d", n, want)
			}
		})
	}
	prefillPool, _ := p.Pools()
	if !prefillPool.Endpoints()[0].Healthy() {
		t.Error("the prefill endpoint was ejected by the clients' request ids")
	}
}
