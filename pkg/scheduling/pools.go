package scheduling

import (
	"context"
	"crypto/tls"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// Spec is the whole scheduling configuration, as the config file gives it.
type Spec struct {
	Prefill, Decode PoolSpec
	PD              config.PD
	// Paired engines serve only prefill/decode pairs (SGLang in PD mode): they
	// hand off n > 1 and batches themselves, and nothing may go decode-only.
	Paired bool
}

// Deps are the pools' outside world. Zero fields get the real thing.
type Deps struct {
	Now      func() time.Time
	Client   *http.Client // active health checks and /metrics scrapes
	Resolver Resolver     // DNS pools
	Log      logr.Logger
	// PrefillTLS and DecodeTLS make a pool's checks and scrapes HTTPS with
	// these settings (its engines' CA and name); nil: plain HTTP. A TLS pool
	// gets a client of its own unless Client is given.
	PrefillTLS, DecodeTLS *tls.Config

	intn func(int) int // random numbers in [0, n); simulations seed it
}

func (d Deps) withDefaults() Deps {
	if d.Now == nil {
		d.Now = time.Now
	}
	if d.Client == nil {
		d.Client = probeClient(nil)
	}
	if d.Resolver == nil {
		d.Resolver = net.DefaultResolver
	}
	if d.Log.GetSink() == nil {
		d.Log = logr.Discard()
	}
	if d.intn == nil {
		d.intn = rand.IntN
	}
	return d
}

// Pools is the prefill and decode pools and the P/D decider, updated together.
type Pools struct {
	Prefill, Decode *Pool
	decider         atomic.Pointer[Decider]
	deps            Deps
	tokenize        tokenizeHealth
}

// NewPools builds the pools. Call Run to start their background work.
func NewPools(spec Spec, deps Deps) *Pools {
	clientGiven := deps.Client != nil
	deps = deps.withDefaults()
	// Only the decode pool follows the subset hint: it names candidates for
	// Envoy's destination, the decode leg; the prefill leg is ours to place.
	ps := &Pools{
		Prefill: newPool("prefill", false, spec.Prefill, deps),
		Decode:  newPool("decode", true, spec.Decode, deps),
		deps:    deps,
	}
	ps.Prefill.probe = deps.probe(rolePrefill, deps.PrefillTLS, clientGiven)
	ps.Decode.probe = deps.probe(roleDecode, deps.DecodeTLS, clientGiven)
	ps.decider.Store(newDecider(spec))
	return ps
}

// Update applies a reloaded configuration: endpoints, policies, health and
// P/D thresholds. Requests in flight are not disturbed.
func (ps *Pools) Update(spec Spec) {
	ps.Prefill.Update(spec.Prefill)
	ps.Decode.Update(spec.Decode)
	ps.decider.Store(newDecider(spec))
}

// Decide chooses P/D or decode-only for req, whose decode endpoint the
// decode pool picked: decode.
func (ps *Pools) Decide(req *Request, decode *Endpoint) Split {
	return ps.decider.Load().Decide(req, ps.Prefill, decode)
}

// Run does the pools' background work until ctx is done: active health
// checks, /metrics scrapes and DNS resolution, each as configured (and
// reconfigured) per pool. It returns once all of it has stopped.
func (ps *Pools) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, p := range []*Pool{ps.Prefill, ps.Decode} {
		wg.Go(func() { p.Run(ctx) })
	}
	wg.Wait()
}

// Run does one pool's background work until ctx is done.
func (p *Pool) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() {
		p.every(ctx, func(s PoolSpec) time.Duration { return s.Health.CheckInterval.D() }, func(st *poolState) {
			h := st.spec.Health
			checkAll(ctx, p.probe, st.endpoints, h.CheckPath, h.CheckTimeout.D(), func() bool { return p.state.Load() == st })
		})
	})
	wg.Go(func() {
		p.every(ctx, func(s PoolSpec) time.Duration { return s.Metrics.Interval.D() }, func(st *poolState) {
			scrapeAll(ctx, p.probe, st.endpoints, st.spec.Metrics.Path, st.spec.Metrics.Timeout.D(), p.deps.Now)
		})
	})
	wg.Go(func() { p.followEvents(ctx) })
	wg.Go(func() {
		p.every(ctx, func(s PoolSpec) time.Duration {
			if s.DNS == "" {
				return 0
			}
			return s.DNSInterval.D()
		}, func(st *poolState) { p.resolve(ctx, st.spec.DNS) })
	})
	wg.Wait()
	p.probe.client.CloseIdleConnections() // leave no keep-alive goroutines behind
}

// every runs work now and then every period of the pool's current spec; a zero
// period pauses until the spec changes. A change restarts the cycle, so new
// endpoints and settings take effect at once.
func (p *Pool) every(ctx context.Context, period func(PoolSpec) time.Duration, work func(*poolState)) {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		st := p.state.Load()
		d := period(st.spec)
		if d > 0 {
			work(st)
			timer.Reset(d)
		}
		var tick <-chan time.Time
		if d > 0 {
			tick = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case <-st.changed:
			timer.Stop()
		case <-tick:
		}
	}
}
