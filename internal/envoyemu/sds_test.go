package envoyemu

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testpki"
)

// secretOf is a kubernetes.io/tls Secret of Envoy's as the world's CA issues
// it: a client certificate and the CA both sides trust.
func secretOf(t *testing.T, w mtlsWorld) map[string][]byte {
	t.Helper()
	return map[string][]byte{"tls.crt": []byte(readFile(t, w.client.Cert)), "tls.key": []byte(readFile(t, w.client.Key)), "ca.crt": w.ca.PEM}
}

// startMounted starts the shipped envoy.yaml (its TLS replaced when tls is
// set) with /etc/envoy/certs mounted from certs and /etc/envoy/sds from sds.
func startMounted(t *testing.T, tls *UpstreamTLS, certs, sds string, extProcAddr string) (*Proxy, error) {
	t.Helper()
	cfg := loadShippedAsIs(t, "envoy.yaml")
	if tls != nil {
		cfg.Clusters[cfg.ExtProcCluster].TLS = tls
	}
	cfg.Mounts = map[string]string{"/etc/envoy/certs": certs, "/etc/envoy/sds": sds}
	cfg.Logf = t.Logf
	p, err := Start(cfg, extProcAddr)
	if err == nil {
		t.Cleanup(func() { _ = p.Close() })
	}
	return p, err
}

// A Secret renewed under a running Envoy, as cert-manager renews it: here a
// new CA signs new certificates for both sides, so that nothing of the old
// Secret still works once pd-extproc restarts with its new certificate. The
// shipped bootstrap takes its certificate and CA by file-based SDS and follows
// the files moved into its watched directory: its next connections present
// the new certificate and trust the new CA, with no restart. A bootstrap that
// names the files directly keeps what it read at start and fails from then on
// (every request a 500), as Envoy does.
func TestRotatedSecretReachesNewConnections(t *testing.T) {
	const san = "pd-extproc.pd-extproc.svc"
	up := startUpstream(t)
	route := fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", up.addr)), nil, nil)
	before, after := newMTLSWorld(t, san), newMTLSWorld(t, san)
	volume := &testpki.Volume{Dir: t.TempDir()}
	if err := volume.Write(secretOf(t, before)); err != nil {
		t.Fatal(err)
	}
	addr, stop := serveTLS(t, before, "127.0.0.1:0", route)
	sds := filepath.Join(repoRoot(t), "config", "envoy", "sds")

	shipped, err := startMounted(t, nil, volume.Dir, sds, addr)
	if err != nil {
		t.Fatal(err)
	}
	files, err := startMounted(t, &UpstreamTLS{
		CertFile: "/etc/envoy/certs/tls.crt", KeyFile: "/etc/envoy/certs/tls.key", CAFile: "/etc/envoy/certs/ca.crt",
		SubjectAltNames: []SANMatcher{{Type: "DNS", Op: "exact", Value: san}},
	}, volume.Dir, sds, addr)
	if err != nil {
		t.Fatal(err)
	}
	for name, p := range map[string]*Proxy{"shipped (SDS)": shipped, "files": files} {
		if res := do(t, p, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil); res.status != http.StatusOK {
			t.Fatalf("%s before the renewal: %d %q (%s), want 200", name, res.status, res.body, res.header.Get(DetailsHeader))
		}
	}

	// The renewal: the Secret's new version lands in the volume, then pd-extproc restarts
	// with its own new certificate; the old connections break and the proxies dial again.
	if err := volume.Write(secretOf(t, after)); err != nil {
		t.Fatal(err)
	}
	stop()
	serveTLS(t, after, addr, route)

	deadline := time.Now().Add(20 * time.Second)
	for {
		res := do(t, shipped, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
		if res.status == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the shipped bootstrap still fails 20 s after the renewal: %d (%s)", res.status, res.header.Get(DetailsHeader))
		}
		time.Sleep(50 * time.Millisecond) // gRPC dials again on its own backoff; bounded above
	}
	res := do(t, files, http.MethodPost, "/v1/completions", `{"model":"m"}`, nil)
	if res.status != http.StatusInternalServerError || !strings.HasPrefix(res.header.Get(DetailsHeader), "ext_proc_error_gRPC_error_14") {
		t.Errorf("the bootstrap with plain files after the renewal: %d (%s), want 500 ext_proc_error_gRPC_error_14: it never reads them again",
			res.status, res.header.Get(DetailsHeader))
	}
}

// An SDS file Envoy would not accept refuses the config, as Envoy refuses it
// at start.
func TestStartRefusesBadSDSFiles(t *testing.T) {
	w := newMTLSWorld(t, "pd-extproc.pd-extproc.svc")
	certs := &testpki.Volume{Dir: t.TempDir()}
	if err := certs.Write(secretOf(t, w)); err != nil {
		t.Fatal(err)
	}
	shipped := filepath.Join(repoRoot(t), "config", "envoy", "sds")
	client := readFile(t, filepath.Join(shipped, "client-cert.yaml"))
	tests := []struct {
		name, clientCert string // the SDS file of the client certificate
		certs            string // the directory mounted at /etc/envoy/certs
		want             string
	}{
		{"another secret's name", strings.Replace(client, "name: extproc_client_cert", "name: client", 1), certs.Dir,
			"Unexpected SDS secret (expecting extproc_client_cert): client"},
		{"two secrets", client + client[strings.Index(client, "- \"@type\""):], certs.Dir, "Unexpected SDS secrets length: 2"},
		{"a secret without a certificate", "resources:\n- \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret\n" +
			"  name: extproc_client_cert\n  generic_secret: {secret: {inline_string: x}}\n", certs.Dir, "neither tls_certificate nor validation_context"},
		{"a watched directory that does not exist", strings.Replace(client, "watched_directory: {path: /etc/envoy/certs}", "watched_directory: {path: /etc/envoy/nowhere}", 1),
			certs.Dir, "watched_directory /etc/envoy/nowhere"},
		{"the Secret not mounted", client, filepath.Join(t.TempDir(), "missing"), "/etc/envoy/certs/tls.crt"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sds := t.TempDir()
			for name, data := range map[string]string{"client-cert.yaml": tc.clientCert, "trusted-ca.yaml": readFile(t, filepath.Join(shipped, "trusted-ca.yaml"))} {
				if err := os.WriteFile(filepath.Join(sds, name), []byte(data), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			_, err := startMounted(t, nil, tc.certs, sds, "127.0.0.1:1")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Start: %v; want a refusal naming %q", err, tc.want)
			}
		})
	}
}
