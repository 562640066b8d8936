package scheduling

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// An SGLang prefill engine listens for its decode engines' bootstrap on a
// port of its own (--disaggregation-bootstrap-port), and tells it, with its
// disaggregation mode, in its server info: GET /server_info, /get_server_info
// before that name (python/sglang/srt/entrypoints/http_server.py, both the
// server's arguments as JSON). SGLang's own gateway reads it there too. A
// kv-sglang prefill pool asks each of its engines, so that engines sharing a
// host, each on its own port, are each named with theirs.
const (
	serverInfoEvery   = 5 * time.Second // an engine not yet read is asked again after this
	serverInfoRefresh = time.Minute     // one read is asked again after this (a restart may change it)
	maxServerInfo     = 4 << 20         // SGLang's answer is some 150 KiB
)

var serverInfoPaths = []string{"/server_info", "/get_server_info"}

// serverInfo is what an engine last said of itself, or why it said nothing.
type serverInfo struct {
	bootstrapPort int               // 0: not said
	mode          string            // disaggregation_mode: prefill, decode or null
	engineIDs     map[string]string // kv-mooncake: the engine id of each data-parallel rank
	ranks         []string          // engineIDs' ranks, sorted
	err           string            // why the last read failed; "" when it did not
	at            time.Time
	// ejections is the endpoint's count when it was read: an engine taken
	// out of rotation since may come back restarted with another port, and
	// is asked again at the next round.
	ejections uint64
}

// ReadsBootstrapPorts says whether the pool asks its engines for their
// bootstrap ports: a kv-sglang prefill pool.
func (p *Pool) ReadsBootstrapPorts() bool { return p.probe.rendezvous == kv.SGLangBootstrapPort }

// paired keeps, of the candidates, those a leg can be paired with: under
// kv-sglang the engines asked first; under kv-mooncake the pairable ones.
func (p *Pool) paired(eps []*Endpoint) []*Endpoint {
	switch p.probe.rendezvous {
	case kv.SGLangBootstrapPort:
		return askedFirst(eps)
	case kv.MooncakeEngineIDs:
		return slices.DeleteFunc(eps, func(e *Endpoint) bool { return !p.pairable(e) })
	}
	return eps
}

// pairable says whether a leg can be paired with e: under kv-mooncake only
// once its engine ids were read.
func (p *Pool) pairable(e *Endpoint) bool {
	return p.probe.rendezvous != kv.MooncakeEngineIDs || e.Ranks() > 0
}

// askedFirst keeps, of a kv-sglang prefill pool's candidates, those whose
// engines were asked for their bootstrap port (answered or not), if any
// were: an engine that joined a moment ago is not sent with the pool's port
// while it may listen on another. A pool none of whose engines was asked yet
// (it starts) is used with the ports the config gives.
func askedFirst(eps []*Endpoint) []*Endpoint {
	asked := func(e *Endpoint) bool { return e.info.Load() != nil }
	if !slices.ContainsFunc(eps, asked) {
		return eps
	}
	return slices.DeleteFunc(eps, func(e *Endpoint) bool { return !asked(e) })
}

// readServerInfo asks the endpoints that were never read, or not for a
// while, for their server info.
func (p *Pool) readServerInfo(ctx context.Context, st *poolState, eps []*Endpoint) {
	now := p.deps.Now()
	timeout := cmp.Or(st.spec.Health.CheckTimeout.D(), config.DefaultCheckTimeout)
	due := slices.DeleteFunc(slices.Clone(eps), func(e *Endpoint) bool {
		old := e.info.Load()
		return old != nil && old.err == "" && now.Sub(old.at) < serverInfoRefresh && old.ejections == e.ejections.Load()
	})
	probeEach(due, func(e *Endpoint) {
		old := e.info.Load()
		ejections := e.ejections.Load()
		var info serverInfo
		if p.probe.rendezvous == kv.MooncakeEngineIDs {
			info = fetchEngineIDs(ctx, p.probe, p.bootstrapAddr(e), timeout)
		} else {
			info = fetchServerInfo(ctx, p.probe, e.Addr, timeout)
		}
		if ctx.Err() != nil {
			return
		}
		info.at, info.ejections = now, ejections
		if info.err != "" && old != nil {
			// A hiccup does not unlearn what was read; but an engine ejected
			// since may have restarted, with engine ids of its own.
			info.bootstrapPort, info.mode = old.bootstrapPort, old.mode
			if old.ejections == ejections {
				info.engineIDs, info.ranks = old.engineIDs, old.ranks
			}
		}
		e.info.Store(&info)
		p.logServerInfo(e.Addr, old, &info)
	})
}

// logServerInfo says what changed: a port learned or changed, a mode other
// than prefill, a read that began to fail.
func (p *Pool) logServerInfo(addr string, old, info *serverInfo) {
	if old == nil {
		old = &serverInfo{}
	}
	log := p.deps.Log.WithValues("pool", p.Name(), "endpoint", addr)
	if p.probe.rendezvous == kv.MooncakeEngineIDs {
		logEngineIDs(log, old, info)
		return
	}
	if info.err != "" {
		if info.err != old.err {
			log.Info("cannot read the engine's server info: its bootstrap port is taken from the config", "error", info.err)
		}
		return
	}
	if info.bootstrapPort != old.bootstrapPort {
		log.Info("the engine's bootstrap port, from its server info", "bootstrap_port", info.bootstrapPort)
	}
	if info.mode != old.mode && info.mode != "prefill" {
		log.Error(nil, "the engine is not an SGLang prefill server: the decode engine of every request sent to it waits for KV that never comes; start it with --disaggregation-mode prefill, or take it out of the prefill pool",
			"disaggregation_mode", info.mode)
	}
}

// fetchServerInfo asks the engine at addr, under its newer path and then its
// older one.
func fetchServerInfo(ctx context.Context, pr probe, addr string, timeout time.Duration) serverInfo {
	var info serverInfo
	var err error
	for _, path := range serverInfoPaths {
		var status int
		if info, status, err = getServerInfo(ctx, pr, pr.url(addr, path), timeout); status != http.StatusNotFound {
			break
		}
	}
	if err != nil {
		return serverInfo{err: err.Error()}
	}
	return info
}

func getServerInfo(ctx context.Context, pr probe, url string, timeout time.Duration) (serverInfo, int, error) {
	var body struct {
		Port *int   `json:"disaggregation_bootstrap_port"`
		Mode string `json:"disaggregation_mode"`
	}
	status, err := pr.getJSON(ctx, url, timeout, maxServerInfo, &body)
	if err != nil {
		return serverInfo{}, status, err
	}
	if body.Port == nil || *body.Port < 1 || *body.Port > 65535 {
		return serverInfo{}, status, fmt.Errorf("%s names no disaggregation_bootstrap_port", url)
	}
	return serverInfo{bootstrapPort: *body.Port, mode: body.Mode}, status, nil
}
