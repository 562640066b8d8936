package k8s

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"

	"github.com/pd-extproc/pd-extproc/internal/testpki"
)

// pki is what the API server needs to serve and sign, written into dir:
// a CA, a serving certificate for 127.0.0.1 signed by it, and a key pair
// for service-account tokens.
type pki struct {
	ca                  *testpki.CA
	certFile, keyFile   string
	saPublic, saPrivate string
}

func newPKI(dir string) (*pki, error) {
	ca, err := testpki.NewCA("pd-extproc test CA")
	if err != nil {
		return nil, err
	}
	srv, err := ca.Issue(filepath.Join(dir, "apiserver"), testpki.Leaf{
		Name: "kube-apiserver", SANs: []string{"127.0.0.1", "localhost", "kubernetes.default.svc"}, Server: true,
	})
	if err != nil {
		return nil, err
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	p := &pki{
		ca: ca, certFile: srv.Cert, keyFile: srv.Key,
		saPublic: filepath.Join(dir, "sa.pub"), saPrivate: filepath.Join(dir, "sa.key"),
	}
	saKeyDER, err := x509.MarshalECPrivateKey(saKey)
	if err != nil {
		return nil, err
	}
	saPubDER, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return nil, err
	}
	files := map[string][]byte{
		p.saPrivate: pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: saKeyDER}),
		p.saPublic:  pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: saPubDER}),
	}
	for path, data := range files {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return nil, err
		}
	}
	return p, nil
}
