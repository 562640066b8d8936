// Package server assembles pd-extproc from a config: the pipeline, the ext_proc
// gRPC service with health and reflection, the admin HTTP endpoints, metrics,
// tracing and readiness; and it shuts them down in order. cmd/extproc only
// parses flags, builds the logger and hands the process's signals on, so
// everything a user relies on at run time is testable here.
package server

import (
	"context"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/discovery"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/server/assemble"
)

// grpcHeadroom is added to the body limit for the rest of an ext_proc message.
const grpcHeadroom = 1 << 20

// DefaultHealthInterval is how often readiness re-reads the pools.
const DefaultHealthInterval = time.Second

// Options are the run-time settings that come from flags, not the config file.
type Options struct {
	// Grace bounds how long in-flight streams may finish once the listener
	// closes; 0 cuts them at once.
	Grace time.Duration
	// ShutdownDelay is how long, once shutdown begins, new streams are still
	// accepted and served while readiness says not serving, so that a client's
	// health checks take this server out of rotation before the listener
	// closes; 0 closes it at once.
	ShutdownDelay time.Duration
	// Signals, when set, are the process's signals: SIGTERM or an interrupt
	// begins the shutdown as a done ctx does, the next one ends the
	// shutdown delay, and one in the grace cuts the streams in flight;
	// SIGHUP has ConfigPath read again at once.
	Signals <-chan os.Signal
	// Pprof serves net/http/pprof under /debug/pprof/ on the admin address.
	Pprof bool
	// LogPrompts adds request bodies to the per-request log lines.
	LogPrompts bool
	// HealthInterval is how often readiness re-reads the pools; 0 means
	// DefaultHealthInterval.
	HealthInterval time.Duration
	// TracerProvider, when set, replaces the one the config's tracing key
	// describes (and is not shut down by the server).
	TracerProvider trace.TracerProvider
	// Endpoints, when set, replaces the pipeline's pools as the source of
	// endpoint state for readiness and the endpoint metrics.
	Endpoints func() []metrics.EndpointState
	// TLS, when it names a certificate, serves ext_proc over TLS (mTLS with a
	// client CA).
	TLS TLSFiles
	// ConfigPath, when set, is watched: a valid new file updates the pools,
	// policies and P/D thresholds in place, and the log names every other key
	// it changes (those take effect on restart); an invalid one is logged and
	// ignored.
	ConfigPath string
	// Kubeconfig is the credentials file of pools discovered from Kubernetes
	// (pools.<pool>.kubernetes); empty: in-cluster, else KUBECONFIG.
	Kubeconfig string
	// Keepalive watches the connections from Envoy; zero fields are
	// DefaultKeepalive's.
	Keepalive Keepalive
}

// Server is a configured pd-extproc, ready to Serve.
type Server struct {
	opts            Options
	log             logr.Logger
	cfg             *config.Config // as loaded; the config watch reloads only a different one
	pipeline        *pipeline.Pipeline
	discovery       *discovery.Discovery // nil: no pool is discovered from Kubernetes
	metrics         *metrics.Metrics
	grpc            *grpc.Server
	ready           *readiness
	admin           *http.Server
	shutdownTracing func(context.Context) error
	draining        chan struct{}                        // closed when shutdown begins
	reread          chan struct{}                        // SIGHUP: the config watch reads the file now
	after           func(time.Duration) <-chan time.Time // time.After, or a test's clock
}

// New builds a server from a validated config. It listens on nothing yet.
func New(cfg *config.Config, opts Options, log logr.Logger) (*Server, error) {
	if opts.HealthInterval <= 0 {
		opts.HealthInterval = DefaultHealthInterval
	}
	s := &Server{opts: opts, log: log, cfg: cfg, metrics: metrics.New(cfg.Connector), draining: make(chan struct{}),
		reread: make(chan struct{}, 1), after: time.After}
	s.metrics.Limits(cfg.Limits.MaxConcurrentStreams, cfg.Limits.MaxBufferedBytes, cfg.Prefill.MaxBackground)
	tp := opts.TracerProvider
	s.shutdownTracing = func(context.Context) error { return nil }
	if tp == nil {
		var err error
		if tp, s.shutdownTracing, err = newTracerProvider(context.Background(), cfg.Tracing); err != nil {
			return nil, err
		}
	}
	prop := propagation.TraceContext{}

	p, err := assemble.Pipeline(cfg, log.WithName("pipeline"), pipeline.WithMetrics(s.metrics), pipeline.WithTracing(tp, prop))
	if err != nil {
		s.shutdownTracing(context.Background())
		return nil, err
	}
	s.pipeline = p
	prefill, decode := p.Pools()
	endpoints := opts.Endpoints
	if endpoints == nil {
		endpoints = poolStates(prefill, decode)
	}
	s.metrics.WatchEndpoints(endpoints)
	s.metrics.WatchKVEvents(kvEventStates(prefill, decode))
	s.metrics.WatchHeld(p.Held)

	grpcOpts := append([]grpc.ServerOption{grpc.MaxRecvMsgSize(int(cfg.Limits.MaxBodyBytes) + grpcHeadroom)}, opts.Keepalive.serverOptions()...)
	creds, err := opts.TLS.credentials(log.WithName("tls"))
	if err != nil {
		s.shutdownTracing(context.Background())
		return nil, err
	}
	if creds != nil {
		grpcOpts = append(grpcOpts, grpc.Creds(creds))
	}
	s.grpc = grpc.NewServer(grpcOpts...)
	extprocv3.RegisterExternalProcessorServer(s.grpc, handlers.NewServer(p, handlersOptions(cfg, s.metrics, tp, prop, opts.LogPrompts), log.WithName("extproc")))
	hs := health.NewServer()
	healthpb.RegisterHealthServer(s.grpc, drainedHealth{Server: hs, draining: s.draining})
	reflection.Register(s.grpc)

	if s.discovery, err = s.newDiscovery(cfg, prefill, decode, opts.Kubeconfig, log.WithName("discovery")); err != nil {
		s.shutdownTracing(context.Background())
		return nil, err
	}
	needed := []string{decode.Name()}
	if p.Paired() { // its decode engines serve only pairs: nothing goes decode-only
		needed = append(needed, prefill.Name())
	}
	s.ready = newReadiness(hs, needed, endpoints, log.WithName("health"))
	if s.discovery != nil {
		s.ready.discovery = s.discovery.Status
	}
	s.ready.update() // serving from the first health check on, when the pool allows
	s.admin = &http.Server{Handler: s.adminMux(), ReadHeaderTimeout: 10 * time.Second}
	warnNoPool(log, opts.ConfigPath, cfg, s.pairedConnector())
	warnConfig(log, cfg)
	return s, nil
}

