// Package version says which build of pd-extproc runs. The Makefile and the
// Dockerfile stamp Version and Revision at link time (-ldflags -X, from git
// describe and git rev-parse); `extproc --version`, the start-up log line and
// the pd_extproc_build_info metric read them here.
package version

import (
	"runtime"
	"runtime/debug"
)

// Set at link time: -X github.com/pd-extproc/pd-extproc/pkg/version.Version=v0.1.0.
var (
	// Version is `git describe --tags --always --dirty` of the build: a
	// release tag, or the commit past it. "dev" when nothing stamped it
	// (go build, go install).
	Version = "dev"
	// Revision is the full commit; empty when nothing stamped it, then the
	// commit Go records for a build in a git checkout is used.
	Revision = ""
)

// Info is the build: what --version prints and build_info carries.
type Info struct {
	Version, Revision, GoVersion string
}

// Get returns the build's version, revision and Go release.
func Get() Info {
	info := Info{Version: Version, Revision: Revision, GoVersion: runtime.Version()}
	if info.Revision == "" {
		if bi, ok := debug.ReadBuildInfo(); ok {
			for _, s := range bi.Settings {
				if s.Key == "vcs.revision" {
					info.Revision = s.Value
				}
			}
		}
	}
	return info
}

// String is the line --version prints.
func (i Info) String() string {
	rev := i.Revision
	if rev == "" {
		rev = "unknown"
	}
	return "extproc " + i.Version + " (revision " + rev + ", " + i.GoVersion + ")"
}
