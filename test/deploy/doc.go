// Package deploy checks the deployment artefacts users copy: the Envoy bootstraps in
// config/envoy, the docker compose demo, the Envoy Gateway manifests and the plain Kubernetes
// manifests. No Envoy, Docker engine or cluster is needed: the Envoy configs go through Envoy's
// own proto validation plus the routing rules pd-extproc depends on, and the compose and
// Gateway files go through the real tools (docker-compose, egctl) when they are installed.
package deploy
