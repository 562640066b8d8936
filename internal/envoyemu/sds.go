package envoyemu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"
)

// SDSSecret is one secret of an UpstreamTlsContext delivered by file-based
// SDS (§13): sds_config.path_config_source names a file holding a
// DiscoveryResponse with that one secret, whose data sources name the
// certificate files. Envoy reads them at start and again whenever a file is
// moved into a watched directory: the SDS file's watched_directory, and the
// secret's own (how a Kubernetes Secret volume changes, and so how a
// cert-manager renewal reaches Envoy with no restart).
type SDSSecret struct {
	Name       string // sds_secret_config.name: the secret the file must hold
	Path       string // path_config_source.path
	WatchedDir string // path_config_source.watched_directory; "": the file itself is watched
}

// sdsFromProto reads an SdsSecretConfig; only file-based SDS is emulated.
func sdsFromProto(c *tlsv3.SdsSecretConfig) (*SDSSecret, error) {
	src := c.GetSdsConfig()
	if extra := setFields(src, "path_config_source", "resource_api_version", "initial_fetch_timeout"); len(extra) > 0 || src.GetPathConfigSource() == nil {
		return nil, fmt.Errorf("SDS secret %q: only sds_config.path_config_source (file-based SDS) is emulated, not %v", c.GetName(), extra)
	}
	if v := src.GetResourceApiVersion(); v != corev3.ApiVersion_AUTO && v != corev3.ApiVersion_V3 {
		return nil, fmt.Errorf("SDS secret %q: resource_api_version %s is not supported", c.GetName(), v)
	}
	pcs := src.GetPathConfigSource()
	return &SDSSecret{Name: c.GetName(), Path: pcs.GetPath(), WatchedDir: pcs.GetWatchedDirectory().GetPath()}, nil
}

// secretFiles are what a secret's data sources name, and where Envoy watches
// them for moves.
type secretFiles struct {
	cert, key, ca string
	watch         []watch
}

// watch is a directory Envoy watches for files moved into it; names limits
// the moves that count to those files (nil: any).
type watch struct {
	dir   string
	names []string
}

// watchFile is Envoy's watch on a file without a watched directory: a move of
// that file itself, within its directory.
func watchFile(path string) watch {
	return watch{dir: filepath.Dir(path), names: []string{filepath.Base(path)}}
}

// read reads the SDS file through open (which maps the bootstrap's paths to
// the host) and the one secret it must hold, as Envoy's SdsApi accepts it.
func (s *SDSSecret) read(open func(string) string) (secretFiles, error) {
	raw, err := os.ReadFile(open(s.Path))
	if err != nil {
		return secretFiles{}, fmt.Errorf("SDS secret %q: %w", s.Name, err)
	}
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return secretFiles{}, fmt.Errorf("SDS file %s: %w", s.Path, err)
	}
	var dr discoveryv3.DiscoveryResponse
	if err := protojson.Unmarshal(js, &dr); err != nil {
		return secretFiles{}, fmt.Errorf("SDS file %s: %w", s.Path, err)
	}
	if n := len(dr.GetResources()); n != 1 {
		return secretFiles{}, fmt.Errorf("SDS file %s: Unexpected SDS secrets length: %d", s.Path, n)
	}
	var secret tlsv3.Secret
	if err := unpack(dr.GetResources()[0], &secret); err != nil {
		return secretFiles{}, fmt.Errorf("SDS file %s: %w", s.Path, err)
	}
	if secret.GetName() != s.Name {
		return secretFiles{}, fmt.Errorf("SDS file %s: Unexpected SDS secret (expecting %s): %s", s.Path, s.Name, secret.GetName())
	}
	f := secretFiles{watch: []watch{watchFile(s.Path)}}
	if s.WatchedDir != "" {
		f.watch[0] = watch{dir: s.WatchedDir}
	}
	var dir string
	switch {
	case secret.GetTlsCertificate() != nil:
		tc := secret.GetTlsCertificate()
		if extra := setFields(tc, "certificate_chain", "private_key", "watched_directory"); len(extra) > 0 {
			return secretFiles{}, fmt.Errorf("SDS secret %q: TlsCertificate %v not emulated", s.Name, extra)
		}
		if f.cert, err = fileOf("certificate_chain", tc.GetCertificateChain()); err != nil {
			return secretFiles{}, err
		}
		if f.key, err = fileOf("private_key", tc.GetPrivateKey()); err != nil {
			return secretFiles{}, err
		}
		if f.cert == "" || f.key == "" {
			return secretFiles{}, fmt.Errorf("SDS secret %q: certificate_chain and private_key go together", s.Name)
		}
		dir = tc.GetWatchedDirectory().GetPath()
		if dir == "" {
			f.watch = append(f.watch, watchFile(f.cert), watchFile(f.key))
		}
	case secret.GetValidationContext() != nil:
		vc := secret.GetValidationContext()
		if extra := setFields(vc, "trusted_ca", "watched_directory"); len(extra) > 0 {
			return secretFiles{}, fmt.Errorf("SDS secret %q: CertificateValidationContext %v not emulated", s.Name, extra)
		}
		if f.ca, err = fileOf("trusted_ca", vc.GetTrustedCa()); err != nil {
			return secretFiles{}, err
		}
		dir = vc.GetWatchedDirectory().GetPath()
		if dir == "" {
			f.watch = append(f.watch, watchFile(f.ca))
		}
	default:
		return secretFiles{}, fmt.Errorf("SDS secret %q: neither tls_certificate nor validation_context: not emulated", s.Name)
	}
	if dir != "" {
		f.watch = append(f.watch, watch{dir: dir})
	}
	return f, nil
}

