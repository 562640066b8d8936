package e2e

import (
	"net/http"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// Envoy and extproc speak mTLS as config/envoy/envoy.yaml and the manifests
// have them: the emulator checks extproc's certificate against the CA and the
// SAN the bootstrap names, extproc checks Envoy's against its client CA and
// --tls-client-allowed-sans. A link either side refuses fails closed: Envoy
// answers 500 and no engine sees the request. The shipped names are served.
func TestExtProcOverMTLS(t *testing.T) {
	// The series a routed request counts in: read as 1 when served, so that a
	// refused link's 0 (absent: -1) is of a series that exists.
	const routedChat = `pd_extproc_requests_total{api="chat",connector="kv-nixl",mode="pd",outcome="routed"}`
	tests := []struct {
		name   string
		mtls   func(t *testing.T) *testbed.MTLS
		served bool
		detail string // in Envoy's response details, when refused
		logged string // what extproc logs of the refusal
	}{
		{name: "the shipped names", mtls: func(t *testing.T) *testbed.MTLS { return testbed.MustNewMTLS(t, testbed.MTLSConfig{}) }, served: true},
		{name: "Envoy's SPIFFE id, one of two allowed SANs", mtls: func(t *testing.T) *testbed.MTLS {
			const envoyID = "spiffe://cluster.local/ns/envoy-gateway-system/sa/envoy"
			return testbed.MustNewMTLS(t, testbed.MTLSConfig{ClientSANs: []string{envoyID}, AllowedSANs: []string{"envoy.envoy-gateway-system.svc", envoyID}})
		}, served: true},
		{name: "extproc's certificate names another service", mtls: func(t *testing.T) *testbed.MTLS {
			return testbed.MustNewMTLS(t, testbed.MTLSConfig{ServerSANs: []string{"vllm-decode.pd-extproc.svc"}})
		}, detail: "SAN_matcher,_certificate_SANs_are_[vllm-decode.pd-extproc.svc]"},
		{name: "Envoy's certificate is of another CA", mtls: func(t *testing.T) *testbed.MTLS {
			m := *testbed.MustNewMTLS(t, testbed.MTLSConfig{})
			m.Client = testbed.MustNewMTLS(t, testbed.MTLSConfig{}).Client
			return &m
		}},
		{name: "Envoy's certificate names a SAN extproc does not allow", mtls: func(t *testing.T) *testbed.MTLS {
			return testbed.MustNewMTLS(t, testbed.MTLSConfig{ClientSANs: []string{"intruder.pd-extproc"}})
		}, logged: "intruder.pd-extproc"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := startRig(t, rigOptions{prefills: 1, decodes: 1, mtls: tc.mtls(t)})
			path, body := request("chat", true, "over mTLS")
			resp, got := r.must(t, path, body, nil)
			if tc.served {
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d (%s): %.300s", resp.StatusCode, resp.Header.Get(envoyemu.DetailsHeader), got)
				}
				checkCompletion(t, true, got)
				if v := r.metric(t, routedChat); v != 1 {
					t.Errorf("%s = %v, want 1", routedChat, v)
				}
				return
			}
			if details := resp.Header.Get(envoyemu.DetailsHeader); resp.StatusCode != http.StatusInternalServerError ||
				!strings.HasPrefix(details, "ext_proc_error_gRPC_error_14") || !strings.Contains(details, tc.detail) {
				t.Errorf("status %d (%s), want Envoy's 500 for an ext_proc stream that could not open (UNAVAILABLE) %s", resp.StatusCode, details, tc.detail)
			}
			checkEnvoyError(t, resp, got, http.StatusInternalServerError, "server_error", "request processing failed: "+resp.Header.Get(envoyemu.DetailsHeader))
			for _, s := range append(r.prefill, r.decode...) {
				if n := len(s.Requests()); n != 0 {
					t.Errorf("engine %s got %d requests through a refused link", s.Addr(), n)
				}
			}
			if tc.logged != "" {
				r.extproc.waitLog(t, tc.logged)
			}
			if v := r.metric(t, routedChat); v > 0 {
				t.Errorf("extproc counted %v chat requests through a refused link", v)
			}
		})
	}
}
