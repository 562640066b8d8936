package scheduling

import (
	"slices"
	"testing"

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
	release := kept.Acquire()
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
