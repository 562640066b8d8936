// Command echo is the benchmarks' floor: an ext_proc server that answers Envoy
// exactly as extproc must (held headers reply and streamed chunks in
// FULL_DUPLEX_STREAMED, one body reply in BUFFERED) but routes nothing and hands
// the body back unchanged. See bench/internal/echo and docs/benchmarks.md.
package main

import (
	"flag"
	"fmt"
	"net"
	"net/http"
	_ "net/http/pprof" // the admin listener serves /debug/pprof
	"os"
	"os/signal"
	"syscall"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"

	"github.com/pd-extproc/pd-extproc/bench/internal/echo"
	"github.com/pd-extproc/pd-extproc/pkg/server/grpcbuf"
)

// maxRecvMsgSize matches extproc with its default config: the 32 MiB body
// limit plus 1 MiB of headroom for the rest of the message.
const maxRecvMsgSize = 32<<20 + 1<<20

// The same gRPC buffers as extproc: the floor must not pay for a setting
// extproc does not.
func init() { grpcbuf.UseChunkSized() }

func main() {
	grpcAddr := flag.String("grpc-addr", ":9003", "ext_proc gRPC listen address")
	adminAddr := flag.String("admin-addr", ":9093", "admin HTTP listen address (/metrics, /healthz, /debug/pprof)")
	dest := flag.String("destination", echo.Value, "the ip:port every request is routed to (x-gateway-destination-endpoint)")
	flag.Parse()
	if err := run(*grpcAddr, *adminAddr, *dest); err != nil {
		fmt.Fprintln(os.Stderr, "echo:", err)
		os.Exit(1)
	}
}

func run(grpcAddr, adminAddr, dest string) error {
	grpcLis, err := net.Listen("tcp", grpcAddr)
	if err != nil {
		return err
	}
	adminLis, err := net.Listen("tcp", adminAddr)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(maxRecvMsgSize))
	extprocv3.RegisterExternalProcessorServer(srv, echo.Server{Destination: dest})
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	reflection.Register(srv)

	// http.DefaultServeMux already holds /debug/pprof from the blank import.
	http.Handle("GET /metrics", promhttp.Handler())
	http.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	admin := &http.Server{ReadHeaderTimeout: 10 * time.Second}

	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(grpcLis) }()
	go func() { errc <- admin.Serve(adminLis) }()
	fmt.Fprintf(os.Stderr, "echo serving grpc=%s admin=%s\n", grpcLis.Addr(), adminLis.Addr())

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	select {
	case err := <-errc:
		return err
	case <-sig:
	}
	srv.Stop()
	return admin.Close()
}
