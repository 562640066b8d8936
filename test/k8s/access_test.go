package k8s

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// This file's tests run first in the package (go test runs files in name
// order): the missing-CRD case needs a cluster where no test has installed
// the InferencePool CRD yet.

// Until discovery can be trusted, extproc is not ready, even with a healthy
// decode endpoint of its own: its informers have not synced, or the API
// server refuses what they need. The reason names what is missing.
func TestNotReadyUntilDiscoveryCanBeTrusted(t *testing.T) {
	c := mustCluster(t)
	decode := testbed.MustStartSim(t, testbed.SimConfig{Role: pdsim.RoleDecode, Protocol: pdsim.ProtocolNIXL, IP: nextIP()})

	// A Role without watch: the informer can list, so it syncs, but it would
	// never hear of a change.
	noWatch := c.namespace(t, "nowatch")
	rbac := c.kube.RbacV1()
	if _, err := rbac.Roles(noWatch).Create(context.Background(), &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "list-only"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"list"}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := rbac.RoleBindings(noWatch).Create(context.Background(), &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "list-only"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "list-only"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: nowatchUser}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	noCRD := c.namespace(t, "nocrd")
	_, err := c.kube.Discovery().ServerResourcesForGroupVersion("inference.networking.k8s.io/v1")
	crdInstalled := err == nil

	withPrefill := func(prefill string) string {
		return fmt.Sprintf("connector: kv-nixl\npools:\n  prefill: {kubernetes: %s}\n  decode: {endpoints: [%q]}\n", prefill, decode.Addr())
	}
	tests := []struct {
		name, server, token, config string
		want                        []string // in /readyz?verbose
		refused                     bool     // pd_extproc_discovery_refused{pool="prefill"}
		needsNoCRD                  bool
	}{
		{"Role without watch", "", nowatchToken, withPrefill(fmt.Sprintf(`{namespace: %s, selector: "a=b", port: 8000}`, noWatch)),
			[]string{"[-]kubernetes prefill", fmt.Sprintf(`may not watch pods in namespace %q`, noWatch), "grant the verbs list and watch on pods"}, true, false},
		{"no Role at all", "", nowatchToken, withPrefill(fmt.Sprintf(`{namespace: %s, selector: "a=b", port: 8000}`, noCRD)),
			[]string{"[-]kubernetes prefill", fmt.Sprintf(`may not watch pods in namespace %q`, noCRD)}, true, false},
		{"InferencePool CRD not installed", "", extprocToken, withPrefill(fmt.Sprintf(`{namespace: %s, inference_pool: vllm}`, noCRD)),
			[]string{"[-]kubernetes prefill", "does not serve inferencepools", "install the InferencePool CRD"}, true, true},
		{"API server unreachable from the start", "https://" + testbed.MustFreeAddr(t), extprocToken, withPrefill(fmt.Sprintf(`{namespace: %s, selector: "a=b", port: 8000}`, noCRD)),
			[]string{"[-]kubernetes prefill", "not synced yet", "last error"}, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.needsNoCRD && crdInstalled {
				t.Skip("the InferencePool CRD was installed by an earlier test of this process (go test -count > 1, or -run out of file order)")
			}
			s := startStack(t, tc.server, tc.token, tc.config)
			eventually(t, "the reason to show", func() bool {
				_, text := s.readyz(t)
				return containsAll(text, tc.want...)
			})
			code, text := s.readyz(t)
			if code != http.StatusServiceUnavailable || !strings.Contains(text, "[+]decode pool") {
				t.Errorf("/readyz = %d, want 503 with a healthy decode pool:\n%s", code, text)
			}
			if got := s.metric(t, `pd_extproc_discovery_refused{pool="prefill"}`); (got == 1) != tc.refused {
				t.Errorf("discovery_refused = %v, want refused %v", got, tc.refused)
			}
			if got := healthStatus(t, s); got != healthpb.HealthCheckResponse_NOT_SERVING {
				t.Errorf("gRPC health = %v, want NOT_SERVING", got)
			}
		})
	}
}

func healthStatus(t *testing.T, s *stack) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	conn, err := grpc.NewClient(s.x.GRPCAddr, grpc.WithTransportCredentials(testbed.MustCredentials(t, s.mtls)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetStatus()
}
