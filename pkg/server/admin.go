package server

import (
	"fmt"
	"net/http"
	"net/http/pprof"
)

// adminMux serves the admin address: /metrics, /healthz (the process is alive),
// /readyz (it should get traffic), and with --pprof the Go profiler.
func (s *Server) adminMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", s.metrics.Handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.Handle("GET /readyz", s.ready)
	if s.opts.Pprof {
		// Registered by hand: importing net/http/pprof only fills
		// http.DefaultServeMux, which nothing here serves.
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
}
