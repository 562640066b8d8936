// Package scheduling owns the endpoint pools and the choice of an endpoint for
// each leg of a request: endpoint state (requests in flight, health, the
// engines' own load), pickers built from small scorers, the P/D decider, and
// live updates from config reloads, DNS and discovery sources (SetDiscovered).
package scheduling

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kvevents"
)

// Why a pool had no endpoint for a request; test with errors.Is. The pipeline
// answers 503 for each.
var (
	ErrEmpty     = errors.New("the pool has no endpoints")
	ErrSubset    = errors.New("no endpoint of the pool is in the subset hint")
	ErrTried     = errors.New("every endpoint has been tried")
	ErrUnhealthy = errors.New("every endpoint is unhealthy")
)

// PoolSpec is one pool's configuration: its static endpoints and how it picks.
type PoolSpec struct {
	Endpoints []string
	config.PoolScheduling
	// turnQueueSlack, when not 0, ranks a conversation's later turns over
	// the whole pool (prefixAffinity.home) and, placed without a trusted
	// view, bounds those that follow their history at the mean queue + 3 ×
	// it: NewPools sets it on the decode pool whose picks the P/D decider's
	// cache rule reads (Decider.decodeSpec), and on the prefill pool
	// (prefillSpec).
	turnQueueSlack float64
	// paired: the engines serve only P/D pairs (Spec.Paired; Pool.panics).
	paired bool
}

// Pool is a named set of endpoints of one role (prefill or decode) and the
// policy that picks among them. It is safe for concurrent use. Update swaps
// endpoints and policy atomically; an endpoint that stays keeps its state.
// Its endpoints are the static ones of its spec, then those DNS resolved,
// then those a discovery source set (SetDiscovered).
type Pool struct {
	deps Deps
	// probe is how checks and scrapes reach the engines (see NewPools), and
	// its role the pool's: the decode pool follows the endpoint-picker
	// subset hint (see NewPools), and panics.
	probe probe

	mu      sync.Mutex // serialises changes
	spec    PoolSpec
	specGen uint64 // Updates so far
	// resolved are the addresses DNS answered for resolvedName: the spec's
	// name, or, until a name a reload set first answers, the old one, still
	// looked up meanwhile; with no name, the static endpoints the reload
	// replaced (warm).
	resolved     []string
	resolvedName string
	skipped      map[string][]string // by DNS name, what its last answer named of no engine (engines)
	// discovered come from a discovery source (SetDiscovered), sorted by address.
	discovered []Discovered
	// departed are endpoints that left the pool while they still mattered
	// (departing): one that comes back (a pod failing readiness for a
	// moment, a DNS answer without it) is the same Endpoint again, with its
	// requests in flight and its ejection; not when discovery names another
	// engine at its address (Discovered.ID).
	departed map[string]*Endpoint
	settings atomic.Pointer[settings]
	state    atomic.Pointer[poolState]
	events   atomic.Pointer[poolEvents] // nil unless the pool follows its engines' KV events
	// eventCounts are the KV event subscribers' totals, kept across the
	// subscribers a reload of kv_events replaces.
	eventCounts kvevents.Counts
}

// poolState is one immutable generation of a pool.
type poolState struct {
	endpoints []*Endpoint
	members   map[*Endpoint]bool // endpoints as a set: whether one is still in the pool
	// gone are the endpoints that left the pool within rerankWindow
	// (Endpoint.moved), as conversations they held are placed anew.
	gone    []*Endpoint
	picker  Picker
	spec    PoolSpec
	specGen uint64        // the Update whose spec it has
	changed chan struct{} // closed when the next generation replaces this one
	models  atomic.Pointer[modelCounts]
}

func newPool(pr probe, spec PoolSpec, deps Deps) *Pool {
	p := &Pool{deps: deps.withDefaults(), probe: pr, skipped: map[string][]string{}}
	p.Update(spec)
	return p
}

// Name is the pool's role, prefill or decode, as metrics and logs label it.
func (p *Pool) Name() string { return p.probe.role.String() }

// decode says whether this is the decode pool.
func (p *Pool) decode() bool { return p.probe.role == roleDecode }

// Endpoints returns the pool's current endpoints.
func (p *Pool) Endpoints() []*Endpoint { return p.state.Load().endpoints }

// Fallbacks is how many extra endpoints the pool's spec asks SelectN for.
func (p *Pool) Fallbacks() int { return p.state.Load().spec.Fallbacks }

