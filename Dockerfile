# syntax=docker/dockerfile:1
# pd-extproc image: the extproc service (entrypoint) and the pdsim engine simulator, as static
# binaries on distroless. Build from the repository root:
#   make image                      # docker build with the Makefile's GOEXPERIMENT, tag pd-extproc:dev
#   docker build -t pd-extproc:dev .
# Run pdsim from the same image with --entrypoint /usr/local/bin/pdsim.

# The builder runs on the build host's platform and cross-compiles, so multi-arch builds
# (docker buildx --platform linux/amd64,linux/arm64) need no emulation.
FROM --platform=$BUILDPLATFORM golang:1.26 AS build
ARG TARGETOS
ARG TARGETARCH
# The Makefile's GOEXPERIMENT (make image passes it); simd: the AVX2 body scanner on amd64.
ARG GOEXPERIMENT=simd
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
    go build -trimpath -ldflags "-s -w" -o /out/ ./cmd/extproc ./cmd/pdsim

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/extproc /out/pdsim /usr/local/bin/
# Numeric UID/GID (distroless "nonroot") so Kubernetes can verify runAsNonRoot.
USER 65532:65532
# 9002: ext_proc gRPC; 9090: admin HTTP (/healthz, /readyz, /metrics).
EXPOSE 9002 9090
ENTRYPOINT ["/usr/local/bin/extproc"]
