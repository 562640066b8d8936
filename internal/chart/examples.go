package chart

import "sigs.k8s.io/yaml"

// Example is a value set the chart is installed with, for the tests that render it (test/deploy)
// and apply the rendering to a real API server (test/k8s).
type Example struct {
	Name    string
	Release Release
	Values  string // YAML, over values.yaml
}

// Examples are the value sets `make test` renders: the defaults (the README's first Kubernetes
// path), Envoy Gateway in front instead of the standalone Envoy, SGLang, and everything else
// switched on in another release and namespace with Secrets of one's own.
var Examples = []Example{
	{Name: "defaults", Release: Release{Name: "pd-extproc", Namespace: "pd-extproc"}},
	{Name: "envoy-gateway", Release: Release{Name: "pd-extproc", Namespace: "pd-extproc"}, Values: `
envoy: {enabled: false}
gateway: {enabled: true}
`},
	{Name: "sglang", Release: Release{Name: "pd-extproc", Namespace: "pd-extproc"}, Values: `
config:
  connector: kv-sglang
  pools:
    # config/k8s/sglang-pd.yaml's engines publish no KV events.
    prefill: {kubernetes: {selector: pd-extproc.io/pool=prefill, port: http}, bootstrap_port: 8998, kv_events: null}
    decode: {kubernetes: {selector: pd-extproc.io/pool=decode, port: http}, kv_events: null}
`},
	{Name: "everything", Release: Release{Name: "router", Namespace: "llm"}, Values: `
image: {repository: registry.example.com/pd-extproc, tag: v0.1.0}
replicas: 3
clusterDomain: corp.internal
config:
  connector: kv-nixl
  pools:
    # Helm merges these keys into the defaults': null drops a default key (an InferencePool
    # gives the ports, and its own selector narrowed by the label).
    prefill: {kubernetes: {namespace: engines, inference_pool: vllm-prefill, port: null}}
    decode: {kubernetes: {namespace: engines, inference_pool: vllm-decode, port: null}, metrics: {interval: 1s},
      policy: prefix-affinity, tls: {enabled: true}}
  prefill: {tls: {enabled: true, server_name: vllm.engines.svc}}
  limits: {max_concurrent_streams: 4096}
  response: {rewrite_usage: true}
engineAPIKey: {secretName: engine-api-key, key: key}
engineCA: {secretName: engine-ca}
rbac: {inferencePools: true, extraNamespaces: [engines]}
tls:
  certManager: {enabled: false}
  serverSecret: router-server
  clientSecret: router-client
  clientSAN: spiffe://cluster.local/ns/llm/sa/envoy
envoy: {replicas: 3, service: {type: LoadBalancer}, listenAddress: "::"}
gateway: {enabled: true, name: llm-gateway, className: llm, xffTrustedHops: 1}
monitoring:
  serviceMonitor: {enabled: true, labels: {release: prometheus}}
  prometheusRule: {enabled: true}
  dashboard: {enabled: true}
`},
}

// ValuesMap is the example's values as Render takes them.
func (e Example) ValuesMap() (map[string]any, error) {
	out := map[string]any{}
	return out, yaml.Unmarshal([]byte(e.Values), &out)
}
