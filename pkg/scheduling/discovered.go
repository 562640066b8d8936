package scheduling

import (
	"cmp"
	"slices"
)

// Discovered is an endpoint that a discovery source outside this package (the
// Kubernetes API, pkg/discovery) found: its address and, for kv-sglang
// prefills, a bootstrap port of its own.
type Discovered struct {
	Addr string
	// BootstrapPort overrides the pool's bootstrap port for this endpoint; 0
	// keeps the pool's.
	BootstrapPort int
	// ID is what the source knows the engine by (a pod's UID); "" when it
	// knows nothing. An address listed under another ID than before is
	// another engine, the network having given the address of one that
	// ended to a new one: it starts anew, with nothing of the engine before.
	ID string
	// engine is, with an ID, the address and ID: the name the prefix memory
	// knows the engine by (Endpoint.engine). SetDiscovered sets it.
	engine string
}

// SetDiscovered makes eps the pool's discovered endpoints, beside the static
// and DNS ones. As with a config reload, an address that stays keeps its
// Endpoint (requests in flight, health, scraped load, prefix memory), unless
// its ID changed: another engine has it; one that goes is no longer picked
// from the moment this returns. A discovery source
// calls it with its whole current set after each change it observes.
func (p *Pool) SetDiscovered(eps []Discovered) {
	eps = slices.Clone(eps)
	// Of two pods listed at one address, the same one each time.
	slices.SortFunc(eps, func(a, b Discovered) int { return cmp.Or(cmp.Compare(a.Addr, b.Addr), cmp.Compare(a.ID, b.ID)) })
	eps = slices.CompactFunc(eps, func(a, b Discovered) bool { return a.Addr == b.Addr })
	for i, d := range eps {
		if d.ID != "" {
			eps[i].engine = canonical(d.Addr) + " " + d.ID
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if slices.Equal(eps, p.discovered) {
		return
	}
	p.discovered = eps
	p.rebuild()
}

// BootstrapPort is e's bootstrap port (SGLang's, Mooncake's), as its
// requests name it: e's own, else the pool's (pools.prefill.bootstrap_port).
func (p *Pool) BootstrapPort(e *Endpoint) int { return e.BootstrapPort(p.probe.bootstrapPort) }

// BootstrapPort is the endpoint's SGLang bootstrap port: the one its engine
// reports (serverinfo.go), else the one discovery gave it, else poolPort.
func (e *Endpoint) BootstrapPort(poolPort int) int {
	if i := e.info.Load(); i != nil && i.bootstrapPort > 0 {
		return i.bootstrapPort
	}
	if d := e.found.Load(); d != nil && d.BootstrapPort > 0 {
		return d.BootstrapPort
	}
	return poolPort
}

// anotherEngine says whether d, as a discovery source now lists e's
// address, names another engine than the one e is of: both have an ID, and
// they differ. Nothing of e (its requests in flight, ejection, checks'
// verdict, scraped load, server info) is the new engine's.
func (e *Endpoint) anotherEngine(d *Discovered) bool {
	was := e.found.Load()
	return d != nil && was != nil && d.ID != "" && was.ID != "" && d.ID != was.ID
}

// engine is the name of e's engine in the prefix memory (prefixIndex): its
// address, with the engine's ID when discovery names one, so that what was
// sent to a pod is not credited to another pod given its IP, whether at once
// or after the address was gone a while: its cache holds none of it.
func (e *Endpoint) engine() string {
	if d := e.found.Load(); d != nil && d.engine != "" {
		return d.engine
	}
	return e.Addr
}
