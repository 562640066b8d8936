package config

import (
	"strings"
	"testing"
)

func TestTracingKeys(t *testing.T) {
	const pools = "connector: kv-nixl\n" + `pools: {decode: {endpoints: ["10.0.0.2:8000"]}}` + "\n"
	tests := []struct {
		name, yaml   string
		wantErr      string // "" when valid
		wantEndpoint string
		wantRatio    float64
	}{
		{name: "off by default, every trace sampled once on", yaml: pools, wantRatio: 1},
		{name: "plaintext collector and a ratio", yaml: pools + `tracing: {otlp_endpoint: "http://otel-collector:4317", sample_ratio: 0.25}`,
			wantEndpoint: "http://otel-collector:4317", wantRatio: 0.25},
		{name: "zero ratio is kept, not defaulted", yaml: pools + `tracing: {otlp_endpoint: "https://c:4317", sample_ratio: 0}`,
			wantEndpoint: "https://c:4317", wantRatio: 0},
		{name: "host:port without a scheme", yaml: pools + `tracing: {otlp_endpoint: "otel-collector:4317"}`, wantErr: "tracing.otlp_endpoint"},
		{name: "ratio above 1", yaml: pools + `tracing: {sample_ratio: 1.5}`, wantErr: "tracing.sample_ratio"},
		{name: "negative ratio", yaml: pools + `tracing: {sample_ratio: -0.1}`, wantErr: "tracing.sample_ratio"},
		{name: "misspelt key", yaml: pools + `tracing: {endpoint: "http://c:4317"}`, wantErr: `unknown field "tracing.endpoint"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.yaml))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Parse() error = %v, want one naming %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Tracing.OTLPEndpoint != tt.wantEndpoint || *c.Tracing.SampleRatio != tt.wantRatio {
				t.Errorf("tracing = {%q, %v}, want {%q, %v}", c.Tracing.OTLPEndpoint, *c.Tracing.SampleRatio, tt.wantEndpoint, tt.wantRatio)
			}
		})
	}
}