// Serve serves ext_proc on grpcLis and the admin endpoints on adminLis until
// ctx is done, SIGTERM or an interrupt arrives or a listener fails, then
// shuts down: readiness goes false first, new streams are still served for
// Options.ShutdownDelay, in-flight streams get Options.Grace to finish,
// background prefill legs end, traces are flushed, and the admin server
// stops last.
func (s *Server) Serve(ctx context.Context, grpcLis, adminLis net.Listener) error {
	pollCtx, stopPolling := context.WithCancel(context.Background())
	var polling sync.WaitGroup
	polling.Go(func() { s.ready.run(pollCtx, s.opts.HealthInterval) })
	polling.Go(func() { s.pipeline.Run(pollCtx) })
	if s.discovery != nil {
		polling.Go(func() { s.discovery.Run(pollCtx) })
	}
	if s.opts.ConfigPath != "" {
		polling.Go(s.watchConfig(pollCtx))
	}

	errc := make(chan error, 2)
	go func() { errc <- s.grpc.Serve(grpcLis) }()
	go func() { errc <- s.admin.Serve(adminLis) }()
	pending := 2
	err, failed := s.awaitStop(ctx, errc)
	if failed {
		pending--
	}
	s.shutdown(err)
	stopPolling()
	polling.Wait()
	for range pending {
		<-errc // http.ErrServerClosed, or nil from grpc
	}
	return err
}

// pairedConnector is the running connector when its decode engines serve
// only prefill/decode pairs, so that no request goes decode-only; else "".
func (s *Server) pairedConnector() string {
	if s.pipeline.Paired() {
		return s.cfg.Connector
	}
	return ""
}

// watchConfig returns the loop that reloads the config file when it changes.
func (s *Server) watchConfig(ctx context.Context) func() {
	return func() {
		err := config.Watch(ctx, s.opts.ConfigPath, s.cfg, s.reread, func(run *config.Config, pending []string) {
			assemble.Reload(s.pipeline, run)
			s.metrics.ConfigReloaded(len(pending))
			logConfigReloaded(s.log, s.opts.ConfigPath, pending, run, s.pairedConnector())
		}, func(err error) {
			s.metrics.ConfigRejected()
			s.log.Error(err, "config change rejected; the previous config stays", "path", s.opts.ConfigPath)
		})
		if err != nil {
			s.log.Error(err, "cannot watch the config file; changes need a restart", "path", s.opts.ConfigPath)
		}
	}
}

// shutdown stops the server; cause is the error of a listener that failed,
// logged now rather than after the delay and the grace.
func (s *Server) shutdown(cause error) {
	// Readiness goes false first so that Envoy and Kubernetes stop opening new
	// streams; new ones are still served for the delay, then in-flight streams
	// get the grace period to finish, but those held for room, to whom none
	// would come in it, are answered now.
	if cause != nil {
		s.log.Error(cause, "shutting down: a listener failed", "delay", s.opts.ShutdownDelay.String(), "grace", s.opts.Grace.String())
	} else {
		s.log.Info("shutting down", "delay", s.opts.ShutdownDelay.String(), "grace", s.opts.Grace.String())
	}
	s.ready.drain()
	close(s.draining)
	s.delay()
	s.pipeline.Drain()

	// Background prefill legs (kv-sglang, kv-mooncake) outlive their
	// streams: they get what is left of the grace too.
	drained, legs := make(chan struct{}), make(chan struct{})
	go func() { s.grpc.GracefulStop(); close(drained) }()
	go func() { <-drained; s.pipeline.Wait(); close(legs) }()
	if s.graceOver(legs) {
		s.grpc.Stop()
		s.pipeline.Stop()
		<-legs
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.shutdownTracing(ctx); err != nil {
		s.log.Error(err, "flushing traces")
	}
	if err := s.admin.Shutdown(ctx); err != nil {
		s.log.Error(err, "stopping the admin server")
	}
}
