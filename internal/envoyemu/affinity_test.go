package envoyemu

import (
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	"google.golang.org/grpc/metadata"
)

// TestExtProcSessionAffinity: with the shipped envoy.yaml, a stream carries
// the client's x-session-id as gRPC metadata, and the extproc cluster's ring
// hash sends every stream of one session to one replica; streams without the
// header, or a cluster without a hash load balancer, go in turn (§14).
func TestExtProcSessionAffinity(t *testing.T) {
	// Sessions prime to endpoints, so that in turn a session moves; and many,
	// so that hashed they all meet on one replica with a chance of 3^-15.
	const endpoints, sessions, perSession = 3, 16, 3
	tests := []struct {
		name     string
		lb       clusterv3.Cluster_LbPolicy
		sessions bool // the requests name a session
		pinned   bool // want each session's streams on one replica
	}{
		{"sessions, ring hash", clusterv3.Cluster_RING_HASH, true, true},
		{"sessions, round robin", clusterv3.Cluster_ROUND_ROBIN, true, false},
		{"no session header", clusterv3.Cluster_RING_HASH, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := startUpstream(t)
			seen := make(chan [2]string, sessions*perSession) // endpoint, the stream's x-session-id
			var addrs []string
			for i := range endpoints {
				addrs = append(addrs, startExtProc(t, func(s *procStream) error {
					md, _ := metadata.FromIncomingContext(s.Context())
					seen <- [2]string{fmt.Sprint(i), strings.Join(md.Get("x-session-id"), ",")}
					return fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil, nil)(s)
				}))
			}
			cfg := loadShipped(t, "envoy.yaml")
			if tt.lb != clusterv3.Cluster_RING_HASH {
				cfg.Clusters[cfg.ExtProcCluster].HashHeaders = nil // as LoadConfig reads a round-robin cluster
			}
			cfg.Logf = t.Logf
			p, err := Start(cfg, addrs...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.Close() })
			for range perSession {
				for s := range sessions {
					var hdr map[string]string
					if tt.sessions {
						hdr = map[string]string{"x-session-id": fmt.Sprint("session-", s)}
					}
					if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, hdr); res.status != http.StatusOK {
						t.Fatalf("status %d %q", res.status, res.body)
					}
				}
			}
			close(seen)
			on := map[string][]string{} // session → endpoints of its streams
			perEndpoint := map[string]int{}
			for s := range seen {
				on[s[1]] = append(on[s[1]], s[0])
				perEndpoint[s[0]]++
			}
			if _, unnamed := on[""]; unnamed == tt.sessions {
				t.Fatalf("streams by their x-session-id metadata: %v", on)
			}
			for session, eps := range on {
				if pinned := len(slices.Compact(slices.Sorted(slices.Values(eps)))) == 1; pinned != tt.pinned {
					t.Errorf("session %q: streams on endpoints %v, want pinned %v", session, eps, tt.pinned)
				}
			}
			if len(perEndpoint) < 2 {
				t.Errorf("streams per endpoint %v: want them spread over the replicas", perEndpoint)
			}
		})
	}
}

// TestInitialMetadataValues: what the emulator sends of each
// initial_metadata entry, and which entries it refuses to guess at.
func TestInitialMetadataValues(t *testing.T) {
	h := http.Header{"X-Session-Id": {"abc", "def"}, "X-Tenant": {"t1"}}
	tests := []struct{ value, want string }{
		{"%REQ(x-session-id)%", "abc"},
		{"%REQ(X-Session-Id)%", "abc"},
		{"%REQ(x-missing)%", ""},
		{"static", "static"},
		{"%REQ(x-tenant)%/%REQ(x-session-id)%", "t1/abc"},
		{"100%% %REQ(x-tenant)%", "100% t1"},
	}
	for _, tt := range tests {
		if got := (MetadataValue{Key: "k", Value: tt.value}).evaluate(h); got != tt.want {
			t.Errorf("%q evaluates to %q, want %q", tt.value, got, tt.want)
		}
	}
	raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	for _, value := range []string{"%START_TIME%", "%REQ(x-a?x-b)%", "%REQ(x-session-id):8%", "%DOWNSTREAM_REMOTE_ADDRESS%"} {
		_, err := LoadConfig(writeFile(t, strings.Replace(raw, `"%REQ(x-session-id)%"`, `"`+value+`"`, 1)))
		if err == nil || !strings.Contains(err.Error(), "only %REQ(header)% is emulated") {
			t.Errorf("initial_metadata %s: LoadConfig error = %v, want a refusal", value, err)
		}
	}
}
