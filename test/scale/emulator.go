package main

import (
	"context"
	"encoding/json"
	"flag"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// childEmulator is the first argument that makes this program an Envoy
// emulator child instead of the driver.
const childEmulator = "-child-emulator"

// runEmulator serves the emulator on -listen, in front of the -extproc
// endpoints, until SIGTERM; -stats serves its clusters' circuit-breaker
// counters as JSON at GET /stats.
func runEmulator(args []string) error {
	fs := flag.NewFlagSet(childEmulator, flag.ContinueOnError)
	config := fs.String("config", "", "Envoy bootstrap")
	listen := fs.String("listen", "", "listen address")
	stats := fs.String("stats", "", "address of the /stats listener")
	extproc := fs.String("extproc", "", "ext_proc endpoints, comma-separated")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var c testbed.Cleanups
	defer c.Close()
	p, err := testbed.StartEnvoyOn(&c, *config, strings.Split(*extproc, ","), func(cfg *envoyemu.Config) {
		// The echo server speaks no TLS, and extproc is measured beside it on the same
		// plaintext link: TLS costs a handshake per connection (a few per replica), not per
		// held stream, which is what this run measures.
		testbed.Plaintext(cfg)
		testbed.ManyClients(cfg) // the load comes from one address, standing for many clients
		cfg.ListenAddr = *listen
	})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *stats)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(p.ClusterStats())
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	return srv.Close()
}
