package scheduling

import (
	"errors"
	"slices"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

func TestPickPrefersLessLoadedAndHonoursExclude(t *testing.T) {
	tests := []struct {
		name     string
		addrs    []string
		load     map[string]int
		exclude  []string
		want     string // "" means no endpoint
		attempts int
	}{
		{name: "empty pool", addrs: nil, want: ""},
		{name: "single endpoint", addrs: []string{"10.0.0.1:8000"}, want: "10.0.0.1:8000"},
		{name: "all excluded", addrs: []string{"10.0.0.1:8000"}, exclude: []string{"10.0.0.1:8000"}, want: ""},
		{name: "exclude leaves the other", addrs: []string{"10.0.0.1:8000", "10.0.0.2:8000"}, exclude: []string{"10.0.0.1:8000"}, want: "10.0.0.2:8000"},
		{name: "two endpoints, less loaded wins every time", addrs: []string{"10.0.0.1:8000", "10.0.0.2:8000"},
			load: map[string]int{"10.0.0.1:8000": 3}, want: "10.0.0.2:8000", attempts: 50},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := NewPools(Spec{Decode: PoolSpec{Endpoints: tt.addrs}}, Deps{}).Decode
			for _, e := range p.Endpoints() {
				for range tt.load[e.Addr] {
					acquire(e)
				}
			}
			for range max(tt.attempts, 1) {
				got, _ := p.Select(nil, tt.exclude...)
				switch {
				case got == nil && tt.want != "":
					t.Fatalf("Select() = nil, want %s", tt.want)
				case got != nil && got.Addr != tt.want:
					t.Fatalf("Select() = %s, want %s", got.Addr, tt.want)
				}
			}
		})
	}
}

func TestASlotsReleaseIsIdempotent(t *testing.T) {
	e := &Endpoint{Addr: "10.0.0.1:8000"}
	release := acquire(e)
	acquire(e)
	release()
	release()
	if got := e.InFlight(); got != 1 {
		t.Fatalf("InFlight() = %d after one double release of two acquires, want 1", got)
	}
}

// Failed requests (passive health) never empty the decode pool: with every
// candidate ejected it still routes among them, as Envoy's panic routing
// does, where the prefill pool says none is healthy (the request then goes
// decode-only). Only the active checks take the last decode endpoint out.
func TestSelectSaysWhyThereIsNoEndpoint(t *testing.T) {
	tests := []struct {
		name      string
		addrs     []string
		ejected   []string // by failed requests
		down      []string // by failed active checks
		exclude   []string
		wantErr   error // in both pools, unless wantPanic
		wantPanic bool  // the decode pool picks b, ejected; the prefill pool says ErrUnhealthy
	}{
		{name: "empty pool", wantErr: ErrEmpty},
		{name: "all tried", addrs: []string{"a", "b"}, exclude: []string{"a", "b"}, wantErr: ErrTried},
		{name: "all ejected", addrs: []string{"b"}, ejected: []string{"b"}, wantPanic: true},
		{name: "the untried one is ejected", addrs: []string{"a", "b"}, ejected: []string{"b"}, exclude: []string{"a"}, wantPanic: true},
		{name: "the ejected one left, the other checked down", addrs: []string{"a", "b"}, ejected: []string{"b"}, down: []string{"a"}, wantPanic: true},
		{name: "all checked down", addrs: []string{"a", "b"}, down: []string{"a", "b"}, wantErr: ErrUnhealthy},
		{name: "one healthy left", addrs: []string{"a", "b"}, ejected: []string{"a"}},
	}
	for _, tt := range tests {
		for _, pool := range []string{"prefill", "decode"} {
			t.Run(tt.name+"/"+pool, func(t *testing.T) {
				p, _ := testPoolNamed(t, pool, policy(""), tt.addrs...)
				eject(p, tt.ejected...)
				checkDown(p, tt.down...)
				wantErr := tt.wantErr
				if tt.wantPanic && pool == "prefill" {
					wantErr = ErrUnhealthy
				}
				e, err := p.Select(nil, tt.exclude...)
				if !errors.Is(err, wantErr) {
					t.Fatalf("Select() error = %v, want %v", err, wantErr)
				}
				if err == nil && e.Addr != "b" {
					t.Fatalf("Select() = %s, want b", e.Addr)
				}
				if err != nil && e != nil {
					t.Fatal("Select() returned an endpoint with an error")
				}
				wantReady := len(tt.addrs) > len(tt.ejected)+len(tt.down) || pool == "decode" && len(tt.ejected) > 0
				if p.Ready() != wantReady {
					t.Errorf("Ready() = %v with %d of %d ejected and %d checked down, want %v", p.Ready(), len(tt.ejected), len(tt.addrs), len(tt.down), wantReady)
				}
			})
		}
	}
}

func TestSelectN(t *testing.T) {
	tests := []struct {
		name     string
		policy   string
		inflight map[string]int
		ejected  []string
		n        int
		want     []string
	}{
		{name: "one", policy: config.PolicyRoundRobin, n: 1, want: []string{"a"}},
		{name: "the policy's pick, then the least busy", policy: config.PolicyRoundRobin,
			inflight: map[string]int{"a": 5, "b": 3, "c": 1, "d": 2}, n: 3, want: []string{"a", "c", "d"}},
		{name: "the less busy later in the list first", policy: config.PolicyRoundRobin,
			inflight: map[string]int{"b": 3, "c": 2, "d": 1}, n: 3, want: []string{"a", "d", "c"}},
		{name: "of equals, the first listed", policy: config.PolicyRoundRobin,
			inflight: map[string]int{"a": 5, "b": 1, "c": 1, "d": 1}, n: 3, want: []string{"a", "b", "c"}},
		{name: "never more than the healthy endpoints", policy: config.PolicyRoundRobin,
			ejected: []string{"b", "c"}, n: 4, want: []string{"a", "d"}},
		{name: "zero is one", policy: config.PolicyRoundRobin, n: 0, want: []string{"a"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, _ := testPool(t, policy(tt.policy), "a", "b", "c", "d")
			for a, n := range tt.inflight {
				for range n {
					acquire(byAddr(p, a))
				}
			}
			eject(p, tt.ejected...)
			got, err := p.SelectN(nil, tt.n)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(addrsOf(got), tt.want) {
				t.Fatalf("SelectN(%d) = %v, want %v", tt.n, addrsOf(got), tt.want)
			}
		})
	}
}

