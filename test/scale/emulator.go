package main

import (
	"encoding/json"
	"errors"
	"flag"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// childEmulator is the first argument that makes this program an Envoy
// emulator child instead of the driver.
const childEmulator = "-child-emulator"

// responsePathOff skips the response path: no message goes to the ext_proc
// server after the request, so Envoy closes the stream once it is routed.
var responsePathOff = envoyemu.DirectionModes{
	Headers:  extprocfilterv3.ProcessingMode_SKIP,
	Body:     extprocfilterv3.ProcessingMode_NONE,
	Trailers: extprocfilterv3.ProcessingMode_SKIP,
}

// runEmulator serves the emulator on -listen, in front of the -extproc
// endpoints, until SIGTERM; -stats serves its clusters' circuit-breaker
// counters as JSON at GET /stats.
func runEmulator(args []string) error {
	fs := flag.NewFlagSet(childEmulator, flag.ContinueOnError)
	config := fs.String("config", "", "Envoy bootstrap")
	listen := fs.String("listen", "", "listen address")
	stats := fs.String("stats", "", "address of the /stats listener")
	extproc := fs.String("extproc", "", "ext_proc endpoints, comma-separated")
	response := fs.String("response", "on", "on: the bootstrap's response path; off: skipped")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := envoyemu.LoadConfig(*config)
	if err != nil {
		return err
	}
	// The echo server speaks no TLS, and extproc is measured beside it on the same
	// plaintext link: TLS costs a handshake per connection (a few per replica), not per
	// held stream, which is what this run measures.
	testbed.Plaintext(cfg)
	if *response == "off" {
		cfg.Modes.Response = responsePathOff
	}
	cfg.ListenAddr = *listen
	p, err := envoyemu.Start(cfg, strings.Split(*extproc, ",")...)
	if err != nil {
		return err
	}
	defer p.Close()
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
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	select {
	case err := <-errc:
		return err
	case <-sig:
	}
	if err := srv.Close(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
