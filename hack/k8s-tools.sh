#!/usr/bin/env bash
# Builds the Kubernetes API server and etcd that test/k8s runs, from the Go
# module proxy, into $TOOLS_BIN (default ~/.cache/pd-extproc/bin). A binary
# that is already there is kept. Each is built in a throwaway wrapper module in
# a temporary directory, so the repository stays one Go module:
#
#   kube-apiserver  k8s.io/kubernetes $KUBE_VERSION, cmd/kube-apiserver. The
#                   kubernetes module names its k8s.io/* staging modules as
#                   ./staging paths; the wrapper replaces each with its
#                   published release (v0.X.Y for kubernetes v1.X.Y).
#   etcd            go.etcd.io/etcd/server/v3 $ETCD_VERSION, etcdmain.
#
# About 7 minutes for both on 2 cores with an empty build cache, 4½ with a
# warm one (docs/kubernetes.md); a cold module cache adds the downloads.
set -euo pipefail

GO=${GO:-go}
TOOLS_BIN=${TOOLS_BIN:-$HOME/.cache/pd-extproc/bin}
KUBE_VERSION=${KUBE_VERSION:-v1.37.2}
ETCD_VERSION=${ETCD_VERSION:-v3.7.3}
STAGING_VERSION=v0.${KUBE_VERSION#v1.}

mkdir -p "$TOOLS_BIN"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The wrappers are their own modules: no workspace, no vendor directory, and
# no GOFLAGS of the caller's that would point elsewhere.
export GOWORK=off GOFLAGS=-mod=mod
unset GOEXPERIMENT

if [ ! -x "$TOOLS_BIN/kube-apiserver" ]; then
	echo "building kube-apiserver $KUBE_VERSION into $TOOLS_BIN (a few minutes, once)"
	mkdir "$work/kube"
	cd "$work/kube"
	gomod=$("$GO" mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p')
	{
		echo "module kubeapiserverwrapper"
		echo
		echo "go 1.26"
		echo
		echo "require k8s.io/kubernetes $KUBE_VERSION"
		echo
		echo "replace ("
		grep -E '^\s+k8s.io/[a-z0-9-]+ => ./staging' "$gomod" |
			awk -v v="$STAGING_VERSION" '{print "\t" $1 " => " $1 " " v}'
		echo ")"
	} >go.mod
	printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/kube-apiserver"\n' >tools.go
	"$GO" mod tidy
	ver=k8s.io/component-base/version
	"$GO" build -trimpath -o "$TOOLS_BIN/kube-apiserver.tmp" \
		-ldflags "-s -w -X $ver.gitVersion=$KUBE_VERSION -X $ver.gitMajor=1 -X $ver.gitMinor=$(echo "$KUBE_VERSION" | cut -d. -f2) -X $ver.gitTreeState=clean" \
		k8s.io/kubernetes/cmd/kube-apiserver
	mv "$TOOLS_BIN/kube-apiserver.tmp" "$TOOLS_BIN/kube-apiserver"
fi

if [ ! -x "$TOOLS_BIN/etcd" ]; then
	echo "building etcd $ETCD_VERSION into $TOOLS_BIN"
	mkdir "$work/etcd"
	cd "$work/etcd"
	printf 'module etcdwrapper\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" >go.mod
	printf 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n' >main.go
	"$GO" mod tidy
	"$GO" build -trimpath -ldflags "-s -w" -o "$TOOLS_BIN/etcd.tmp" .
	mv "$TOOLS_BIN/etcd.tmp" "$TOOLS_BIN/etcd"
fi
