package envoyemu

import (
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/handlers"
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
		lbPolicy string // the extproc cluster's
		session  func(s int) string
		pinned   bool // want each session's streams on one replica
	}{
		{"sessions, ring hash", "RING_HASH", func(s int) string { return fmt.Sprint("session-", s) }, true},
		{"sessions, round robin", "ROUND_ROBIN", func(s int) string { return fmt.Sprint("session-", s) }, false},
		{"no session header", "RING_HASH", nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := startUpstream(t)
			type stream struct {
				endpoint int
				session  []string // the stream's x-session-id metadata
			}
			seen := make(chan stream, sessions*perSession)
			addrs := startReplicas(t, endpoints, up.addr, func(i int, s *procStream) {
				md, _ := metadata.FromIncomingContext(s.Context())
				seen <- stream{i, md.Get("x-session-id")}
			})
			raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
			cfg, err := LoadConfig(writeFile(t, strings.Replace(raw, "lb_policy: RING_HASH", "lb_policy: "+tt.lbPolicy, 1)))
			if err != nil {
				t.Fatal(err)
			}
			cfg.Clusters[cfg.ExtProcCluster].TLS = nil
			p := startProxyOn(t, cfg, addrs...)
			for range perSession {
				for s := range sessions {
					var hdr map[string]string
					if tt.session != nil {
						hdr = map[string]string{"x-session-id": tt.session(s)}
					}
					if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, hdr); res.status != http.StatusOK {
						t.Fatalf("status %d %q", res.status, res.body)
					}
				}
			}
			close(seen)
			on := map[int][]int{} // session → endpoints of its streams
			perEndpoint := map[int]int{}
			n := 0
			for st := range seen {
				session := -1
				if len(st.session) > 0 {
					if _, err := fmt.Sscanf(st.session[0], "session-%d", &session); err != nil {
						t.Fatalf("stream with x-session-id %q", st.session)
					}
				}
				if tt.session == nil && len(st.session) > 0 {
					t.Errorf("a stream without a session header carries x-session-id %q", st.session)
				}
				on[session] = append(on[session], st.endpoint)
				perEndpoint[st.endpoint]++
				n++
			}
			if n != sessions*perSession {
				t.Fatalf("%d streams, want %d", n, sessions*perSession)
			}
			for session, eps := range on {
				if session < 0 && tt.session != nil {
					t.Errorf("streams without x-session-id metadata: %v", eps)
				}
				if pinned := len(slices.Compact(slices.Sorted(slices.Values(eps)))) == 1; session >= 0 && pinned != tt.pinned {
					t.Errorf("session %d: streams on endpoints %v, want pinned %v", session, eps, tt.pinned)
				}
			}
			if len(perEndpoint) < 2 {
				t.Errorf("streams per endpoint %v: want them spread over the replicas", perEndpoint)
			}
		})
	}
}

// TestSessionHeaderNotSendable: a session value grpc-go cannot carry as
// metadata (bytes outside printable ASCII, which Envoy passes on) still
// picks one replica for all its streams; it is left off the stream, which
// is not refused.
func TestSessionHeaderNotSendable(t *testing.T) {
	const endpoints, streams = 3, 6
	up := startUpstream(t)
	seen := make(chan [2]string, streams) // endpoint, the stream's x-session-id
	p := startProxyOn(t, loadShipped(t, "envoy.yaml"), startReplicas(t, endpoints, up.addr, func(i int, s *procStream) {
		md, _ := metadata.FromIncomingContext(s.Context())
		seen <- [2]string{fmt.Sprint(i), strings.Join(md.Get("x-session-id"), ",")}
	})...)
	for range streams {
		if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, map[string]string{"x-session-id": "séance"}); res.status != http.StatusOK {
			t.Fatalf("status %d %q", res.status, res.body)
		}
	}
	close(seen)
	on := map[string]int{}
	for s := range seen {
		if s[1] != "" {
			t.Errorf("stream carries x-session-id %q", s[1])
		}
		on[s[0]]++
	}
	if len(on) != 1 {
		t.Errorf("streams per endpoint %v: want all on one", on)
	}
}