func TestUpdateKeepsTheStateOfEndpointsThatStay(t *testing.T) {
	p, _ := testPool(t, policy(""), "a", "b")
	a, b := byAddr(p, "a"), byAddr(p, "b")
	releaseA, releaseB := acquire(a), acquire(b)
	a.ReportFailure()
	a.ReportFailure()

	p.Update(PoolSpec{Endpoints: []string{"a", "c"}})

	if got := addrsOf(p.Endpoints()); !slices.Equal(got, []string{"a", "c"}) {
		t.Fatalf("endpoints after Update = %v", got)
	}
	if byAddr(p, "a") != a || a.InFlight() != 1 {
		t.Fatalf("a was replaced or lost its request in flight (in flight %d)", byAddr(p, "a").InFlight())
	}
	a.ReportFailure()
	if a.Healthy() {
		t.Error("a lost its failure count across the Update: a third failure did not eject it")
	}
	releaseA()
	releaseB() // b left the pool; releasing it is still safe
	if a.InFlight() != 0 || b.InFlight() != 0 {
		t.Errorf("in flight after release: a %d, b %d", a.InFlight(), b.InFlight())
	}
}

func TestUpdateKeepsThePolicyMemoryUnlessItsShapeChanges(t *testing.T) {
	affinity := config.PoolScheduling{Policy: config.PolicyPrefixAffinity}
	p, _ := testPool(t, affinity, "a", "b")
	picker := p.state.Load().picker

	affinity.Health.ConsecutiveFailures = 5
	p.Update(PoolSpec{Endpoints: []string{"a", "b", "c"}, PoolScheduling: affinity})
	if p.state.Load().picker != picker {
		t.Error("the prefix index was dropped by an Update that kept the policy")
	}
	// A new load bound (pd.mode derives the decode pool's queue_slack) takes
	// effect, and the memory stays.
	affinity.Prefix.QueueSlack, affinity.Prefix.LoadFactor = 4, 3
	p.Update(PoolSpec{Endpoints: []string{"a", "b", "c"}, PoolScheduling: affinity})
	bounded := p.state.Load().picker.(*prefixAffinity)
	if bounded.queueSlack != 4 || bounded.factor != 3 {
		t.Errorf("new load bounds not applied: queue_slack %v, load_factor %v", bounded.queueSlack, bounded.factor)
	}
	if was := picker.(*prefixAffinity); bounded.index != was.index || bounded.shares != was.shares || bounded.named != was.named || bounded.clients != was.clients {
		t.Error("a new load bound dropped the prefix index, the shares or the coverage counts")
	}
	affinity.Prefix.BlockChars = 512
	p.Update(PoolSpec{Endpoints: []string{"a", "b", "c"}, PoolScheduling: affinity})
	if p.state.Load().picker.(*prefixAffinity).index == bounded.index {
		t.Error("a new block size kept the old index, whose blocks no longer line up")
	}
	p.Update(PoolSpec{Endpoints: []string{"a", "b", "c"}, PoolScheduling: policy(config.PolicyRoundRobin)})
	if _, ok := p.state.Load().picker.(*roundRobin); !ok {
		t.Errorf("policy change not applied: picker %T", p.state.Load().picker)
	}
}

func TestAttempts(t *testing.T) {
	tests := []struct {
		name    string
		addrs   []string
		ejected []string
		budget  int
		want    []string
		wantErr error
	}{
		{name: "budget of two over three endpoints", addrs: []string{"a", "b", "c"}, budget: 2, want: []string{"a", "b"}, wantErr: ErrTried},
		{name: "the pool runs out first", addrs: []string{"a", "b"}, budget: 3, want: []string{"a", "b"}, wantErr: ErrTried},
		{name: "ejected endpoints are skipped", addrs: []string{"a", "b", "c"}, ejected: []string{"a"}, budget: 3, want: []string{"b", "c"}, wantErr: ErrUnhealthy},
		{name: "at least one attempt", addrs: []string{"a"}, budget: 0, want: []string{"a"}, wantErr: ErrTried},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, _ := testPoolNamed(t, "prefill", policy(""), tt.addrs...) // the prefill leg's attempts
			eject(p, tt.ejected...)
			att := p.Attempts(nil, tt.budget)
			var got []string
			for {
				e, slot, err := att.Next()
				if err != nil {
					if !errors.Is(err, tt.wantErr) {
						t.Fatalf("Next() error = %v, want %v", err, tt.wantErr)
					}
					break
				}
				if slot.Endpoint() != e {
					t.Fatalf("Next() gave %s with the slot of %s", e.Addr, slot.Endpoint().Addr)
				}
				slot.Release()
				got = append(got, e.Addr)
			}
			if !slices.Equal(got, tt.want) {
				t.Fatalf("attempts = %v, want %v", got, tt.want)
			}
		})
	}
}
