# pd-extproc — build, test, run.
# Tools that tests need (grpcurl, egctl, docker-compose) are installed once into
# TOOLS_BIN, outside the checkout, so a clean clone on the same machine reuses them.

GO        ?= go
BIN       := bin
TOOLS_BIN ?= $(HOME)/.cache/pd-extproc/bin
export PATH := $(TOOLS_BIN):$(PATH)

# The body scanner (pkg/body) skips plain prompt text 32 bytes at a time with AVX2
# when built with Go 1.26's experimental simd/archsimd package, and 8 at a time
# without it (as `go install` builds it). Everything here, and the Docker image,
# builds with the experiment; `make test` also tests pkg/body without it.
export GOEXPERIMENT ?= simd

GRPCURL_VERSION  := v1.9.4
EGCTL_VERSION    := v1.9.1
KUBE_VERSION     := v1.37.2
ETCD_VERSION     := v3.7.3
DEADCODE_VERSION := v0.52.0
PROMTOOL_VERSION := v0.316.0
K8S_TOOLS        := $(TOOLS_BIN)/kube-apiserver $(TOOLS_BIN)/etcd

.PHONY: all build test tools run bench clean image certs grpcurl version release-dry-run

all: build

# The version every artifact carries: the binaries (extproc --version, pd_extproc_build_info),
# the image's tag and labels, the packaged chart's version and appVersion. A release tag
# (v0.1.0), or the commit past the last one (v0.1.0-3-gabc1234, -dirty with local changes);
# the short commit while no tag exists. Override for a release: make release-dry-run VERSION=v0.1.0
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
LDFLAGS  := -X github.com/pd-extproc/pd-extproc/pkg/version.Version=$(VERSION) \
            -X github.com/pd-extproc/pd-extproc/pkg/version.Revision=$(REVISION)

version:
	@echo $(VERSION)

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/...

# The container image of the Dockerfile (extproc, with pdsim beside it), built with this
# Makefile's GOEXPERIMENT and VERSION. Needs Docker with BuildKit. pd-extproc:dev is the tag the
# chart in charts/pd-extproc runs from a checkout (its appVersion); for your registry:
#   make image IMAGE=registry.example.com/pd-extproc:$(make -s version)
# (kind: `kind load docker-image pd-extproc:dev`). Not run by `make test`.
IMAGE ?= pd-extproc:dev
image:
	DOCKER_BUILDKIT=1 docker build --build-arg GOEXPERIMENT=$(GOEXPERIMENT) --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) -t $(IMAGE) .

# What a release would publish, built here and published nowhere: extproc and pdsim for
# linux/amd64 and linux/arm64 in bin/release/, the chart packaged with VERSION as its
# appVersion and REGISTRY as its image (hack/release, Helm's Go library: no helm binary), then
# the commands that would build and push the multi-arch image and the chart (printed, not run).
REGISTRY    ?= registry.example.com/pd-extproc
RELEASE_DIR := $(BIN)/release
release-dry-run:
	@rm -rf $(RELEASE_DIR)
	@for arch in amd64 arm64; do \
		echo "== linux/$$arch"; \
		CGO_ENABLED=0 GOOS=linux GOARCH=$$arch $(GO) build -trimpath -ldflags "-s -w $(LDFLAGS)" \
			-o $(RELEASE_DIR)/linux-$$arch/ ./cmd/extproc ./cmd/pdsim || exit 1; \
	done
	@echo "== the chart"
	@$(GO) run ./hack/release -version $(VERSION) -image $(REGISTRY) -out $(RELEASE_DIR)
	@echo "== the image and the chart (not run):"
	@echo "  docker buildx build --platform linux/amd64,linux/arm64 --build-arg GOEXPERIMENT=$(GOEXPERIMENT) \\"
	@echo "    --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) -t $(REGISTRY):$(VERSION) --push ."
	@echo "  helm push $(RELEASE_DIR)/pd-extproc-*.tgz oci://$(dir $(REGISTRY))charts"

# Development certificates for the mTLS between Envoy and pd-extproc, for the compose demo
# (config/envoy/docker-compose.yaml): hack/certs.sh, with OpenSSL. Kept until removed.
CERTS_DIR ?= config/envoy/certs
certs: $(CERTS_DIR)/envoy/tls.crt
$(CERTS_DIR)/envoy/tls.crt:
	bash hack/certs.sh $(CERTS_DIR)

# grpcurl alone, for trying the gRPC service by hand (README).
grpcurl: $(TOOLS_BIN)/grpcurl

# The scheduling simulation's targets (pkg/scheduling, TestSimulated*) run once more
# without the race detector, which makes them some eight times slower and skips them.
# test/envoyapi is a module of its own (the shipped Envoy configs against Envoy v1.39's API).
test: tools
	@unformatted=$$("$$($(GO) env GOROOT)/bin/gofmt" -l .); if [ -n "$$unformatted" ]; then echo "gofmt -w these files:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...
	@dead=$$(deadcode -test ./...) || exit 1; if [ -n "$$dead" ]; then echo "nothing reaches these, tests included: delete them"; echo "$$dead"; exit 1; fi
	$(GO) test -race -count=1 ./...
	GOEXPERIMENT= $(GO) test -count=1 ./pkg/body/
	cd test/envoyapi && $(GO) vet ./... && $(GO) test -count=1 ./...
	$(GO) test -count=1 -run '^TestSimulated' ./pkg/scheduling/

tools: $(TOOLS_BIN)/grpcurl $(TOOLS_BIN)/egctl $(TOOLS_BIN)/deadcode $(TOOLS_BIN)/promtool $(K8S_TOOLS) docker-compose

