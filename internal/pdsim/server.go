// Package pdsim simulates a vLLM or SGLang engine taking part in prefill/decode
// disaggregation, without a GPU. It speaks the engines' real wire formats (OpenAI
// chat and completions, vLLM's Responses, Anthropic Messages and token-in
// generate APIs, SGLang's native generate; vLLM NIXL kv_transfer_params, SGLang bootstrap fields, a
// shared KV directory) and really moves a small KV record between prefill and
// decode, so a router that pairs the wrong legs fails here the way it would
// fail against real engines. It also serves and records the endpoints a gateway
// passes through (embeddings, tokenizing, stored responses) and admin ones it
// must not.
package pdsim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Server is a running simulated engine.
type Server struct {
	cfg      Config
	engineID string
	kv       connector
	metrics  *metrics
	kvpub    *publisher   // nil without KV events
	client   *http.Client // decode → prefill side channel / bootstrap server
	log      *slog.Logger

	ctx    context.Context // cancelled by Close: every handler's context derives from it
	cancel context.CancelFunc
	served map[string]served // by listener name
	wg     sync.WaitGroup    // handlers and servers
	once   sync.Once

	ledger
	faults faultState
}

// ledger is what the server keeps of its requests, under one lock.
type ledger struct {
	mu        sync.Mutex
	records   []Record
	forgotten int                        // records dropped from the front of records (Config.MaxRecords)
	closing   bool                       // no new handlers once set
	responses map[string]json.RawMessage // the Responses API's store, by response id
}

// served is one listener's server and the ip:port it advertises.
type served struct {
	srv  *http.Server
	addr string
}

const (
	listenHTTP      = "http"
	listenKV        = "kv"
	listenBootstrap = "bootstrap"
)

// Start validates cfg, opens the listeners and serves in the background.
func Start(cfg Config) (*Server, error) {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	logOut := cfg.Log
	if logOut == nil {
		logOut = os.Stderr
	}
	log := slog.New(slog.NewTextHandler(logOut, nil)).With("role", cfg.Role, "protocol", cfg.Protocol)
	var kvpub *publisher
	var events kvSink // not a nil *publisher: the cache tests for nil
	if cfg.KVEvents.Endpoint != "" {
		if kvpub, err = newPublisher(cfg.KVEvents, log); err != nil {
			return nil, err
		}
		events = kvpub
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{
		cfg:      cfg,
		engineID: newUUID(),
		metrics:  &metrics{cache: newPrefixCache(cfg.PrefixCacheBlocks, events), capacity: cfg.KVBlocks},
		kvpub:    kvpub,
		client:   &http.Client{Transport: &http.Transport{}}, // no HTTP_PROXY: peers are engines next door
		log:      log,
		ctx:      ctx,
		cancel:   cancel,
		served:   map[string]served{},
		ledger:   ledger{responses: map[string]json.RawMessage{}},
		faults:   faultState{current: cfg.faults()},
	}
	ls := []listener{{listenHTTP, cfg.Addr, s.routes()}}
	switch {
	case cfg.Protocol == ProtocolNIXL && cfg.Role == RolePrefill:
		store := newBlockStore(s.metrics)
		s.kv = &nixlPrefill{s: s, store: store}
		ls = append(ls, listener{listenKV, cfg.KVAddr, store.sideChannel(0)})
	case cfg.Protocol == ProtocolNIXL:
		s.kv = &nixlDecode{s: s}
	case cfg.Protocol == ProtocolSGLang && cfg.Role == RolePrefill:
		rooms := newBootstrap()
		s.kv = &sglangPrefill{s: s, rooms: rooms}
		ls = append(ls, listener{listenBootstrap, cfg.BootstrapAddr, rooms.routes()})
	case cfg.Protocol == ProtocolSGLang:
		s.kv = &sglangDecode{s: s}
	case cfg.Protocol == ProtocolMooncake && cfg.Role == RolePrefill:
		p := &mooncakePrefill{s: s, store: newBlockStore(s.metrics)}
		s.kv = p
		ls = append(ls, listener{listenKV, cfg.KVAddr, p.store.sideChannel(cfg.HandshakeTimeout)},
			listener{listenBootstrap, cfg.BootstrapAddr, p.bootstrap()})
	case cfg.Protocol == ProtocolMooncake:
		s.kv = &mooncakeDecode{s: s}
	default:
		if err := os.MkdirAll(cfg.SharedDir, 0o755); err != nil {
			cancel()
			return nil, fmt.Errorf("pdsim: shared dir: %w", err)
		}
		s.kv = &sharedStorage{s: s}
	}
	for _, l := range ls {
		if err := s.serve(l); err != nil {
			s.Close()
			return nil, err
		}
	}
	if err := s.startKVEvents(); err != nil {
		s.Close()
		return nil, err
	}
	s.log.Info("pdsim listening", "model", cfg.Model, "addr", s.Addr(), "kv_addr", s.KVAddr(),
		"bootstrap_addr", s.BootstrapAddr(), "engine_id", s.engineID)
	return s, nil
}

type listener struct {
	name, addr string
	handler    http.Handler
}

func (s *Server) serve(l listener) error {
	ln, err := net.Listen("tcp", l.addr)
	if err != nil {
		return fmt.Errorf("pdsim: %s listener: %w", l.name, err)
	}
	tracked := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// http.Server.Close does not wait for handlers; Server.Close does.
		s.mu.Lock()
		closing := s.closing
		if !closing {
			s.wg.Add(1)
		}
		s.mu.Unlock()
		if closing {
			http.Error(w, "pdsim: shutting down", http.StatusServiceUnavailable)
			return
		}
		defer s.wg.Done()
		l.handler.ServeHTTP(w, r)
	})
	srv := &http.Server{Handler: tracked, BaseContext: func(net.Listener) context.Context { return s.ctx }}
	s.served[l.name] = served{srv, advertise(ln.Addr().(*net.TCPAddr), s.cfg.AdvertiseHost)}
	s.wg.Go(func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("serve", "listener", l.name, "err", err)
		}
	})
	return nil
}

