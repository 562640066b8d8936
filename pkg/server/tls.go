package server

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/go-logr/logr"
	"google.golang.org/grpc/credentials"
)

// TLSFiles names the gRPC listener's certificate files. Without Cert the
// listener is plaintext (Envoy next to us on a private network or localhost).
// With ClientCA, clients must present a certificate it signed (mTLS, as Envoy
// Gateway's BackendTLSPolicy sets up).
type TLSFiles struct {
	Cert, Key, ClientCA string
}

// Validate checks the combination of files given.
func (f TLSFiles) Validate() error {
	switch {
	case (f.Cert == "") != (f.Key == ""):
		return errors.New("--tls-cert-file and --tls-key-file go together")
	case f.ClientCA != "" && f.Cert == "":
		return errors.New("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
	}
	return nil
}

// credentials returns the listener's transport credentials, or nil for
// plaintext. The files are read again whenever they change on disk, so that a
// rotated certificate (cert-manager, a Kubernetes Secret) is served from the
// next handshake on, without a restart.
func (f TLSFiles) credentials(log logr.Logger) (credentials.TransportCredentials, error) {
	if f.Cert == "" {
		return nil, nil
	}
	r := &tlsReloader{files: f, log: log}
	if _, err := r.current(); err != nil {
		return nil, err
	}
	return credentials.NewTLS(&tls.Config{
		MinVersion: tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return r.current()
		},
	}), nil
}

// tlsReloader keeps the tls.Config of the files as they were last read; each
// handshake stats them (cheap) and reads them again when they changed.
type tlsReloader struct {
	files TLSFiles
	log   logr.Logger

	mu    sync.Mutex
	stamp string // the files' sizes and modification times when read
	cfg   *tls.Config
}

func (r *tlsReloader) current() (*tls.Config, error) {
	stamp, err := r.stampFiles()
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil && stamp == r.stamp {
		return r.cfg, nil
	}
	cfg, loadErr := r.load()
	switch {
	case loadErr == nil:
		r.stamp, r.cfg = stamp, cfg
		r.log.Info("TLS certificate loaded", "cert", r.files.Cert, "clientCA", r.files.ClientCA)
	case r.cfg == nil:
		return nil, loadErr
	default:
		// A half-written rotation: keep serving the previous certificate.
		r.log.Error(loadErr, "reloading TLS files failed; serving the previous certificate")
	}
	return r.cfg, nil
}

func (r *tlsReloader) stampFiles() (string, error) {
	var stamp string
	for _, name := range []string{r.files.Cert, r.files.Key, r.files.ClientCA} {
		if name == "" {
			continue
		}
		fi, err := os.Stat(name)
		if err != nil {
			return "", err
		}
		stamp += fmt.Sprintf("%s:%d:%d;", name, fi.Size(), fi.ModTime().UnixNano())
	}
	return stamp, nil
}

func (r *tlsReloader) load() (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(r.files.Cert, r.files.Key)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate: %w", err)
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}}
	if r.files.ClientCA != "" {
		pool, err := loadCAs(r.files.ClientCA)
		if err != nil {
			return nil, err
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// loadCAs reads a PEM bundle of CA certificates.
func loadCAs(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("CA file %s: no PEM certificate in it", path)
	}
	return pool, nil
}