$(TOOLS_BIN)/grpcurl:
	GOBIN=$(TOOLS_BIN) $(GO) install github.com/fullstorydev/grpcurl/cmd/grpcurl@$(GRPCURL_VERSION)

# deadcode (golang.org/x/tools): `make test` fails on a function that nothing reaches from a
# main or a test, which is code to delete.
$(TOOLS_BIN)/deadcode:
	GOBIN=$(TOOLS_BIN) $(GO) install golang.org/x/tools/cmd/deadcode@$(DEADCODE_VERSION)

# promtool (Prometheus, the version go.mod's PromQL parser is of): test/deploy evaluates the
# chart's alerts that add up several replicas on series written for them (promtool test rules).
# About 8 minutes to build once.
$(TOOLS_BIN)/promtool:
	GOBIN=$(TOOLS_BIN) $(GO) install github.com/prometheus/prometheus/cmd/promtool@$(PROMTOOL_VERSION)

# egctl takes about 5 minutes to build; it is built once and cached in TOOLS_BIN.
$(TOOLS_BIN)/egctl:
	GOBIN=$(TOOLS_BIN) $(GO) install github.com/envoyproxy/gateway/cmd/egctl@$(EGCTL_VERSION)

# test/k8s runs a real Kubernetes API server and etcd, built from the Go module proxy
# (hack/k8s-tools.sh: about 7 minutes once on 2 cores with an empty build cache, 4½ with a warm
# one, then cached in TOOLS_BIN; with egctl's 5 and promtool's 8, a first `make test` spends about 20
# on tools).
# The script builds whichever of the two is missing, once for both (a grouped target).
$(K8S_TOOLS) &:
	GO=$(GO) TOOLS_BIN=$(TOOLS_BIN) KUBE_VERSION=$(KUBE_VERSION) ETCD_VERSION=$(ETCD_VERSION) bash hack/k8s-tools.sh

# test/deploy runs `docker-compose config` on config/envoy/docker-compose.yaml; that needs no
# Docker engine. The Compose v2 plugin serves as well; otherwise Debian's docker-compose
# package is installed when running as root (CI). Without either, that one test skips.
.PHONY: docker-compose
docker-compose:
	@docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y docker-compose; \
	else \
		echo "docker-compose not found and cannot apt-get install it: the compose check will skip"; \
	fi

# The 5-minute demo: extproc, a prefill and a decode simulator, and the Envoy
# emulator on 127.0.0.1:8080. Ctrl-C stops everything.
run: build
	$(GO) build -o $(BIN)/demo ./test/demo
	$(BIN)/demo

# Benchmarks, not part of test (docs/benchmarks.md): extproc P/D and decode-only
# against an echo ext_proc server, the floor; 7-9 minutes on 2 cores. The
# driver starts every server itself; the report also goes to $(BIN)/bench.md.
# BENCH_FLAGS adds driver flags, e.g. BENCH_FLAGS="-sizes 2MiB -pprof-dir /tmp/prof".
bench:
	$(GO) build -o $(BIN)/ ./cmd/... ./bench/echo
	$(GO) run ./bench/load -bin $(BIN) -duration 3s -out $(BIN)/bench.md $(BENCH_FLAGS)

# The scale of Kubernetes discovery (docs/kubernetes.md): 1,000 pods in a pool, 100 pod writes
# per second for 60 s, on the real API server of test/k8s. About 2 minutes; not part of test.
.PHONY: bench-k8s
bench-k8s: $(K8S_TOOLS)
	$(GO) test -run '^$$' -bench Discovery -benchtime 1x -timeout 20m ./test/k8s/

clean:
	rm -rf $(BIN)

# Each fuzz target of the repo, FUZZTIME each (plain `go test`, hence `make test`,
# runs only their seed corpora). Targets are found in the sources, so new ones join.
FUZZTIME ?= 60s
.PHONY: fuzz
fuzz:
	@set -e; grep -rHo --include='*_test.go' '^func Fuzz[A-Za-z0-9_]*' cmd internal pkg test | sort | \
	while IFS=: read -r file fn; do \
		target=$${fn#func }; \
		echo "== $$target ./$$(dirname $$file) ($(FUZZTIME))"; \
		$(GO) test -run '^$$' -fuzz "^$$target\$$" -fuzztime $(FUZZTIME) ./$$(dirname $$file); \
	done

# Mixed traffic with injected faults through the Envoy emulator, extproc and the
# engine simulators on loopback; prints the outcome table, latencies, goroutines
# and RSS. Not part of `make test`.
SOAK_DURATION ?= 60s
.PHONY: soak
soak:
	$(GO) run ./test/soak -duration $(SOAK_DURATION)

# 10,000 streaming generations held at once through two Envoy emulator processes and two
# ext_proc replicas (extproc P/D, extproc decode-only, and bench/echo beside them), with the
# response path on and off: requests lost or failed, and memory, goroutines and CPU per held
# stream (docs/benchmarks.md, "Held streams"). About 15 minutes on 2 cores; not part of
# `make test`. SCALE_FLAGS adds flags, e.g. SCALE_FLAGS="-streams 2000 -targets decode,echo".
.PHONY: soak-scale
soak-scale:
	$(GO) build -o $(BIN)/ ./cmd/... ./bench/echo
	$(GO) run ./test/scale -bin $(BIN) -out $(BIN)/scale.md -pprof-dir $(BIN)/scale-pprof $(SCALE_FLAGS)