// Addr is the HTTP (OpenAI API) address, ip:port.
func (s *Server) Addr() string { return s.served[listenHTTP].addr }

// KVAddr is the NIXL side channel a vllm-nixl prefill puts in remote_host/remote_port, or a
// vllm-mooncake prefill's worker ("" otherwise).
func (s *Server) KVAddr() string { return s.served[listenKV].addr }

// BootstrapAddr is the sglang or vllm-mooncake prefill's bootstrap server ("" otherwise).
func (s *Server) BootstrapAddr() string { return s.served[listenBootstrap].addr }

// Requests returns a copy of the requests recorded so far (Record), in arrival order:
// the last Config.MaxRecords to MaxRecords/2 of them. Requests still in flight show what
// is known so far.
func (s *Server) Requests() []Record {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Record, len(s.records))
	copy(out, s.records)
	return out
}

// Close stops the listeners, cancels in-flight work and returns once every
// goroutine the server started has finished.
func (s *Server) Close() error {
	var err error
	s.once.Do(func() {
		s.mu.Lock()
		s.closing = true
		s.mu.Unlock()
		s.cancel() // in-flight work ends now, so there is nothing to drain gracefully
		for _, l := range s.served {
			err = errors.Join(err, l.srv.Close())
		}
		s.wg.Wait()
		if s.kvpub != nil {
			s.kvpub.close()
		}
		s.client.CloseIdleConnections()
	})
	return err
}

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", s.inference(apiChat))
	mux.HandleFunc("POST /v1/completions", s.inference(apiCompletion))
	mux.HandleFunc("POST /v1/responses", s.inference(apiResponses))
	mux.HandleFunc("POST /v1/messages", s.inference(apiMessages))
	// Each engine's own generate: vLLM's token-in one (vllm/entrypoints/serve/disagg/api_router.py),
	// SGLang's native one (python/sglang/srt/entrypoints/http_server.py); the other's is a 404.
	if s.cfg.Protocol == ProtocolSGLang {
		mux.HandleFunc("POST /generate", s.inference(apiSGLangGenerate))
	} else {
		mux.HandleFunc("POST /inference/v1/generate", s.inference(apiGenerate))
	}
	s.otherRoutes(mux)
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	if s.cfg.Protocol == ProtocolSGLang {
		mux.HandleFunc("GET /server_info", s.serverInfo)
		mux.HandleFunc("GET /get_server_info", s.serverInfo)
		mux.HandleFunc("GET /v1/models/{model...}", s.retrieveModel)
	}
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("GET /metrics", s.metrics.serve(s.cfg.Model, s.cfg.Protocol, s.cfg.Role))
	mux.HandleFunc("GET /pdsim/requests", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, s.Requests())
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if allow := allowed(mux, r); allow != "" { // FastAPI's answers
			w.Header().Set("Allow", allow)
			writeJSON(w, http.StatusMethodNotAllowed, map[string]string{"detail": "Method Not Allowed"})
			return
		}
		writeJSON(w, http.StatusNotFound, map[string]string{"detail": "Not Found"})
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("x-pdsim-role", s.cfg.Role)
		if !s.admits(r) {
			writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "Unauthorized"})
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// allowed lists the methods mux serves r's path with (pdsim registers GET
// and POST routes only), as FastAPI's 405 names them in Allow.
func allowed(mux *http.ServeMux, r *http.Request) string {
	var out []string
	for _, m := range []string{http.MethodGet, http.MethodPost} {
		probe := r.Clone(r.Context())
		probe.Method = m
		if _, pattern := mux.Handler(probe); pattern != "/" {
			out = append(out, m)
		}
	}
	return strings.Join(out, ", ")
}

// wait sleeps for d unless ctx ends first.
func wait(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// advertise turns a listener address into one a peer can dial.
func advertise(a *net.TCPAddr, host string) string {
	port := strconv.Itoa(a.Port)
	if host != "" {
		return net.JoinHostPort(host, port)
	}
	if !a.IP.IsUnspecified() {
		return net.JoinHostPort(a.IP.String(), port)
	}
	// An IPv4 address of the host's, else an IPv6 one (an IPv6-only pod),
	// else loopback.
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, v4 := range []bool{true, false} {
			for _, ad := range addrs {
				if n, ok := ad.(*net.IPNet); ok && n.IP.IsGlobalUnicast() && (n.IP.To4() != nil) == v4 {
					return net.JoinHostPort(n.IP.String(), port)
				}
			}
		}
	}
	return net.JoinHostPort("127.0.0.1", port)
}
