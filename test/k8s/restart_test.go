package k8s

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// Losing the API server keeps the last endpoints and serves on; when it is
// back, the informers list again and the pools converge, and no request is
// lost on the way. The API server is killed and started again; then
// extproc alone is cut off from it (a proxy between them) while pods change.
func TestAPIServerLossAndReturn(t *testing.T) {
	c := mustCluster(t)
	ns := c.namespace(t, "restart")
	proxy := startTCPProxy(t, c.url[len("https://"):])
	s := startStack(t, "https://"+proxy.addr, extprocToken, selectorConfig(ns))
	nixl := pdsim.ProtocolNIXL
	prefill := c.startEngine(t, ns, "prefill-0", pdsim.RolePrefill, nixl, map[string]string{roleLabel: "prefill"}, nil, nil)
	d0 := c.startEngine(t, ns, "decode-0", pdsim.RoleDecode, nixl, map[string]string{roleLabel: "decode"}, nil, nil)
	d1 := c.startEngine(t, ns, "decode-1", pdsim.RoleDecode, nixl, map[string]string{roleLabel: "decode"}, nil, nil)
	for _, e := range []*engine{prefill, d0, d1} {
		c.setReady(t, e, true)
	}
	eventually(t, "readiness", func() bool { code, _ := s.readyz(t); return code == http.StatusOK })
	eventually(t, "both decode pods", func() bool { return len(s.endpoints(t, "decode")) == 2 })

	// Requests flow, one after another, for the whole test.
	var sent, failed atomic.Int64
	var firstFailure atomic.Value
	ctx, stop := context.WithCancel(context.Background())
	var load sync.WaitGroup
	load.Go(func() {
		for i := 0; ctx.Err() == nil && i < 100000; i++ {
			resp, body, err := s.post(context.Background(), fmt.Sprintf("flowing %d", i))
			sent.Add(1)
			if err != nil || resp.StatusCode != http.StatusOK || resp.Header.Get("x-pdsim-kv") != "hit" {
				failed.Add(1)
				firstFailure.CompareAndSwap(nil, fmt.Sprintf("%v %v %.200s", err, resp, body))
			}
		}
	})
	defer func() { stop(); load.Wait() }()
	reachable := `pd_extproc_discovery_api_reachable{pool="decode"}`
	progress := func(what string) {
		t.Helper()
		n := sent.Load()
		eventually(t, what, func() bool { return sent.Load() >= n+5 })
	}

	t.Run("API server killed and restarted", func(t *testing.T) {
		c.stopAPI()
		eventually(t, "the loss to be noticed", func() bool { return s.metric(t, reachable) == 0 })
		progress("requests to flow without the API server")
		if code, text := s.readyz(t); code != http.StatusOK {
			t.Errorf("/readyz without the API server = %d %q; want ready on the last endpoints", code, text)
		}
		if got := s.metric(t, `pd_extproc_discovery_errors_total{pool="decode",reason="unreachable"}`); got < 1 {
			t.Errorf("discovery_errors_total{unreachable} = %v, want the loss counted", got)
		}
		if _, text := s.readyz(t); !containsAll(text, "API server unreachable", "last error") {
			t.Errorf("/readyz?verbose does not show the loss:\n%s", text)
		}
		if err := c.startAPI(); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the API server to be reached again", func() bool { return s.metric(t, reachable) == 1 })
		progress("requests to flow after the return")
	})

	outer := t // what outlives a subtest: the pod it starts serves until the load stops
	t.Run("changes while cut off converge on return", func(t *testing.T) {
		proxy.cut()
		eventually(t, "the loss to be noticed", func() bool { return s.metric(t, reachable) == 0 })
		c.setReady(t, d0, false)
		d2 := c.startEngine(outer, ns, "decode-2", pdsim.RoleDecode, nixl, map[string]string{roleLabel: "decode"}, nil, nil)
		c.setReady(t, d2, true)
		progress("requests to flow while cut off")
		if eps := sorted(s.endpoints(t, "decode")); !slices.Equal(eps, sorted([]string{d0.addr(), d1.addr()})) {
			t.Fatalf("while cut off the decode pool changed to %v: it should keep the last endpoints known", eps)
		}
		proxy.restore()
		eventually(t, "the pools to converge", func() bool {
			return slices.Equal(sorted(s.endpoints(t, "decode")), sorted([]string{d1.addr(), d2.addr()}))
		})
		progress("requests to flow after converging")
	})

	stop()
	load.Wait()
	if failed.Load() > 0 {
		t.Errorf("%d of %d requests failed; the first: %v", failed.Load(), sent.Load(), firstFailure.Load())
	}
	t.Logf("%d requests, none lost", sent.Load())
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// tcpProxy forwards a loopback port to the API server; cut closes the port
// and every connection through it, restore opens it again.
type tcpProxy struct {
	addr, target string
	mu           sync.Mutex
	ln           net.Listener
	conns        map[net.Conn]bool
	wg           sync.WaitGroup
}

func startTCPProxy(t *testing.T, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{addr: ln.Addr().String(), target: target, conns: map[net.Conn]bool{}}
	p.serve(ln)
	t.Cleanup(func() { p.cut(); p.wg.Wait() })
	return p
}

func (p *tcpProxy) serve(ln net.Listener) {
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	p.wg.Go(func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", p.target)
			if err != nil {
				in.Close()
				continue
			}
			p.mu.Lock()
			p.conns[in], p.conns[out] = true, true
			p.mu.Unlock()
			p.wg.Go(func() { io.Copy(out, in); out.Close() })
			p.wg.Go(func() { io.Copy(in, out); in.Close() })
		}
	})
}

func (p *tcpProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for conn := range p.conns {
		conn.Close()
	}
	clear(p.conns)
}

func (p *tcpProxy) restore() {
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		panic(err) // the port was ours a moment ago
	}
	p.serve(ln)
}
