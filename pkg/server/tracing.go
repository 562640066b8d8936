package server

import (
	"context"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// ServiceName is the OpenTelemetry service.name unless OTEL_SERVICE_NAME says otherwise.
const ServiceName = "pd-extproc"

// TracingEnabled reports whether cfg or the standard OpenTelemetry environment
// turn tracing on: an endpoint in tracing.otlp_endpoint or in
// OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, and OTEL_SDK_DISABLED not true.
func TracingEnabled(cfg config.Tracing) bool {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return false
	}
	return cfg.OTLPEndpoint != "" || os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// newTracerProvider returns the provider cfg asks for and the func that
// flushes it: OTLP/gRPC export with parent-based ratio sampling when tracing
// is enabled, otherwise a no-op that still lets the caller's traceparent pass
// through to the prefill engines.
func newTracerProvider(ctx context.Context, cfg config.Tracing) (trace.TracerProvider, func(context.Context) error, error) {
	if !TracingEnabled(cfg) {
		return noop.NewTracerProvider(), func(context.Context) error { return nil }, nil
	}
	var opts []otlptracegrpc.Option
	if cfg.OTLPEndpoint != "" {
		opts = append(opts, otlptracegrpc.WithEndpointURL(cfg.OTLPEndpoint)) // plaintext for http://
	}
	exporter, err := otlptracegrpc.New(ctx, opts...) // connects lazily: a collector that is down costs no startup
	if err != nil {
		return nil, nil, fmt.Errorf("tracing: %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(ServiceName)),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
		resource.WithTelemetrySDK(),
	)
	if err != nil {
		return nil, nil, fmt.Errorf("tracing: %w", err)
	}
	ratio := config.DefaultSampleRatio
	if cfg.SampleRatio != nil {
		ratio = *cfg.SampleRatio
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exporter),
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio))),
	)
	return tp, tp.Shutdown, nil
}
