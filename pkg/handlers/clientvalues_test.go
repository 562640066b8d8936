package handlers_test

// Values a client controls that must not steer the engines or blame them:
// headers only a router may set, request ids.

import (
	"fmt"
	"net/http"
	"slices"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"

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
// Authorization and none of them.
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
		hs := envoymsg.Post(chatPath, len(clientChat), append(slices.Clone(steeringHeaders), envoymsg.Header{"authorization", "Bearer k"})...)
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
				if got := leg.Get("Authorization"); got != "Bearer k" {
					t.Errorf("the prefill leg's Authorization = %q, want the client's", got)
				}
			})
		}
	}
}