// Select picks the endpoint for req among the healthy endpoints that are not
// in exclude (endpoints already tried) and, in the decode pool, are in req's
// subset hint. The error says why there is none: ErrEmpty, ErrSubset,
// ErrTried or ErrUnhealthy.
func (p *Pool) Select(req *Request, exclude ...string) (*Endpoint, error) {
	st := p.state.Load()
	cands, err := p.candidates(st, req, exclude)
	if err != nil {
		return nil, err
	}
	return st.pick(req, cands), nil
}

// SelectN returns up to n distinct endpoints, the policy's choice first and
// then the least busy others: the fallback list Envoy may retry down. Only the
// first is remembered by the policy; acquire it alone.
func (p *Pool) SelectN(req *Request, n int, exclude ...string) ([]*Endpoint, error) {
	st := p.state.Load()
	cands, err := p.candidates(st, req, exclude)
	if err != nil {
		return nil, err
	}
	first := st.pick(req, cands)
	if n <= 1 { // no fallbacks (the default): nothing to rank
		return []*Endpoint{first}, nil
	}
	// The n-1 least busy others, of equals the first listed: each read
	// once, kept in order as they come, not the whole pool sorted.
	best := make([]ranked, 0, n-1)
	for _, r := range busyness(cands) {
		if r.e == first {
			continue
		}
		i := len(best)
		for i > 0 && best[i-1].busy > r.busy {
			i--
		}
		if i == n-1 {
			continue
		}
		if len(best) < n-1 {
			best = append(best, ranked{})
		}
		copy(best[i+1:], best[i:len(best)-1])
		best[i] = r
	}
	out := []*Endpoint{first}
	for _, r := range best {
		out = append(out, r.e)
	}
	return out, nil
}

// Ready reports whether some endpoint could take a request now: a healthy
// one, or in a pool that panics one that only passive health keeps out; in a
// kv-mooncake prefill pool, one whose engine ids were read.
func (p *Pool) Ready() bool {
	if p == nil {
		return false
	}
	st := p.state.Load()
	for _, e := range st.endpoints {
		if (e.Healthy() || p.panics(st) && !e.CheckedDown()) && p.pairable(e) {
			return true
		}
	}
	return false
}

func (p *Pool) candidates(st *poolState, req *Request, exclude []string) ([]*Endpoint, error) {
	if len(st.endpoints) == 0 {
		return nil, fmt.Errorf("%s: %w", p.Name(), ErrEmpty)
	}
	sc := p.scopeOf(st, req)
	if req != nil {
		req.absent, req.modelOnly = nil, sc.only
	}
	out := make([]*Endpoint, 0, len(st.endpoints))
	var ejected, down []*Endpoint // kept out by passive health alone; by either
	allowed, untried := 0, 0
	for _, e := range st.endpoints {
		if !sc.admits(e) {
			continue
		}
		allowed++
		if slices.Contains(exclude, e.Addr) {
			continue
		}
		untried++
		switch {
		case e.Healthy():
			out = append(out, e)
		case !e.CheckedDown():
			ejected = append(ejected, e)
			fallthrough
		default:
			down = append(down, e)
		}
	}
	switch {
	case allowed == 0:
		return nil, fmt.Errorf("%s: %w", p.Name(), ErrSubset)
	case untried == 0:
		return nil, fmt.Errorf("%s: %w", p.Name(), ErrTried)
	case len(out) == 0 && p.panics(st) && len(ejected) > 0:
		// Envoy's panic routing: failed requests alone never leave such a
		// pool empty (a client whose requests make every engine answer 5xx,
		// engines overloaded or restarted for a moment).
		return p.paired(ejected), nil
	case len(out) == 0:
		return nil, fmt.Errorf("%s: %w", p.Name(), ErrUnhealthy)
	}
	if out = p.paired(out); len(out) == 0 {
		return nil, fmt.Errorf("%s: no engine's Mooncake bootstrap server has told its engine id yet", p.Name())
	}
	if req != nil && len(down)+len(st.gone) > 0 { // nothing to read the clock for, most often
		now := p.deps.Now()
		for _, e := range slices.Concat(down, st.gone) {
			if recentlyMoved(e, now) {
				req.absent = append(req.absent, e)
			}
		}
	}
	return out, nil
}

// panics: the pool routes among its candidates when passive health ejected them all (Envoy's
// panic routing), as requests have no way around it; a prefill pool's may go decode-only.
func (p *Pool) panics(st *poolState) bool { return p.decode() || st.spec.paired }

// rerankWindow is how long an endpoint that joined, left or was taken out
// of rotation is taken to have moved conversations: a later turn that ranks
// its endpoint first is not assumed to find its previous request there
// (prefixAffinity.estimate), as that request may have gone by another
// ranking. Some minutes of a conversation's turns; past them, the engines'
// answers tell (cacheTrust).
const rerankWindow = 5 * time.Minute

