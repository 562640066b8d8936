package handlers_test

import (
	"fmt"
	"net"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// The decode endpoint is held from routing until the stream ends; a leaked hold
// would make least-loaded picking avoid an idle endpoint for good.
func TestStreamEndReleasesTheDecodeEndpoint(t *testing.T) {
	tests := []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
	}{
		{"routed with a body", []*extprocv3.ProcessingRequest{postHeaders(fullDuplex, chatPath, clientChat), requestBody(clientChat, true)}},
		{"routed from headers", []*extprocv3.ProcessingRequest{requestHeaders(fullDuplex, true, hdr{":method", "GET"}, hdr{":path", "/v1/models"})}},
		{"rejected", []*extprocv3.ProcessingRequest{postHeaders(fullDuplex, chatPath, `{}`), requestBody(`{}`, true)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefill := enginetest.Start(t, prefillOK)
			p, err := pipeline.New(testConfig(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}`, prefill.Addr())), logr.Discard())
			if err != nil {
				t.Fatal(err)
			}
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			srv := grpc.NewServer()
			extprocv3.RegisterExternalProcessorServer(srv, handlers.NewServer(p, handlers.Options{}, logr.Discard()))
			go srv.Serve(lis)
			conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { conn.Close(); srv.Stop(); p.Wait() })

			exchange(t, extprocv3.NewExternalProcessorClient(conn), tt.msgs...)
			prefillPool, decodePool := p.Pools()
			for _, pool := range []*scheduling.Pool{prefillPool, decodePool} {
				for _, e := range pool.Endpoints() {
					if n := e.InFlight(); n != 0 {
						t.Errorf("%s endpoint %s has %d requests in flight after the stream ended, want 0", pool.Name, e.Addr, n)
					}
				}
			}
		})
	}
}
