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
// the client's x-session-id, else its address, as gRPC metadata, and the
// extproc cluster's ring hash sends every stream of one session, or of one
// client naming none, to one replica: the session header is terminal, so a
// session that moves between addresses stays; a cluster without a hash load
// balancer balances them in turn (§14).
func TestExtProcSessionAffinity(t *testing.T) {
	// Sessions prime to endpoints, so that in turn a session moves; and many,
	// so that hashed they all meet on one replica with a chance of 3^-15.
	const endpoints, sessions, perSession = 3, 16, 3
	ownAddress := func(s, _ int) string { return fmt.Sprint("127.0.0.", 2+s) }
	tests := []struct {
		name     string
		lbPolicy string // the extproc cluster's
		session  func(s int) string
		client   func(s, i int) string // the address of session s's ith request
		pinned   bool                  // want each session's streams on one replica
		spread   bool                  // want the sessions spread over the replicas
	}{
		{"sessions, ring hash", "RING_HASH", func(s int) string { return fmt.Sprint("session-", s) }, nil, true, true},
		{"sessions moving between addresses", "RING_HASH", func(s int) string { return fmt.Sprint("session-", s) },
			func(s, i int) string { return fmt.Sprint("127.0.0.", 2+s*perSession+i) }, true, true},
		{"sessions, round robin", "ROUND_ROBIN", func(s int) string { return fmt.Sprint("session-", s) }, nil, false, true},
		{"clients without sessions, ring hash", "RING_HASH", nil, ownAddress, true, true},
		{"clients without sessions, round robin", "ROUND_ROBIN", nil, ownAddress, false, true},
		{"one client without sessions", "RING_HASH", nil, nil, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := startUpstream(t)
			type stream struct {
				endpoint        int
				session, client []string // the stream's x-session-id and x-pd-client-address metadata
			}
			seen := make(chan stream, sessions*perSession)
			addrs := startReplicas(t, endpoints, up.addr, func(i int, s *procStream) {
				md, _ := metadata.FromIncomingContext(s.Context())
				seen <- stream{i, md.Get("x-session-id"), md.Get(handlers.ClientAddressHeader)}
			})
			raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
			cfg, err := LoadConfig(writeFile(t, strings.Replace(raw, "lb_policy: RING_HASH", "lb_policy: "+tt.lbPolicy, 1)))
			if err != nil {
				t.Fatal(err)
			}
			cfg.Clusters[cfg.ExtProcCluster].TLS = nil
			p := startProxyOn(t, cfg, addrs...)
			for i := range perSession {
				for s := range sessions {
					var hdr map[string]string
					if tt.session != nil {
						hdr = map[string]string{"x-session-id": tt.session(s)}
					}
					client := "127.0.0.1"
					if tt.client != nil {
						client = tt.client(s, i)
					}
					if res := doFrom(t, p, client, http.MethodPost, "/v1/completions", `{"model":"m"}`, hdr); res.status != http.StatusOK {
						t.Fatalf("status %d %q", res.status, res.body)
					}
				}
			}
			close(seen)
			on := map[string][]int{} // session, or client address → endpoints of its streams
			perEndpoint := map[int]int{}
			n := 0
			for st := range seen {
				if tt.session == nil && len(st.session) > 0 {
					t.Errorf("a stream without a session header carries x-session-id %q", st.session)
				}
				if len(st.client) != 1 || !strings.HasPrefix(st.client[0], "127.0.0.") {
					t.Errorf("stream carries %s %q, want the client's address", handlers.ClientAddressHeader, st.client)
				}
				key := strings.Join(st.session, ",")
				if key == "" {
					key = strings.Join(st.client, ",")
				}
				on[key] = append(on[key], st.endpoint)
				perEndpoint[st.endpoint]++
				n++
			}
			if n != sessions*perSession {
				t.Fatalf("%d streams, want %d", n, sessions*perSession)
			}
			for key, eps := range on {
				if pinned := len(slices.Compact(slices.Sorted(slices.Values(eps)))) == 1; pinned != tt.pinned {
					t.Errorf("%s: streams on endpoints %v, want pinned %v", key, eps, tt.pinned)
				}
			}
			if spread := len(perEndpoint) > 1; spread != tt.spread {
				t.Errorf("streams per endpoint %v: want spread over the replicas %v", perEndpoint, tt.spread)
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
		{"%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%", "192.0.2.7"},
		{"%REQ(x-tenant)%@%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%", "t1@192.0.2.7"},
		{"%REQ(X-Session-Id)%", "abc"},
		{"%REQ(x-missing)%", ""},
		{"static", "static"},
		{"%REQ(x-tenant)%/%REQ(x-session-id)%", "t1/abc"},
		{"100%% %REQ(x-tenant)%", "100% t1"},
		{"%REQ(x-tenant)%%%", "t1%"},
		{"%REQ(:authority)% %REQ(host)% %REQ(:method)% %REQ(:path)%", "gw.example gw.example POST /v1/chat/completions?x=1"},
	}
	for _, tt := range tests {
		if got := (MetadataValue{Key: "k", Value: tt.value}).evaluate(h, "192.0.2.7:51234"); got != tt.want {
			t.Errorf("%q evaluates to %q, want %q", tt.value, got, tt.want)
		}
	}
	raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	for _, value := range []string{"%START_TIME%", "%REQ(x-a?x-b)%", "%REQ(x-session-id):8%", "%DOWNSTREAM_PEER_FINGERPRINT_256%",
		"%REQ(x-a)%%START_TIME%", "%REQ(x-a)%%", "100%", "%REQ()%", "%REQ(x-a)", "%DOWNSTREAM_REMOTE_ADDRESS%",
		"%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT(x)%", "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT:4%"} {
		_, err := LoadConfig(writeFile(t, strings.Replace(raw, `"%REQ(x-session-id)%"`, `"`+value+`"`, 1)))
		if err == nil || !strings.Contains(err.Error(), "only %REQ(header)% and %DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT% are emulated") {
			t.Errorf("initial_metadata %s: LoadConfig error = %v, want a refusal", value, err)
		}
	}
}

// TestClientAddressNeedsUseRemoteAddress: without use_remote_address Envoy
// takes the client's address from x-forwarded-for, which the client sets;
// the emulator refuses to guess.
func TestClientAddressNeedsUseRemoteAddress(t *testing.T) {
	raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	withoutRemote := func(s string) string {
		return strings.Replace(s, "use_remote_address: true", "use_remote_address: false", 1)
	}
	withoutAddress := func(s string) string {
		return strings.Replace(s, `"%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"`, `"%REQ(x-client)%"`, 1)
	}
	tests := []struct {
		name    string
		yaml    string
		wantErr bool
	}{
		{"as shipped", raw, false},
		{"without use_remote_address", withoutRemote(raw), true},
		{"without it and without the address", withoutRemote(withoutAddress(raw)), false},
	}
	for _, tt := range tests {
		_, err := LoadConfig(writeFile(t, tt.yaml))
		if refused := err != nil && strings.Contains(err.Error(), "without use_remote_address is not emulated"); refused != tt.wantErr || err != nil && !refused {
			t.Errorf("%s: LoadConfig error = %v, want the refusal %v", tt.name, err, tt.wantErr)
		}
	}
}

// TestHashHeadersFollowTheLoadBalancer: the extproc cluster's hash policy
// counts under a hash load balancer, named by lb_policy or by a typed
// load_balancing_policy, and is ignored under another, as in Envoy.
func TestHashHeadersFollowTheLoadBalancer(t *testing.T) {
	const typed = `load_balancing_policy: {policies: [{typed_extension_config: {name: envoy.load_balancing_policies.%s, typed_config: {"@type": type.googleapis.com/envoy.extensions.load_balancing_policies.%s.v3.%s}}}]}`
	raw := readFile(t, filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	shipped := append(slices.Clone(handlers.SessionHeaders), handlers.ClientAddressHeader)
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
		if got := hashedNames(cfg.Clusters[cfg.ExtProcCluster].HashHeaders); !slices.Equal(got, tt.want) {
			t.Errorf("%s: hash headers %v, want %v", tt.lb, got, tt.want)
		}
	}
}

// hashedNames is the names of hs, in order.
func hashedNames(hs []HashHeader) []string {
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = h.Name
	}
	return out
}
