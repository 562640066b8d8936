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
	"github.com/pd-extproc/pd-extproc/pkg/enginehttp"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// Spec is the whole scheduling configuration, as the config file gives it.
type Spec struct {
	Prefill, Decode PoolSpec
	PD              config.PD
	// Paired engines serve only prefill/decode pairs (SGLang in PD mode): they
	// hand off n > 1 and batches themselves, and nothing may go decode-only.
	Paired bool
	// Rendezvous is what the prefill pool reads of each engine for the
	// connector (kv.Connector.Rendezvous), BootstrapPort where an engine
	// tells nothing of its own.
	Rendezvous    kv.Rendezvous
	BootstrapPort int
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
	// PrefillKey and DecodeKey are the API keys a pool's requests carry
	// (prefill.api_key_file, pools.decode.api_key_file); nil: none.
	PrefillKey, DecodeKey *enginehttp.Key

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
	decider := newDecider(spec)
	prefill := deps.probe(rolePrefill, deps.PrefillTLS, deps.PrefillKey, clientGiven)
	prefill.rendezvous, prefill.bootstrapPort = spec.Rendezvous, spec.BootstrapPort
	// Only the decode pool follows the subset hint: it names candidates for
	// Envoy's destination, the decode leg; the prefill leg is ours to place.
	ps := &Pools{
		Prefill: newPool(prefill, prefillSpec(spec), deps),
		Decode:  newPool(deps.probe(roleDecode, deps.DecodeTLS, deps.DecodeKey, clientGiven), decider.decodeSpec(spec.Decode), deps),
		deps:    deps,
	}
	ps.decider.Store(decider)
	return ps
}

// prefillSpec is the prefill pool's spec, paired when its engines serve
// only pairs (Pool.panics); while its engines keep what they write
// (keepTurns), a conversation's later turns ranked over the whole pool
// (prefixAffinity.home), and kept with their history at their home up to
// the mean queue + 3 × max(queue_slack, 4) while its engine does
// (prefixAffinity.follows). Behind replicas that take turns, each
// routes some of a conversation's turns; one spilled at the usual bound (a
// FIFO prefill queue passes the mean + 1 often) recomputes its history on
// another engine, and the next, on another replica, goes back home, where
// the turn before is missing. In the P/D simulation that took always-P/D's
// prefill pool from 66 to 93 % busy at three replicas (docs/scheduling.md).
func prefillSpec(spec Spec) PoolSpec {
	s := spec.Prefill
	s.SetDefaults()
	s.paired = spec.Paired
	s.turnQueueSlack = max(s.Prefix.QueueSlack, config.DefaultDecodeQueueSlack)
	return s
}

// Update applies a reloaded configuration: endpoints, policies, health and
// P/D thresholds. Requests in flight are not disturbed.
func (ps *Pools) Update(spec Spec) {
	decider := newDecider(spec)
	ps.Prefill.Update(prefillSpec(spec))
	ps.Decode.Update(decider.decodeSpec(spec.Decode))
	ps.decider.Store(decider)
}

// Decide chooses P/D or decode-only for req, whose decode endpoint the
// decode pool picked: decode.
func (ps *Pools) Decide(req *Request, decode *Endpoint) Split {
	return ps.decider.Load().Decide(req, ps.Prefill, ps.Decode, decode)
}

// Run does the pools' background work until ctx is done: active health
// checks, /metrics scrapes, DNS resolution and KV events, each as configured
// (and reconfigured) per pool, the models each engine serves, and a kv-sglang
// or kv-mooncake prefill pool's server info. It returns once all of it has stopped.
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
		p.every(ctx, func(s PoolSpec) time.Duration { return s.Health.CheckInterval.D() }, true, func(st *poolState, eps []*Endpoint) {
			h := st.spec.Health
			checkAll(ctx, p.probe, eps, h.CheckPath, h.CheckTimeout.D(), p.checked)
		})
	})
	wg.Go(func() {
		p.every(ctx, func(s PoolSpec) time.Duration { return s.Metrics.Interval.D() }, true, func(st *poolState, eps []*Endpoint) {
			p.scrapeAll(ctx, eps, st.spec.Metrics.Path, st.spec.Metrics.Timeout.D())
		})
	})
	wg.Go(func() { p.followEvents(ctx) })
	wg.Go(func() {
		p.every(ctx, func(PoolSpec) time.Duration { return serverInfoEvery }, true, func(st *poolState, eps []*Endpoint) {
			p.readModels(ctx, st, eps)
		})
	})
	if p.probe.rendezvous != kv.NoRendezvous {
		wg.Go(func() {
			p.every(ctx, func(PoolSpec) time.Duration { return serverInfoEvery }, true, func(st *poolState, eps []*Endpoint) {
				p.readServerInfo(ctx, st, eps)
			})
		})
	}
	wg.Go(func() {
		p.every(ctx, func(s PoolSpec) time.Duration {
			if s.DNS == "" {
				return 0
			}
			return s.DNSInterval.D()
		}, false, func(*poolState, []*Endpoint) {
			for _, name := range p.dnsNames() {
				p.resolve(ctx, name)
			}
		})
	})
	wg.Wait()
	p.probe.client.CloseIdleConnections() // leave no keep-alive goroutines behind
}

// every runs work on the pool's endpoints now and then every period of its
// current spec; a zero period pauses until the spec changes. A new spec
// (Update) restarts the cycle, so that settings take effect at once. A
// change of the endpoints alone does not: with joined, the endpoints that
// joined get their work at once and the others wait for the cycle, so that
// a pool whose endpoints change often (a rollout, a DNS name answering
// varied subsets, discovery flapping) does not multiply the work, nor a
// DNS lookup that changes the endpoints call for another at once.
func (p *Pool) every(ctx context.Context, period func(PoolSpec) time.Duration, joined bool, work func(*poolState, []*Endpoint)) {
	timer := time.NewTimer(0)
	defer timer.Stop()
	var st *poolState
	var d time.Duration
	restart := true
	for {
		if restart {
			st, d = p.state.Load(), 0
			timer.Stop()
			if d = period(st.spec); d > 0 {
				work(st, st.endpoints)
				timer.Reset(d)
			}
		}
		var tick <-chan time.Time
		if d > 0 {
			tick = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case <-tick:
			restart = true
		case <-st.changed:
			next := p.state.Load()
			if restart = next.specGen != st.specGen; restart {
				continue
			}
			if joined && d > 0 {
				if fresh := newcomers(st, next); len(fresh) > 0 {
					work(next, fresh)
				}
			}
			st = next
		}
	}
}

// newcomers are the endpoints of next that were not in st.
func newcomers(st, next *poolState) []*Endpoint {
	var out []*Endpoint
	for _, e := range next.endpoints {
		if !st.has(e) {
			out = append(out, e)
		}
	}
	return out
}

// checked says whether an active check's verdict on e still applies: e is
// one of the pool's endpoints and checks are on. A verdict on an endpoint
// that left, or given after checks were turned off, would stand with no
// check left to clear it.
func (p *Pool) checked(e *Endpoint) bool {
	st := p.state.Load()
	return st.spec.Health.CheckInterval > 0 && st.has(e)
}
