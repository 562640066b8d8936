package config

import (
	"errors"
	"fmt"
	"net/url"
)

// DefaultSampleRatio samples every new trace: pd-extproc sees one request per
// LLM call, a rate at which full tracing is cheap.
const DefaultSampleRatio = 1.0

// Tracing configures OpenTelemetry tracing (the tracing key). It is off unless
// OTLPEndpoint or the standard OTEL_EXPORTER_OTLP_ENDPOINT (or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) environment variable is set; the key wins
// over the variable.
type Tracing struct {
	// OTLPEndpoint is the URL of an OTLP/gRPC collector: http://host:4317 for
	// plaintext, https://host:4317 for TLS.
	OTLPEndpoint string `json:"otlp_endpoint,omitempty"`
	// SampleRatio is the fraction of new traces recorded, 0..1. A request that
	// arrives with a traceparent follows its caller's sampled flag instead.
	SampleRatio *float64 `json:"sample_ratio,omitempty"`
}

// SetDefaults fills the keys left out.
func (t *Tracing) SetDefaults() {
	if t.SampleRatio == nil {
		r := DefaultSampleRatio
		t.SampleRatio = &r
	}
}

// Validate names the offending key under key.
func (t Tracing) Validate(key string) error {
	var errs []error
	if t.OTLPEndpoint != "" {
		u, err := url.Parse(t.OTLPEndpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			errs = append(errs, fmt.Errorf("%s.otlp_endpoint: %q is not an http:// or https:// URL such as http://otel-collector:4317", key, t.OTLPEndpoint))
		}
	}
	if r := t.SampleRatio; r != nil && !(*r >= 0 && *r <= 1) {
		errs = append(errs, fmt.Errorf("%s.sample_ratio: %v is not between 0 and 1", key, *r))
	}
	return errors.Join(errs...)
}
