package envoyemu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
)

// Proxy is a running emulated Envoy: an HTTP/1.1 listener on 127.0.0.1 with
// the ext_proc filter (talking to the ext_proc servers of its cluster) and the
// router, both clusters behind their circuit breakers (§12).
type Proxy struct {
	cfg       Config
	headers   *rules.HeaderRules // the filter's mutation_rules
	ln        net.Listener
	srv       *http.Server
	extProc   *extProcCluster
	routed    clusterResources // the route clusters' circuit breakers
	transport *http.Transport
	ctx       context.Context
	cancel    context.CancelFunc

	// hooks are test-only observation points; set them before any request.
	hooks struct {
		clientBodyDone func() // the whole client body reached the filter
		// backoff, when set, picks the wait before a retry from its
		// ceiling, in place of Envoy's jitter.
		backoff func(ceiling time.Duration) time.Duration
	}

	mu        sync.Mutex
	closed    bool
	handlers  sync.WaitGroup
	upstreams []string
}

// Start validates cfg like Envoy would (a config Envoy rejects does not
// start), then listens on cfg.ListenAddr (default 127.0.0.1:0). The
// extProcAddrs are the endpoints of the ext_proc cluster, in place of the
// bootstrap's, dialled over the cluster's transport socket (TLS with the
// files Config names, or plaintext): each HTTP request opens its own Process
// stream, when it first needs one, to the next endpoint in turn.
func Start(cfg *Config, extProcAddrs ...string) (*Proxy, error) {
	if cfg == nil {
		return nil, errors.New("envoy: nil config")
	}
	c := cfg.withDefaults()
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("envoy: config rejected: %w", err)
	}
	headerRules, err := rules.NewHeaderRules(c.Mutations.Rules, c.Mutations.HeaderPrefix)
	if err != nil {
		return nil, fmt.Errorf("envoy: config rejected: %w", err)
	}
	ep, err := newExtProcCluster(extProcAddrs, c.Clusters[c.ExtProcCluster], c.Mounts, c.logf)
	if err != nil {
		return nil, fmt.Errorf("envoy: ext_proc client: %w", err)
	}
	addr := c.ListenAddr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		_ = ep.close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{
		cfg:     c,
		headers: headerRules,
		ln:      ln,
		extProc: ep,
		transport: &http.Transport{
			Proxy:               nil,
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
			DisableCompression:  true,
			MaxIdleConnsPerHost: 64,
		},
		ctx:    ctx,
		cancel: cancel,
	}
	p.srv = &http.Server{
		Handler:           http.HandlerFunc(p.serveHTTP),
		ReadHeaderTimeout: 10 * time.Second,
		// Envoy's codec answers 431 above max_request_headers_kb; Go's server
		// answers 431 above MaxHeaderBytes (plus a small allowance of its own).
		MaxHeaderBytes: c.Limits.MaxHeadersKB << 10,
		ErrorLog:       log.New(io.Discard, "", 0),
	}
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

// URL is the listener's base URL, e.g. http://127.0.0.1:41234.
func (p *Proxy) URL() string { return "http://" + p.ln.Addr().String() }

// Upstreams lists the ip:port each request was forwarded to, in order.
func (p *Proxy) Upstreams() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.upstreams...)
}

// RemoveExtProcEndpoint takes an ext_proc endpoint out of the rotation, as
// Envoy drops a host its cluster's DNS or EDS no longer lists: the next
// streams go to the others, the ones on it run on.
func (p *Proxy) RemoveExtProcEndpoint(addr string) error { return p.extProc.remove(addr) }

// ClusterStats returns the circuit-breaker counters of every cluster that saw
// a request, the ext_proc cluster under its name in the config.
func (p *Proxy) ClusterStats() map[string]ClusterStats {
	out := p.routed.stats()
	out[p.cfg.ExtProcCluster] = p.extProc.resources.snapshot()
	return out
}

func (p *Proxy) recordUpstream(addr string) {
	p.mu.Lock()
	p.upstreams = append(p.upstreams, addr)
	p.mu.Unlock()
}

// Close stops the listener, cancels every in-flight exchange (their gRPC
// streams are reset) and waits for them.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	err := p.srv.Close()
	p.handlers.Wait()
	p.transport.CloseIdleConnections()
	if cerr := p.extProc.close(); err == nil {
		err = cerr
	}
	return err
}

func (p *Proxy) serveHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		http.Error(w, "proxy closed", http.StatusServiceUnavailable)
		return
	}
	p.handlers.Add(1)
	p.mu.Unlock()
	defer p.handlers.Done()

	// A client disconnect or Close cancels everything of this exchange.
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stop := context.AfterFunc(p.ctx, cancel)
	defer stop()

	x := newExchange(p, w, r, ctx)
	x.run()
	if x.abort {
		// A reset: the client sees a broken or truncated response.
		panic(http.ErrAbortHandler)
	}
	drainUpload(w, r)
}

// drainUpload reads what is left of the client's upload, for at most 1 s, after
// the response: Envoy does so after a local reply (delayed_close_timeout), so
// that a client still sending its body reads the early 413 instead of a reset,
// which is what net/http would give it.
func drainUpload(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	if rc.Flush() != nil || rc.SetReadDeadline(time.Now().Add(time.Second)) != nil {
		return
	}
	_, _ = io.Copy(io.Discard, r.Body)
}
