// The shipped Envoy configs against the API of the Envoy release the images run (v1.39), whose
// protos go-control-plane publishes as envoy v1.39.0. A module of its own: the main module's
// gRPC (v1.85) needs go-control-plane's v1.40 protos, so it cannot pin v1.39 itself.
module github.com/pd-extproc/pd-extproc/test/envoyapi

go 1.26.0

require (
	github.com/envoyproxy/go-control-plane/envoy v1.39.0
	google.golang.org/protobuf v1.36.11
	sigs.k8s.io/yaml v1.6.0
)

require (
	cel.dev/expr v0.25.1 // indirect
	github.com/cncf/xds/go v0.0.0-20260202195803-dba9d589def2 // indirect
	github.com/envoyproxy/protoc-gen-validate v1.3.3 // indirect
	github.com/planetscale/vtprotobuf v0.6.1-0.20240319094008-0393e58bdf10 // indirect
	go.yaml.in/yaml/v2 v2.4.2 // indirect
	golang.org/x/net v0.55.0 // indirect
	golang.org/x/sys v0.45.0 // indirect
	golang.org/x/text v0.37.0 // indirect
	google.golang.org/genproto/googleapis/api v0.0.0-20260414002931-afd174a4e478 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260414002931-afd174a4e478 // indirect
	google.golang.org/grpc v1.82.0 // indirect
)