func recentlyMoved(e *Endpoint, now time.Time) bool {
	at := e.moved.Load()
	return at != 0 && now.Sub(time.Unix(0, at)) < rerankWindow
}

// Update replaces the pool's configuration. Endpoints whose address stays keep
// their Endpoint (requests in flight, health, scraped load); the policy keeps
// its memory (the prefix index) unless the policy's own keys changed.
func (p *Pool) Update(spec PoolSpec) {
	spec.SetDefaults()
	spec.Endpoints = slices.Clone(spec.Endpoints)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.warm(spec)
	p.spec = spec
	p.specGen++
	p.rebuild()
}

func (p *Pool) rebuild() {
	old := p.state.Load()
	s := p.spec
	p.settings.Store(&settings{
		now:         p.deps.Now,
		failures:    s.Health.ConsecutiveFailures,
		ejection:    s.Health.BaseEjection.D(),
		maxEjection: s.Health.MaxEjection.D(),
		staleAfter:  s.Metrics.StaleAfter.D(),
		unhealthy:   s.Health.UnhealthyThreshold,
		healthy:     s.Health.HealthyThreshold,
	})

	now := p.deps.Now()
	keep := map[string]*Endpoint{}
	for a, e := range p.departed {
		if e.departing(now) {
			keep[a] = e
		}
	}
	if old != nil {
		for _, e := range old.endpoints {
			keep[e.Addr] = e
		}
	}
	var eps []*Endpoint
	seen := map[string]bool{}
	add := func(a string, d *Discovered) {
		a = canonical(a)
		if seen[a] {
			return
		}
		seen[a] = true
		e := keep[a]
		if e == nil || e.anotherEngine(d) {
			e = newEndpoint(a, &p.settings)
			if old != nil { // joins a pool already routing
				e.moved.Store(now.UnixNano())
			}
		}
		e.found.Store(d)
		if s.Health.CheckInterval <= 0 {
			e.unchecked() // checks are off: a down verdict no longer holds
		}
		eps = append(eps, e)
	}
	for _, a := range slices.Concat(s.Endpoints, p.resolved) {
		add(a, nil)
	}
	for _, d := range p.discovered {
		add(d.Addr, &d)
	}
	gone := goneSince(old, seen, now) // marks those leaving now moved, as departing reads
	p.departed = nil
	for a, e := range keep {
		if !seen[a] && e.departing(now) {
			if p.departed == nil {
				p.departed = map[string]*Endpoint{}
			}
			p.departed[a] = e
		}
	}
	members := make(map[*Endpoint]bool, len(eps))
	for _, e := range eps {
		members[e] = true
	}
	p.state.Store(counted(&poolState{endpoints: eps, members: members, gone: gone, picker: p.pickerAfter(old),
		spec: s, specGen: p.specGen, changed: make(chan struct{})}))
	if old != nil {
		close(old.changed)
	}
}

// pickerAfter is the policy of the state that follows old: old's own while
// the policy and its prefix settings stay, else a new one, which remembers
// what old's prefix affinity learned.
func (p *Pool) pickerAfter(old *poolState) Picker {
	s := p.spec
	if old != nil && old.spec.Policy == s.Policy && old.spec.Prefix == s.Prefix && old.spec.turnQueueSlack == s.turnQueueSlack {
		return old.picker
	}
	picker := newPicker(s, p.probe.role, p.deps.intn, p.cache)
	if pa, ok := picker.(*prefixAffinity); ok && old != nil {
		return pa.remembering(old.picker)
	}
	return picker
}

// goneSince is what left the pool with the state that follows old, whose
// endpoints are seen: old's endpoints not seen (marked moved now), and those
// that left before, are not back and moved lately. The conversations they
// held rank anew.
func goneSince(old *poolState, seen map[string]bool, now time.Time) []*Endpoint {
	if old == nil {
		return nil
	}
	var gone []*Endpoint
	for _, e := range old.endpoints {
		if !seen[e.Addr] {
			e.moved.Store(now.UnixNano())
			gone = append(gone, e)
		}
	}
	for _, e := range old.gone {
		if !seen[e.Addr] && recentlyMoved(e, now) {
			gone = append(gone, e)
		}
	}
	return gone
}

// has says whether e is one of the state's endpoints.
func (st *poolState) has(e *Endpoint) bool { return st.members[e] }

// canonical is addr in the one spelling of its IP (lower case, zeros
// compressed, IPv4 not mapped into IPv6): one engine is one endpoint
// whichever source lists it and however, and ranks alike on every replica.
func canonical(addr string) string {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return addr
	}
	return unmapped(ap).String()
}
