package handlers_test

import (
	"fmt"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// The decode endpoint is held from routing until the stream ends; a leaked hold
// would make least-loaded picking avoid an idle endpoint for good. Over gRPC,
// since it is the end of Process that gives it back.
func TestStreamEndReleasesTheDecodeEndpoint(t *testing.T) {
	post := func(body string) []*extprocv3.ProcessingRequest {
		return []*extprocv3.ProcessingRequest{
			envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(body))...), fullDuplex, fullDuplex),
			envoymsg.Body(envoymsg.Request, []byte(body), true),
		}
	}
	tests := []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
	}{
		{"routed with a body", post(clientChat)},
		{"routed from headers", []*extprocv3.ProcessingRequest{envoymsg.WithModes(
			envoymsg.Headers(envoymsg.Request, true, envoymsg.Header{":method", "GET"}, envoymsg.Header{":path", "/v1/models"}), fullDuplex, fullDuplex)}},
		{"rejected", post(`{}`)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefill := enginetest.Start(t, prefillOK)
			p := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, prefill.Addr()))
			exchange(t, startServer(t, handlers.NewServer(p, handlers.Options{}, logr.Discard())), tt.msgs...)
			prefillPool, decodePool := p.Pools()
			for _, pool := range []*scheduling.Pool{prefillPool, decodePool} {
				for _, e := range pool.Endpoints() {
					if n := e.InFlight(); n != 0 {
						t.Errorf("%s endpoint %s has %d requests in flight after the stream ended, want 0", pool.Name(), e.Addr, n)
					}
				}
			}
		})
	}
}
