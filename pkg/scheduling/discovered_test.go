package scheduling

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
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
