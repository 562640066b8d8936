package server

import (
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// handlersOptions are the ext_proc handlers' settings in cfg, with the
// collaborators they record to.
func handlersOptions(cfg *config.Config, m *metrics.Metrics, tp trace.TracerProvider, prop propagation.TextMapPropagator, logPrompts bool) handlers.Options {
	return handlers.Options{
		OverrideAfter:    cfg.Envoy.OverrideAfter.D(),
		OverrideTimeout:  cfg.Envoy.OverrideMessageTimeout.D(),
		Metrics:          m,
		TracerProvider:   tp,
		Propagator:       prop,
		LogPrompts:       logPrompts,
		MaxStreams:       cfg.Limits.MaxConcurrentStreams,
		RetryAfter:       cfg.Limits.RetryAfter.D(),
		BodyTimeout:      cfg.Limits.BodyTimeout.D(),
		MaxBufferedBytes: cfg.Limits.MaxBufferedBytes,
	}
}
