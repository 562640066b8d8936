// Package envoyapi checks the shipped Envoy configs against the API of Envoy v1.39, the release
// the compose file and the chart run (Envoy Gateway v1.9.1's). test/deploy validates them with
// the main module's protos (go-control-plane envoy v1.40.0), which a field new in 1.40 would pass
// while v1.39 refuses the bootstrap; here every field must be one v1.39 knows.
package envoyapi

import (
	"os"
	"path/filepath"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/yaml"

	// The extensions the shipped configs name in typed_config: protojson resolves each "@type"
	// through the types linked in, and reads the fields inside it strictly.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/filters/cel/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
)

// validatable is what protoc-gen-validate generates.
type validatable interface{ ValidateAll() error }

func TestShippedConfigsSpeakEnvoy139(t *testing.T) {
	tests := []struct {
		glob string
		msg  func() proto.Message
	}{
		{filepath.Join("..", "..", "config", "envoy", "envoy*.yaml"), func() proto.Message { return &bootstrapv3.Bootstrap{} }},
		{filepath.Join("..", "..", "config", "envoy", "sds", "*.yaml"), func() proto.Message { return &discoveryv3.DiscoveryResponse{} }},
	}
	seen := 0
	for _, tc := range tests {
		paths, err := filepath.Glob(tc.glob)
		if err != nil || len(paths) == 0 {
			t.Fatalf("no files match %s: %v", tc.glob, err)
		}
		for _, path := range paths {
			seen++
			t.Run(filepath.Base(path), func(t *testing.T) {
				raw, err := os.ReadFile(path)
				if err != nil {
					t.Fatal(err)
				}
				js, err := yaml.YAMLToJSON(raw)
				if err != nil {
					t.Fatal(err)
				}
				m := tc.msg()
				if err := protojson.Unmarshal(js, m); err != nil {
					t.Fatalf("Envoy v1.39's API refuses it: %v", err)
				}
				if err := m.(validatable).ValidateAll(); err != nil {
					t.Errorf("Envoy v1.39's constraints refuse it: %v", err)
				}
				if dr, ok := m.(*discoveryv3.DiscoveryResponse); ok {
					for _, r := range dr.GetResources() {
						var s tlsv3.Secret
						if err := r.UnmarshalTo(&s); err != nil {
							t.Fatal(err)
						}
						if err := s.ValidateAll(); err != nil {
							t.Errorf("secret %s: %v", s.GetName(), err)
						}
					}
				}
			})
		}
	}
	if seen < 5 {
		t.Errorf("checked %d files; want the three bootstraps and the two SDS files", seen)
	}
}
