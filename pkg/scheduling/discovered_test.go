package scheduling

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

func TestSetDiscovered(t *testing.T) {
	p, _ := testPool(t, policy(config.PolicyLeastLoad), "10.0.0.9:8000")
	p.SetDiscovered([]Discovered{{Addr: "10.0.0.2:8000", BootstrapPort: 9000}, {Addr: "10.0.0.1:8000"}, {Addr: "10.0.0.2:8000"}})
	want := []string{"10.0.0.9:8000", "10.0.0.1:8000", "10.0.0.2:8000"}
	if got := addrsOf(p.Endpoints()); !slices.Equal(got, want) {
		t.Fatalf("endpoints = %v, want static then discovered, sorted, deduplicated: %v", got, want)
	}
	kept := byAddr(p, "10.0.0.2:8000")
	release := acquire(kept)
	defer release()
	kept.ReportFailure()

	// The same pod updated (a new bootstrap port), another gone, one new: the
	// endpoint that stays keeps its requests and its failure count.
	p.SetDiscovered([]Discovered{{Addr: "10.0.0.3:8000"}, {Addr: "10.0.0.2:8000", BootstrapPort: 9001}})
	if got := addrsOf(p.Endpoints()); !slices.Equal(got, []string{"10.0.0.9:8000", "10.0.0.2:8000", "10.0.0.3:8000"}) {
		t.Fatalf("endpoints after the change = %v", got)
	}
	if byAddr(p, "10.0.0.2:8000") != kept || kept.InFlight() != 1 {
		t.Fatal("an address that stayed discovered lost its endpoint state")
	}
	tests := []struct {
		addr string
		want int
	}{
		{"10.0.0.2:8000", 9001}, // its own
		{"10.0.0.3:8000", 8998}, // the pool's
		{"10.0.0.9:8000", 8998}, // static: the pool's
	}
	for _, tc := range tests {
		if got := byAddr(p, tc.addr).BootstrapPort(8998); got != tc.want {
			t.Errorf("%s: bootstrap port %d, want %d", tc.addr, got, tc.want)
		}
	}

	// A config reload keeps what was discovered.
	p.Update(PoolSpec{Endpoints: nil, PoolScheduling: policy(config.PolicyRoundRobin)})
	if got := addrsOf(p.Endpoints()); !slices.Equal(got, []string{"10.0.0.2:8000", "10.0.0.3:8000"}) {
		t.Fatalf("endpoints after a reload = %v, want the discovered ones kept", got)
	}

	// Nothing discovered: the pool is empty, and a pick says so.
	p.SetDiscovered(nil)
	if _, err := p.Select(nil); err == nil {
		t.Fatal("Select on a pool whose discovered endpoints all left succeeded")
	}
}

func TestSetDiscoveredUnchangedKeepsTheGeneration(t *testing.T) {
	p, _ := testPool(t, policy(config.PolicyLeastLoad))
	p.SetDiscovered([]Discovered{{Addr: "10.0.0.1:8000"}})
	st := p.state.Load()
	p.SetDiscovered([]Discovered{{Addr: "10.0.0.1:8000"}})
	if p.state.Load() != st {
		t.Error("an unchanged set rebuilt the pool (restarting its health checks and scrapes)")
	}
}

// TestEndpointChangesDoNotRestartTheCycle: a pool whose endpoints change
// often (a rollout, a DNS name answering varied subsets) gives the periodic
// work (checks, scrapes) only to the endpoints that join, and none to a DNS
// lookup whose answer changed them; a new spec restarts the whole round.
// Each case's calls come in the order asserted, so a call the change should
// not have made shows as the wrong next one.
func TestEndpointChangesDoNotRestartTheCycle(t *testing.T) {
	for _, joined := range []bool{true, false} {
		t.Run(fmt.Sprintf("joined=%v", joined), func(t *testing.T) {
			spec := PoolSpec{Endpoints: []string{"10.0.0.9:8000"}}
			spec.Health.CheckInterval = config.Duration(time.Hour)
			p := poolOf(roleDecode, spec, Deps{})
			calls := make(chan []string)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() {
				defer close(done)
				p.every(ctx, func(s PoolSpec) time.Duration { return s.Health.CheckInterval.D() }, joined, func(_ *poolState, eps []*Endpoint) {
					select {
					case calls <- addrsOf(eps):
					case <-ctx.Done():
					}
				})
			}()
			defer func() { cancel(); <-done }()
			next := func(want ...string) {
				t.Helper()
				if got := <-calls; !slices.Equal(got, want) {
					t.Fatalf("work on %v, want %v", got, want)
				}
			}

			next("10.0.0.9:8000")
			p.SetDiscovered([]Discovered{{Addr: "10.0.0.1:8000"}})
			if joined {
				next("10.0.0.1:8000")
			}
			p.SetDiscovered([]Discovered{{Addr: "10.0.0.1:8000"}, {Addr: "10.0.0.2:8000"}})
			if joined {
				next("10.0.0.2:8000")
			}
			p.SetDiscovered([]Discovered{{Addr: "10.0.0.2:8000"}}) // one leaves, none joins
			p.Update(spec)                                         // the same settings, anew
			next("10.0.0.9:8000", "10.0.0.2:8000")
		})
	}
}