// sdsContext takes the secrets a common TLS context gets by SDS: the client
// certificate, and the trusted CA of a combined validation context, whose
// default context keeps the SAN matchers.
func (t *UpstreamTLS) sdsContext(ctc *tlsv3.CommonTlsContext) (*tlsv3.CertificateValidationContext, error) {
	if certs := ctc.GetTlsCertificateSdsSecretConfigs(); len(certs) > 0 {
		if len(certs) > 1 || len(ctc.GetTlsCertificates()) > 0 {
			return nil, errors.New("Multiple TLS certificates are not supported for client contexts") //nolint:staticcheck // Envoy's words
		}
		var err error
		if t.CertSDS, err = sdsFromProto(certs[0]); err != nil {
			return nil, err
		}
	}
	cvc := ctc.GetCombinedValidationContext()
	if cvc == nil {
		return ctc.GetValidationContext(), nil
	}
	if extra := setFields(cvc, "default_validation_context", "validation_context_sds_secret_config"); len(extra) > 0 {
		return nil, fmt.Errorf("combined_validation_context %v not emulated", extra)
	}
	var err error
	if t.CASDS, err = sdsFromProto(cvc.GetValidationContextSdsSecretConfig()); err != nil {
		return nil, err
	}
	if cvc.GetDefaultValidationContext().GetTrustedCa() != nil {
		return nil, errors.New("combined_validation_context: a trusted_ca in both the default context and the SDS secret is not emulated")
	}
	return cvc.GetDefaultValidationContext(), nil
}

// mounted maps a path of the bootstrap to the host through mounts, as a
// container's bind mounts do: the longest mount that holds it wins.
func mounted(mounts map[string]string, path string) string {
	best := ""
	for target := range mounts {
		if (path == target || strings.HasPrefix(path, target+"/")) && len(target) > len(best) {
			best = target
		}
	}
	if best == "" {
		return path
	}
	return filepath.Join(mounts[best], strings.TrimPrefix(path, best))
}

// Files are the files the TLS settings make Envoy read, as the bootstrap and
// the SDS files name them: the SDS files, and the certificate, key and CA
// files. The SDS files are read through mounts, for the names they hold.
func (t *UpstreamTLS) Files(mounts map[string]string) (sds, certs []string, err error) {
	certs = []string{t.CertFile, t.KeyFile, t.CAFile}
	for _, s := range []*SDSSecret{t.CertSDS, t.CASDS} {
		if s == nil {
			continue
		}
		f, err := s.read(func(p string) string { return mounted(mounts, p) })
		if err != nil {
			return nil, nil, err
		}
		sds = append(sds, s.Path)
		certs = append(certs, f.cert, f.key, f.ca)
	}
	return sds, slices.DeleteFunc(certs, func(f string) bool { return f == "" }), nil
}
