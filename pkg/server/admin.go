package server

import (
	"fmt"
	"net/http"
	"net/http/pprof"
	"net/netip"
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
		mux.HandleFunc("/debug/pprof/", loopbackOnly(pprof.Index))
		mux.HandleFunc("/debug/pprof/cmdline", loopbackOnly(pprof.Cmdline))
		mux.HandleFunc("/debug/pprof/profile", loopbackOnly(pprof.Profile))
		mux.HandleFunc("/debug/pprof/symbol", loopbackOnly(pprof.Symbol))
		mux.HandleFunc("/debug/pprof/trace", loopbackOnly(pprof.Trace))
	}
	return mux
}

// loopbackOnly serves h to clients on the host's (the pod's) own loopback
// only: the profiler asks for no credentials, reads memory and burns CPU on
// demand, and the admin address also faces Prometheus. kubectl port-forward
// arrives on the pod's loopback, so it still reaches it.
func loopbackOnly(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if client, err := netip.ParseAddrPort(r.RemoteAddr); err != nil || !client.Addr().Unmap().IsLoopback() {
			http.Error(w, "the profiler answers only on loopback (kubectl port-forward, or a shell in the pod)", http.StatusForbidden)
			return
		}
		h(w, r)
	}
}
