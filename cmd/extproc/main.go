// Command extproc is the pd-extproc Envoy external processor: it splits each
// OpenAI-compatible request into a prefill and a decode leg and tells Envoy which
// decode endpoint receives it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"net"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/zapr"
	"go.opentelemetry.io/otel"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"k8s.io/klog/v2"

	defaults "github.com/pd-extproc/pd-extproc/config"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/server"
	"github.com/pd-extproc/pd-extproc/pkg/server/grpcbuf"
	"github.com/pd-extproc/pd-extproc/pkg/version"
)

type flags struct {
	config, grpcAddr, adminAddr, logFormat string
	kubeconfig                             string
	verbosity                              int
	grace, delay, logFlush                 time.Duration
	pprof, logPrompts, version             bool
	tls                                    server.TLSFiles
	keepalive                              server.Keepalive
}

func init() { grpcbuf.UseChunkSized() }

func main() {
	var f flags
	flag.StringVar(&f.config, "config", "", "config file (YAML); the embedded default when empty")
	flag.StringVar(&f.grpcAddr, "grpc-addr", ":9002", "ext_proc gRPC listen address")
	flag.StringVar(&f.adminAddr, "admin-addr", ":9090", "admin HTTP listen address (/metrics, /healthz, /readyz)")
	flag.IntVar(&f.verbosity, "v", 0, "log verbosity: 0 info, 1 per-request debug, 2 protocol detail")
	flag.StringVar(&f.logFormat, "log-format", "json", "log format: json or console")
	flag.DurationVar(&f.logFlush, "log-flush-interval", time.Second,
		"how long log lines may wait in a buffer before they are written, as Envoy's access logs do; 0 writes each line at once")
	flag.DurationVar(&f.delay, "shutdown-delay", 0, "on SIGTERM, how long new streams are still served while readiness and gRPC health "+
		"say NOT_SERVING, for Envoy's health checks to take this replica out; a second SIGTERM or ctrl-C ends it")
	flag.DurationVar(&f.grace, "shutdown-grace", 30*time.Second, "then, how long in-flight streams (and concurrent prefill legs) may finish; "+
		"a SIGTERM or ctrl-C meanwhile cuts them")
	flag.DurationVar(&f.keepalive.Ping, "keepalive-ping", server.DefaultKeepalive.Ping,
		"ping Envoy over a connection silent this long, to find a peer that answers nothing")
	flag.DurationVar(&f.keepalive.Timeout, "keepalive-timeout", server.DefaultKeepalive.Timeout,
		"close a connection whose ping goes unanswered this long, ending its streams (also its TCP_USER_TIMEOUT)")
	flag.DurationVar(&f.keepalive.MinPeerPing, "keepalive-min-peer-ping", server.DefaultKeepalive.MinPeerPing,
		"the shortest interval at which Envoy may ping (its connection_keepalive); faster pings get the connection closed")
	flag.BoolVar(&f.pprof, "pprof", false, "serve the Go profiler under /debug/pprof/ on the admin address")
	flag.BoolVar(&f.logPrompts, "log-prompts", false, "add request bodies (prompts: user data) to the per-request log lines")
	flag.StringVar(&f.tls.Cert, "tls-cert-file", "", "serve ext_proc over TLS with this certificate (PEM); reloaded when it changes")
	flag.StringVar(&f.tls.Key, "tls-key-file", "", "the certificate's private key (PEM)")
	flag.StringVar(&f.tls.ClientCA, "tls-client-ca-file", "", "require client certificates signed by these CAs (mTLS)")
	flag.StringVar(&f.kubeconfig, "kubeconfig", "",
		"credentials for pools discovered from Kubernetes (pools.<pool>.kubernetes); default: in-cluster, else KUBECONFIG or ~/.kube/config")
	flag.Func("tls-client-allowed-sans", "with --tls-client-ca-file, accept only client certificates with one of these SANs "+
		"(comma-separated DNS names and URIs such as spiffe://cluster.local/ns/envoy-gateway-system/sa/envoy; exact, no wildcards)",
		func(v string) (err error) { f.tls.AllowedSANs, err = server.ParseSANs(v); return err })
	flag.BoolVar(&f.version, "version", false, "print the version, revision and Go release, then exit")
	flag.Parse()
	if f.version {
		fmt.Println(version.Get())
		return
	}

	err := f.validate()
	if err != nil {
		fmt.Fprintln(os.Stderr, "extproc:", err)
		os.Exit(2)
	}
	log, flush, err := newLogger(f.logFormat, f.verbosity, f.logFlush)
	if err != nil {
		fmt.Fprintln(os.Stderr, "extproc:", err)
		os.Exit(2)
	}
	err = run(f, log, flush)
	if err != nil {
		log.Error(err, "extproc stopped")
	}
	flush()
	if err != nil {
		os.Exit(1)
	}
}

// validate refuses flag values that would run, but not as asked: a negative
// verbosity drops every per-request line, one past zap's int8 levels wraps
// to a level above fatal and drops every line, a negative grace cuts every
// stream at SIGTERM, a negative delay would serve none, and a negative
// keepalive setting is taken for its default.
func (f flags) validate() error {
	var errs []error
	if f.verbosity < 0 || f.verbosity > -math.MinInt8 {
		errs = append(errs, fmt.Errorf("-v %d: verbosity is 0 (info) to 128; 1 and 2 add detail", f.verbosity))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"--shutdown-grace", f.grace}, {"--shutdown-delay", f.delay}, {"--log-flush-interval", f.logFlush}, {"--keepalive-ping", f.keepalive.Ping},
		{"--keepalive-timeout", f.keepalive.Timeout}, {"--keepalive-min-peer-ping", f.keepalive.MinPeerPing}} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("%s %s: must not be negative", d.name, d.v))
		}
	}
	return errors.Join(errs...)
}

