// Package scheduling owns the endpoint pools and the choice of an endpoint for
// each leg of a request.
package scheduling

import (
	"math/rand/v2"
	"slices"
	"sync/atomic"
)

// Endpoint is one engine server, addressed as ip:port.
type Endpoint struct {
	Addr     string
	inflight atomic.Int64
}

// InFlight returns the number of requests currently holding the endpoint.
func (e *Endpoint) InFlight() int64 { return e.inflight.Load() }

// Acquire counts one more request on the endpoint; the returned func releases it
// and is safe to call more than once.
func (e *Endpoint) Acquire() (release func()) {
	e.inflight.Add(1)
	var done atomic.Bool
	return func() {
		if done.CompareAndSwap(false, true) {
			e.inflight.Add(-1)
		}
	}
}

// Pool is a named set of endpoints of one role (prefill or decode).
type Pool struct {
	Name      string
	endpoints []*Endpoint
}

// NewPool returns a pool over addrs.
func NewPool(name string, addrs []string) *Pool {
	p := &Pool{Name: name}
	for _, a := range addrs {
		p.endpoints = append(p.endpoints, &Endpoint{Addr: a})
	}
	return p
}

// Endpoints returns the pool's endpoints.
func (p *Pool) Endpoints() []*Endpoint { return p.endpoints }

// Pick returns the least-loaded endpoint not in exclude, using power-of-two
// choices: two random candidates compared, so that concurrent pickers that see
// the same counts do not all pile onto one endpoint. It returns nil when no
// endpoint is eligible.
func (p *Pool) Pick(exclude ...string) *Endpoint {
	eligible := make([]*Endpoint, 0, len(p.endpoints))
	for _, e := range p.endpoints {
		if !slices.Contains(exclude, e.Addr) {
			eligible = append(eligible, e)
		}
	}
	switch len(eligible) {
	case 0:
		return nil
	case 1:
		return eligible[0]
	}
	i := rand.IntN(len(eligible))
	j := rand.IntN(len(eligible) - 1)
	if j >= i {
		j++
	}
	a, b := eligible[i], eligible[j]
	if b.InFlight() < a.InFlight() {
		return b
	}
	return a
}
