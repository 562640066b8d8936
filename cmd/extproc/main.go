// Command extproc is the pd-extproc Envoy external processor: it splits each
// OpenAI-compatible request into a prefill and a decode leg and tells Envoy which
// decode endpoint receives it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/zapr"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"

	defaults "github.com/pd-extproc/pd-extproc/config"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// grpcHeadroom is added to the body limit for the rest of an ext_proc message.
const grpcHeadroom = 1 << 20

type flags struct {
	config, grpcAddr, adminAddr, logFormat string
	verbosity                              int
	grace                                  time.Duration
}

func main() {
	var f flags
	flag.StringVar(&f.config, "config", "", "config file (YAML); the embedded default when empty")
	flag.StringVar(&f.grpcAddr, "grpc-addr", ":9002", "ext_proc gRPC listen address")
	flag.StringVar(&f.adminAddr, "admin-addr", ":9090", "admin HTTP listen address (/metrics, /healthz, /readyz)")
	flag.IntVar(&f.verbosity, "v", 0, "log verbosity: 0 info, 1 per-request debug, 2 protocol detail")
	flag.StringVar(&f.logFormat, "log-format", "json", "log format: json or console")
	flag.DurationVar(&f.grace, "shutdown-grace", 30*time.Second, "on SIGTERM, how long in-flight streams may finish")
	flag.Parse()

	log, err := newLogger(f.logFormat, f.verbosity)
	if err != nil {
		fmt.Fprintln(os.Stderr, "extproc:", err)
		os.Exit(2)
	}
	if err := run(f, log); err != nil {
		log.Error(err, "extproc stopped")
		os.Exit(1)
	}
}

func run(f flags, log logr.Logger) error {
	cfg, err := loadConfig(f.config)
	if err != nil {
		return err
	}
	p, err := pipeline.New(cfg, log.WithName("pipeline"))
	if err != nil {
		return err
	}
	grpcLis, err := net.Listen("tcp", f.grpcAddr)
	if err != nil {
		return err
	}
	adminLis, err := net.Listen("tcp", f.adminAddr)
	if err != nil {
		return err
	}

	srv := grpc.NewServer(grpc.MaxRecvMsgSize(int(cfg.Limits.MaxBodyBytes) + grpcHeadroom))
	extprocv3.RegisterExternalProcessorServer(srv, handlers.NewServer(p, handlers.Options{
		OverrideAfter:   cfg.Envoy.OverrideAfter.D(),
		OverrideTimeout: cfg.Envoy.OverrideMessageTimeout.D(),
	}, log.WithName("extproc")))
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	reflection.Register(srv)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus(extprocv3.ExternalProcessor_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)

	var ready atomic.Bool
	ready.Store(true)
	admin := &http.Server{Handler: adminMux(&ready), ReadHeaderTimeout: 10 * time.Second}

	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(grpcLis) }()
	go func() { errc <- admin.Serve(adminLis) }()
	log.Info("extproc serving", "grpc", grpcLis.Addr().String(), "admin", adminLis.Addr().String(),
		"connector", cfg.Connector, "prefill", cfg.Pools.Prefill.Endpoints, "decode", cfg.Pools.Decode.Endpoints)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}

	// Readiness goes false first so Envoy and Kubernetes stop sending new streams,
	// then in-flight streams get the grace period to finish.
	log.Info("shutting down", "grace", f.grace.String())
	ready.Store(false)
	hs.Shutdown()
	drained := make(chan struct{})
	go func() { srv.GracefulStop(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(f.grace):
		srv.Stop()
	}
	p.Wait()
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return admin.Shutdown(shutdownCtx)
}

func loadConfig(path string) (*config.Config, error) {
	if path == "" {
		return config.Parse(defaults.DefaultYAML)
	}
	return config.Load(path)
}

func adminMux(ready *atomic.Bool) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.Handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !ready.Load() {
			http.Error(w, "shutting down", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	return mux
}

func newLogger(format string, verbosity int) (logr.Logger, error) {
	var zc zap.Config
	switch format {
	case "json":
		zc = zap.NewProductionConfig()
	case "console":
		zc = zap.NewDevelopmentConfig()
		zc.EncoderConfig.EncodeLevel = zapcore.CapitalColorLevelEncoder
	default:
		return logr.Logger{}, errors.New("--log-format must be json or console")
	}
	zc.Level = zap.NewAtomicLevelAt(zapcore.Level(-verbosity))
	zc.DisableStacktrace = true
	z, err := zc.Build()
	if err != nil {
		return logr.Logger{}, err
	}
	return zapr.NewLogger(z), nil
}