// An endpoint that leaves the pool and comes back (a pod failing readiness
// for a moment, a DNS answer without it) is the same endpoint while it still
// matters, with its requests in flight and its ejection; once it matters no
// more, the pool forgets it.
func TestAnEndpointThatComesBackKeepsItsState(t *testing.T) {
	tests := []struct {
		name     string
		inflight int
		fail     bool // three failures eject it
		wait     time.Duration
		wantSame bool
	}{
		{"requests in flight", 10, false, 0, true},
		{"ejected", 0, true, 0, true},
		{"ejected, the ejection over", 0, true, 2 * time.Second, false},
		{"nothing to keep", 0, false, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, policy(config.PolicyLeastLoad))
			a, b := Discovered{Addr: "10.0.0.1:8000"}, Discovered{Addr: "10.0.0.2:8000"}
			p.SetDiscovered([]Discovered{a, b})
			e := byAddr(p, a.Addr)
			for range tt.inflight {
				defer acquire(e)()
			}
			if tt.fail {
				for range 3 {
					e.ReportFailure()
				}
			}
			p.SetDiscovered([]Discovered{b})
			clock.Advance(tt.wait)
			p.SetDiscovered([]Discovered{a, b})
			back := byAddr(p, a.Addr)
			if same := back == e; same != tt.wantSame {
				t.Fatalf("the endpoint that came back is the one that left: %v, want %v", same, tt.wantSame)
			}
			if tt.wantSame && (back.InFlight() != int64(tt.inflight) || back.Healthy() == tt.fail) {
				t.Errorf("back with %d in flight, healthy %v; want %d, healthy %v", back.InFlight(), back.Healthy(), tt.inflight, !tt.fail)
			}
			if p.SetDiscovered([]Discovered{b}); !tt.wantSame && len(p.departed) != 0 {
				t.Errorf("%d departed endpoints kept with nothing to keep", len(p.departed))
			}
		})
	}
}

// An address that another pod takes (the network gave the IP of a pod that
// ended to a new one) is another engine: it starts with nothing of the one
// before, neither its requests in flight nor its ejection, checks' verdict
// or server info, and takes requests at once. The same pod back, or an
// address no source names a pod of (static, DNS), is the same endpoint.
func TestAnAddressAnotherPodTakesStartsAnew(t *testing.T) {
	const addr, other = "10.0.0.1:8000", "10.0.0.2:8000"
	tests := []struct {
		name           string
		before, after  string // the IDs discovery gives addr
		absent         bool   // a set without addr between the two
		inflight       int
		eject, down    bool
		wantSame       bool
		wantPickedAddr string // least-load's pick of addr and other, other holding a request
	}{
		{"ejected, another pod", "pod-a", "pod-b", true, 0, true, false, false, addr},
		{"checked down, another pod", "pod-a", "pod-b", true, 0, false, true, false, addr},
		{"requests in flight, another pod", "pod-a", "pod-b", true, 3, false, false, false, addr},
		{"ejected, another pod in the next set", "pod-a", "pod-b", false, 0, true, false, false, addr},
		{"ejected, the same pod back", "pod-a", "pod-a", true, 0, true, false, true, other},
		{"ejected, no pod named", "", "", true, 0, true, false, true, other},
		{"ejected, a pod named now", "", "pod-b", false, 0, true, false, true, other},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := policy(config.PolicyLeastLoad)
			s.Health.CheckInterval = config.Duration(time.Minute) // on, but not run here
			p, _ := testPool(t, s)
			p.SetDiscovered([]Discovered{{Addr: addr, ID: tt.before}, {Addr: other, ID: "pod-o"}})
			e := byAddr(p, addr)
			e.info.Store(&serverInfo{bootstrapPort: 9001})
			for range tt.inflight {
				defer acquire(e)()
			}
			if tt.eject {
				eject(p, addr)
			}
			if tt.down {
				checkDown(p, addr)
			}
			defer acquire(byAddr(p, other))()
			if tt.absent {
				p.SetDiscovered([]Discovered{{Addr: other, ID: "pod-o"}})
			}
			p.SetDiscovered([]Discovered{{Addr: addr, ID: tt.after}, {Addr: other, ID: "pod-o"}})
			now := byAddr(p, addr)
			if same := now == e; same != tt.wantSame {
				t.Fatalf("the endpoint at %s is the one before: %v, want %v", addr, same, tt.wantSame)
			}
			picked, err := p.Select(nil)
			if err != nil || picked.Addr != tt.wantPickedAddr {
				t.Errorf("picked %v (%v), want %s", picked, err, tt.wantPickedAddr)
			}
			if tt.wantSame {
				return
			}
			if now.InFlight() != 0 || now.Ejections() != 0 || !now.Healthy() || now.info.Load() != nil || now.BootstrapPort(8998) != 8998 {
				t.Errorf("the new pod's endpoint: %d in flight, %d ejections, healthy %v, bootstrap port %d; want 0, 0, true, the pool's 8998",
					now.InFlight(), now.Ejections(), now.Healthy(), now.BootstrapPort(8998))
			}
			if e.InFlight() != int64(tt.inflight) {
				t.Errorf("the old pod's endpoint: %d in flight, want its %d", e.InFlight(), tt.inflight)
			}
		})
	}
}