func run(f flags, log logr.Logger, flush func()) error {
	if err := f.tls.Validate(); err != nil {
		return err
	}
	cfg, err := loadConfig(f.config)
	if err != nil {
		return err
	}
	goMemLimit := os.Getenv("GOMEMLIMIT") + " (GOMEMLIMIT)"
	if os.Getenv("GOMEMLIMIT") == "" {
		if n := config.GoMemoryLimit(); n > 0 {
			debug.SetMemoryLimit(n)
			goMemLimit = fmt.Sprintf("%d MiB, 90%% of the container's memory limit", n>>20)
		} else {
			goMemLimit = "none: no container memory limit"
		}
	}
	otel.SetLogger(log.WithName("otel"))
	klog.SetLogger(log.WithName("client-go")) // Kubernetes discovery's client library logs through ours
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { log.Error(err, "opentelemetry") }))
	grpcLis, err := net.Listen("tcp", f.grpcAddr)
	if err != nil {
		return err
	}
	defer grpcLis.Close()
	adminLis, err := net.Listen("tcp", f.adminAddr)
	if err != nil {
		return err
	}
	defer adminLis.Close()
	// The first SIGTERM or ctrl-C begins the shutdown, the next ends its
	// delay, then one cuts the grace; SIGHUP reads --config again instead of
	// exiting, Go's default.
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, os.Interrupt, syscall.SIGHUP)
	defer signal.Stop(signals)
	s, err := server.New(cfg, server.Options{Grace: f.grace, ShutdownDelay: f.delay, Signals: signals, Pprof: f.pprof, LogPrompts: f.logPrompts,
		ConfigPath: f.config, TLS: f.tls, Kubeconfig: f.kubeconfig, Keepalive: f.keepalive}, log)
	if err != nil {
		return err
	}
	log.Info("extproc serving", "version", version.Version, "revision", version.Get().Revision, "grpc", grpcLis.Addr().String(), "admin", adminLis.Addr().String(),
		"connector", connectorName(cfg, f.config), "prefill", cfg.Pools.Prefill.Endpoints, "decode", cfg.Pools.Decode.Endpoints,
		"tracing", server.TracingEnabled(cfg.Tracing), "pprof", f.pprof, "logPrompts", f.logPrompts,
		"tls", f.tls.Cert != "", "mtls", f.tls.ClientCA != "", "allowedSANs", f.tls.AllowedSANs, "maxBufferedBytes", cfg.Limits.MaxBufferedBytes,
		"goMemoryLimit", goMemLimit)
	flush() // whoever waits for this line gets it now
	return s.Serve(context.Background(), grpcLis, adminLis)
}

func loadConfig(path string) (*config.Config, error) {
	if path == "" {
		return config.Unconfigured(defaults.DefaultYAML)
	}
	return config.Load(path)
}

// newLogger returns the logger and a function that writes out what it holds.
// With a flush interval, lines are written in batches at least that often
// (and when 256 KiB are waiting) instead of one write per line: the request
// line is the only write extproc makes per request.
func newLogger(format string, verbosity int, flushInterval time.Duration) (logr.Logger, func(), error) {
	var zc zap.Config
	var enc func(zapcore.EncoderConfig) zapcore.Encoder
	switch format {
	case "json":
		zc, enc = zap.NewProductionConfig(), zapcore.NewJSONEncoder
	case "console":
		zc, enc = zap.NewDevelopmentConfig(), zapcore.NewConsoleEncoder
		if terminal(os.Stderr) { // colour codes only where a terminal draws them, not into a file or pipe
			zc.EncoderConfig.EncodeLevel = zapcore.CapitalColorLevelEncoder
		}
	default:
		return logr.Logger{}, nil, errors.New("--log-format must be json or console")
	}
	zc.Level = zap.NewAtomicLevelAt(zapcore.Level(-verbosity))
	zc.DisableStacktrace = true
	zc.DisableCaller = true // the logger name says where a line comes from; a stack walk per request line does not pay
	zc.Sampling = nil       // every request gets its one "request" line, however busy
	var out zapcore.WriteSyncer = zapcore.Lock(os.Stderr)
	if flushInterval > 0 {
		out = &zapcore.BufferedWriteSyncer{WS: zapcore.AddSync(os.Stderr), Size: 256 << 10, FlushInterval: flushInterval}
	}
	z, err := zc.Build(zap.WrapCore(func(zapcore.Core) zapcore.Core {
		return zapcore.NewCore(enc(zc.EncoderConfig), out, zc.Level)
	}))
	if err != nil {
		return logr.Logger{}, nil, err
	}
	return zapr.NewLogger(z), func() { _ = out.Sync() }, nil
}

// connectorName is the config's connector, or what runs without one: none
// (the embedded default routes nothing, whatever the pipeline holds).
func connectorName(cfg *config.Config, path string) string {
	if path == "" {
		return "none (no --config)"
	}
	return cfg.Connector
}

// terminal reports whether f is a character device, as a terminal is.
func terminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
