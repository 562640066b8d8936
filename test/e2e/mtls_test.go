package e2e

import (
	"net/http"
	"os/exec"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// Envoy and extproc speak mTLS as config/envoy/envoy.yaml has them: the
// emulator checks extproc's certificate against the CA and the SAN the
// bootstrap names, extproc checks Envoy's against its client CA (and, with
// --tls-client-allowed-sans, its SAN). A link either side refuses fails
// closed: Envoy answers 500 and no engine sees the request. The shipped names
// are served.
func TestExtProcOverMTLS(t *testing.T) {
	foreign := func(t *testing.T) *testbed.MTLS {
		// Envoy's certificate comes from a CA extproc does not trust.
		m := *testbed.MustNewMTLS(t, testbed.MTLSConfig{})
		m.Client = testbed.MustNewMTLS(t, testbed.MTLSConfig{}).Client
		return &m
	}
	tests := []struct {
		name   string
		mtls   func(t *testing.T) *testbed.MTLS
		args   []string // more extproc flags
		needs  string   // an extproc flag the case needs
		served bool
		detail string // in Envoy's response details, when refused
	}{
		{name: "the shipped names", mtls: func(t *testing.T) *testbed.MTLS { return testbed.MustNewMTLS(t, testbed.MTLSConfig{}) }, served: true},
		{name: "extproc's certificate names another service", mtls: func(t *testing.T) *testbed.MTLS {
			return testbed.MustNewMTLS(t, testbed.MTLSConfig{ServerSANs: []string{"vllm-decode.pd-extproc.svc"}})
		}, detail: "SAN_matcher,_certificate_SANs_are_[vllm-decode.pd-extproc.svc]"},
		{name: "Envoy's certificate is of another CA", mtls: foreign},
		{name: "the client SAN extproc allows", args: []string{"--tls-client-allowed-sans", testbed.ClientSAN}, needs: "tls-client-allowed-sans",
			mtls: func(t *testing.T) *testbed.MTLS { return testbed.MustNewMTLS(t, testbed.MTLSConfig{}) }, served: true},
		{name: "a client SAN extproc does not allow", args: []string{"--tls-client-allowed-sans", testbed.ClientSAN}, needs: "tls-client-allowed-sans",
			mtls: func(t *testing.T) *testbed.MTLS {
				return testbed.MustNewMTLS(t, testbed.MTLSConfig{ClientSANs: []string{"intruder.pd-extproc"}})
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.needs != "" && !extprocHasFlag(t, tc.needs) {
				t.Skipf("this extproc has no --%s: the server's check of the client SAN is not in this build", tc.needs)
			}
			r := startRig(t, rigOptions{prefills: 1, decodes: 1, mtls: tc.mtls(t), extprocArgs: tc.args})
			path, body := request("chat", true, "over mTLS")
			resp, got := r.must(t, path, body, nil)
			if tc.served {
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d (%s): %.300s", resp.StatusCode, resp.Header.Get(envoyemu.DetailsHeader), got)
				}
				checkCompletion(t, true, got)
				return
			}
			if details := resp.Header.Get(envoyemu.DetailsHeader); resp.StatusCode != http.StatusInternalServerError ||
				!strings.HasPrefix(details, "ext_proc_error_gRPC_error_14") || !strings.Contains(details, tc.detail) {
				t.Errorf("status %d (%s), want Envoy's 500 for an ext_proc stream that could not open (UNAVAILABLE) %s", resp.StatusCode, details, tc.detail)
			}
			for _, s := range append(r.prefill, r.decode...) {
				if n := len(s.Requests()); n != 0 {
					t.Errorf("engine %s got %d requests through a refused link", s.Addr(), n)
				}
			}
			if v := r.metric(t, `pd_extproc_requests_total{api="chat"`); v > 0 {
				t.Errorf("extproc counted %v chat requests through a refused link", v)
			}
		})
	}
}

// extprocHasFlag reports whether the extproc under test defines --name.
func extprocHasFlag(t *testing.T, name string) bool {
	t.Helper()
	out, _ := exec.Command(extprocBin, "-h").CombinedOutput() // -h exits 0 or 2 with the usage
	return strings.Contains(string(out), "-"+name+" ")
}
