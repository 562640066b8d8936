// Package secretfiles keeps what is made of files holding secrets (a TLS
// key pair, a CA bundle, an engine API key) and makes it again when one of
// them changes, so that a rotation (cert-manager, a Kubernetes Secret's
// volume) needs no restart.
package secretfiles

import (
	"crypto/x509"
	"fmt"
	"os"
	"sync"
)

// Files is a value made of files by load, made again when they change.
type Files[T any] struct {
	paths []string
	load  func() (T, error)

	mu    sync.Mutex
	read  []os.FileInfo // the files as load read them
	value T
	made  bool
}

// New is load's value of the files at paths (empty paths are left out).
func New[T any](load func() (T, error), paths ...string) *Files[T] {
	f := &Files[T]{load: load}
	for _, p := range paths {
		if p != "" {
			f.paths = append(f.paths, p)
		}
	}
	return f
}

// Current is the value as the files are now, made again when one changed
// (another file, size or modification time, through symlinks: a Secret's
// volume swaps its ..data link); fresh says it was. A change that cannot be
// read, or made into a value, keeps the value made before, returned with the
// error (a rotation half written); with none made before, the error alone.
// Each call stats the files: cheap enough for every handshake.
func (f *Files[T]) Current() (value T, fresh bool, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var read []os.FileInfo
	for _, p := range f.paths {
		st, serr := os.Stat(p)
		if serr != nil {
			err = serr
			break
		}
		read = append(read, st)
	}
	if err == nil {
		if f.made && same(read, f.read) {
			return f.value, false, nil
		}
		var v T
		if v, err = f.load(); err == nil {
			f.value, f.read, f.made = v, read, true
			return v, true, nil
		}
	}
	return f.value, false, err
}

func same(a, b []os.FileInfo) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !os.SameFile(a[i], b[i]) || a[i].Size() != b[i].Size() || !a[i].ModTime().Equal(b[i].ModTime()) {
			return false
		}
	}
	return true
}

// CAPool reads a PEM bundle of CA certificates.
func CAPool(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("no PEM certificate in %s", path)
	}
	return pool, nil
}