// Two pods listed at one address (one that ended, its status not yet
// updated, and the one the network gave its IP) are one endpoint, the same
// whichever order discovery lists them in: not another at every change.
func TestTwoPodsAtOneAddressAreOneSteadyEndpoint(t *testing.T) {
	p, _ := testPool(t, policy(config.PolicyLeastLoad))
	a, b := Discovered{Addr: "10.0.0.1:8000", ID: "pod-a"}, Discovered{Addr: "10.0.0.1:8000", ID: "pod-b"}
	p.SetDiscovered([]Discovered{a, b})
	e := byAddr(p, a.Addr)
	for _, eps := range [][]Discovered{{b, a}, {a, b}, {b, a, {Addr: "10.0.0.2:8000"}}} {
		p.SetDiscovered(eps)
		if got := byAddr(p, a.Addr); got != e || len(p.Endpoints()) != len(eps)-1 {
			t.Fatalf("listed as %v: the same endpoint %v, %d endpoints", eps, got == e, len(p.Endpoints()))
		}
	}
}

// A system prompt this replica sent the pod at an address is estimated to
// be in that pod's cache, and a one-shot question sharing it goes
// decode-only (cached_prefix), only while the same pod has the address:
// another pod the network gave the IP, whether in the same set or after the
// address was gone for a while, holds nothing of it, and decode-only would
// compute the whole prompt on a decode engine.
func TestThePrefixMemoryIsOfThePodNotTheAddress(t *testing.T) {
	const addr = "10.0.0.1:8000"
	system := simMessage{"system", strings.Repeat("s", 8000)} // some 2,000 tokens
	tests := []struct {
		name   string
		before string
		gone   bool // a set without addr between the two
		after  string
		want   Split
	}{
		{"the same pod", "pod-a", false, "pod-a", Split{Reason: metrics.ReasonCachedPrefix}},
		{"the same pod, back after a while", "pod-a", true, "pod-a", Split{Reason: metrics.ReasonCachedPrefix}},
		{"no pod named", "", true, "", Split{Reason: metrics.ReasonCachedPrefix}},
		{"another pod", "pod-a", false, "pod-b", Split{PD: true, Reason: metrics.ReasonLongPrompt}},
		{"another pod, after a while", "pod-a", true, "pod-b", Split{PD: true, Reason: metrics.ReasonLongPrompt}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ps := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"10.0.1.1:8000"}},
				Decode: PoolSpec{PoolScheduling: policy(config.PolicyPrefixAffinity)}}, Deps{})
			ps.Decode.SetDiscovered([]Discovered{{Addr: addr, ID: tt.before}})
			if _, err := ps.Decode.Select(chatRequest([]simMessage{system, {"user", "What is a haiku?"}})); err != nil {
				t.Fatal(err)
			}
			if tt.gone {
				ps.Decode.SetDiscovered(nil)
			}
			ps.Decode.SetDiscovered([]Discovered{{Addr: addr, ID: tt.after}})
			req := chatRequest([]simMessage{system, {"user", "Who wrote the Iliad?"}})
			e, err := ps.Decode.Select(req)
			if err != nil {
				t.Fatal(err)
			}
			if got := ps.Decide(req, e); got.PD != tt.want.PD || got.Reason != tt.want.Reason {
				t.Errorf("Decide() = %+v (estimated held %d characters), want %+v", got, req.Held(e), tt.want)
			}
		})
	}
}