// TestInitialMetadataValues: what the emulator sends of each
// initial_metadata entry, and which entries it refuses to guess at.
func TestInitialMetadataValues(t *testing.T) {
	h := &headerMap{}
	for _, kv := range [][2]string{{":authority", "gw.example"}, {":path", "/v1/chat/completions?x=1"}, {":method", "POST"},
		{"x-session-id", "abc"}, {"x-session-id", "def"}, {"x-tenant", "t1"}} {
		h.add(kv[0], kv[1])
	}
	tests := []struct{ value, want string }{
		{"%REQ(x-session-id)%", "abc"},
		{"%REQ(X-Session-Id)%", "abc"},
		{"%REQ(x-missing)%", ""},
		{"static", "static"},
		{"%REQ(x-tenant)%/%REQ(x-session-id)%", "t1/abc"},
		{"100%% %REQ(x-tenant)%", "100% t1"},
		{"%REQ(x-tenant)%%%", "t1%"},
		{"%REQ(:authority)% %REQ(host)% %REQ(:method)% %REQ(:path)%", "gw.example gw.example POST /v1/chat/completions?x=1"},
	}
	for _, tt := range tests {
		if got := (MetadataValue{Key: "k", Value: tt.value}).evaluate(h); got != tt.want {
			t.Errorf("%q evaluates to %q, want %q", tt.value, got, tt.want)
		}
	}
	raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	for _, value := range []string{"%START_TIME%", "%REQ(x-a?x-b)%", "%REQ(x-session-id):8%", "%DOWNSTREAM_PEER_FINGERPRINT_256%",
		"%REQ(x-a)%%START_TIME%", "%REQ(x-a)%%", "100%", "%REQ()%", "%REQ(x-a)"} {
		_, err := LoadConfig(writeFile(t, strings.Replace(raw, `"%REQ(x-session-id)%"`, `"`+value+`"`, 1)))
		if err == nil || !strings.Contains(err.Error(), "only %REQ(header)% is emulated") {
			t.Errorf("initial_metadata %s: LoadConfig error = %v, want a refusal", value, err)
		}
	}
}

// TestHashHeadersFollowTheLoadBalancer: the extproc cluster's hash policy
// counts under a hash load balancer, named by lb_policy or by a typed
// load_balancing_policy, and is ignored under another, as in Envoy.
func TestHashHeadersFollowTheLoadBalancer(t *testing.T) {
	const typed = `load_balancing_policy: {policies: [{typed_extension_config: {name: envoy.load_balancing_policies.%s, typed_config: {"@type": type.googleapis.com/envoy.extensions.load_balancing_policies.%s.v3.%s}}}]}`
	raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	shipped := handlers.SessionHeaders
	tests := []struct {
		lb   string
		want []string
	}{
		{"lb_policy: RING_HASH", shipped},
		{"lb_policy: MAGLEV", shipped},
		{"lb_policy: ROUND_ROBIN", nil},
		{"lb_policy: LEAST_REQUEST", nil},
		{fmt.Sprintf(typed, "maglev", "maglev", "Maglev"), shipped},
		{fmt.Sprintf(typed, "ring_hash", "ring_hash", "RingHash"), shipped},
	}
	for _, tt := range tests {
		cfg, err := LoadConfig(writeFile(t, strings.Replace(raw, "lb_policy: RING_HASH", tt.lb, 1)))
		if err != nil {
			t.Fatalf("%s: %v", tt.lb, err)
		}
		if got := cfg.Clusters[cfg.ExtProcCluster].HashHeaders; !slices.Equal(got, tt.want) {
			t.Errorf("%s: hash headers %v, want %v", tt.lb, got, tt.want)
		}
	}
}
