# syntax=docker/dockerfile:1
# pd-extproc image: the extproc service (entrypoint) and the pdsim engine simulator, as static
# binaries on distroless. Build from the repository root:
#   make image                      # docker build with the Makefile's GOEXPERIMENT, tag pd-extproc:dev
#   docker build -t pd-extproc:dev .
# Run pdsim from the same image with --entrypoint /usr/local/bin/pdsim. `make image` passes the
# version (git describe) and commit as build arguments; extproc --version and the
# pd_extproc_build_info metric report them, and so do the image's labels.

# The builder runs on the build host's platform and cross-compiles, so multi-arch builds
# (docker buildx --platform linux/amd64,linux/arm64) need no emulation.
FROM --platform=$BUILDPLATFORM golang:1.26 AS build
ARG TARGETOS
ARG TARGETARCH
# The Makefile's GOEXPERIMENT (make image passes it); simd: the AVX2 body scanner on amd64.
ARG GOEXPERIMENT=simd
ARG VERSION=dev
ARG REVISION=
WORKDIR /src

# Dependencies first: this layer and the module cache survive source-only changes.
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=bind,source=go.mod,target=go.mod \
    --mount=type=bind,source=go.sum,target=go.sum \
    go mod download

COPY . .
# CGO off: static binaries that run on distroless/static (no libc). -trimpath and -s -w keep
# build paths and debug tables out of the image. GOEXPERIMENT=simd (the default above): on
# amd64 the body scanner skips plain prompt text 32 bytes at a time with AVX2 (see the Makefile).
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=$TARGETOS GOARCH=$TARGETARCH GOEXPERIMENT=$GOEXPERIMENT \
    go build -trimpath -ldflags "-s -w -X github.com/pd-extproc/pd-extproc/pkg/version.Version=$VERSION -X github.com/pd-extproc/pd-extproc/pkg/version.Revision=$REVISION" \
    -o /out/ ./cmd/extproc ./cmd/pdsim

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
ARG REVISION=
LABEL org.opencontainers.image.title="pd-extproc" \
      org.opencontainers.image.description="Envoy external processor that routes vLLM and SGLang prefill/decode disaggregation" \
      org.opencontainers.image.source="https://github.com/pd-extproc/pd-extproc" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.revision="$REVISION"
COPY --from=build /out/extproc /out/pdsim /usr/local/bin/
# Numeric UID/GID (distroless "nonroot") so Kubernetes can verify runAsNonRoot.
USER 65532:65532
# 9002: ext_proc gRPC; 9090: admin HTTP (/healthz, /readyz, /metrics).
EXPOSE 9002 9090
ENTRYPOINT ["/usr/local/bin/extproc"]
