package config

import (
	"strings"
	"testing"
)

func TestKubernetesPools(t *testing.T) {
	c, err := Parse([]byte(`
connector: kv-nixl
pools:
  prefill:
    kubernetes: {namespace: llm, selector: "app=vllm,llm-d.ai/role=prefill", port: 8000}
  decode:
    kubernetes: {inference_pool: vllm-pool, selector: "llm-d.ai/role in (decode)"}
`))
	if err != nil {
		t.Fatal(err)
	}
	p, d := c.Pools.Prefill.Kubernetes, c.Pools.Decode.Kubernetes
	if p.Namespace != "llm" || p.Port.Number != 8000 || p.Port.Name != "" || d.InferencePool != "vllm-pool" || d.Port != nil {
		t.Errorf("parsed %+v and %+v", p, d)
	}
	if got := d.ParsedSelector().String(); got != "llm-d.ai/role in (decode)" {
		t.Errorf("decode selector = %q", got)
	}
	named, err := Parse([]byte(`{connector: kv-sglang, pools: {decode: {kubernetes: {selector: app=sglang, port: http}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if port := named.Pools.Decode.Kubernetes.Port; port.Name != "http" || port.String() != "http" {
		t.Errorf("named port = %+v", port)
	}
}

func TestKubernetesValidationNamesTheKey(t *testing.T) {
	tests := []struct {
		name, pool, wantKey string
	}{
		{"no selector", `{port: 8000}`, "pools.decode.kubernetes.selector"},
		{"empty label value", `{selector: "app=", port: 8000}`, ""}, // selects app with an empty value: valid
		{"unparsable selector", `{selector: "app in vllm", port: 8000}`, "pools.decode.kubernetes.selector"},
		{"no port", `{selector: app=vllm}`, "pools.decode.kubernetes.port"},
		{"port out of range", `{selector: app=vllm, port: 70000}`, "pools.decode.kubernetes.port"},
		{"bad port name", `{selector: app=vllm, port: "Not_A_Name"}`, "pools.decode.kubernetes.port"},
		{"port is a list", `{selector: app=vllm, port: [8000]}`, "port number or a container port name"},
		{"port with inference_pool", `{inference_pool: vllm, port: 8000}`, "pools.decode.kubernetes.port: not with inference_pool"},
		{"bad inference_pool", `{inference_pool: Vllm_Pool}`, "pools.decode.kubernetes.inference_pool"},
		{"bad namespace", `{namespace: LLM, selector: app=vllm, port: 8000}`, "pools.decode.kubernetes.namespace"},
		{"misspelt key", `{selectors: app=vllm, port: 8000}`, `unknown field "pools.decode.kubernetes.selectors"`},
		{"inference_pool alone", `{inference_pool: vllm-pool}`, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(`{connector: kv-nixl, pools: {decode: {kubernetes: ` + tc.pool + `}}}`))
			switch {
			case tc.wantKey == "" && err != nil:
				t.Errorf("Parse() = %v, want it valid", err)
			case tc.wantKey != "" && (err == nil || !strings.Contains(err.Error(), tc.wantKey)):
				t.Errorf("Parse() error = %v, want one naming %q", err, tc.wantKey)
			}
		})
	}
}
