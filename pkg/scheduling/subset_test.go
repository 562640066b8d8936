package scheduling

import (
	"errors"
	"net/netip"
	"slices"
	"testing"
)

func TestParseSubset(t *testing.T) {
	tests := []struct {
		name    string
		hint    []string
		allowed []string
		denied  []string
	}{
		{name: "no hint allows all", hint: nil, allowed: []string{"10.0.0.1:8000"}},
		{name: "a list", hint: []string{"10.0.0.1:8000", "10.0.0.2:8000"},
			allowed: []string{"10.0.0.1:8000", "10.0.0.2:8000"}, denied: []string{"10.0.0.3:8000"}},
		{name: "comma-separated header value with spaces", hint: []string{"10.0.0.1:8000, 10.0.0.2:8000"},
			allowed: []string{"10.0.0.1:8000", "10.0.0.2:8000"}, denied: []string{"10.0.0.3:8000"}},
		// As GIE's own pickers read a hint: list items comma-separated too,
		// and a bare IP naming every port of it.
		{name: "a list item of several", hint: []string{"10.0.0.2:8000,10.0.0.1:8000"},
			allowed: []string{"10.0.0.1:8000", "10.0.0.2:8000"}, denied: []string{"10.0.0.3:8000"}},
		{name: "a bare IP", hint: []string{"10.0.0.2"}, allowed: []string{"10.0.0.2:8000", "10.0.0.2:8001"}, denied: []string{"10.0.0.1:8000"}},
		{name: "a port tells ranks apart", hint: []string{"10.0.0.2:8001"}, allowed: []string{"10.0.0.2:8001"}, denied: []string{"10.0.0.2:8000"}},
		{name: "IPv6 spelt otherwise", hint: []string{"[fd00:0::1]:8000"}, allowed: []string{"[fd00::1]:8000"}, denied: []string{"[fd00::2]:8000"}},
		{name: "IPv4 mapped into IPv6, with its port", hint: []string{"[::ffff:10.0.0.1]:8000"}, allowed: []string{"10.0.0.1:8000"}, denied: []string{"10.0.0.1:8001"}},
		// GIE's locator splits a hint at its last colon, so an endpoint
		// picker may send IPv6 unbracketed.
		{name: "IPv6 ip:port unbracketed", hint: []string{"fd00::1:8000"}, allowed: []string{"[fd00::1]:8000"}, denied: []string{"[fd00::1]:8001", "[fd00::2]:8000"}},
		{name: "empty list allows nothing", hint: []string{}, denied: []string{"10.0.0.1:8000"}},
		{name: "empty string allows nothing", hint: []string{""}, denied: []string{"10.0.0.1:8000"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := ParseSubset(tt.hint)
			for _, a := range tt.allowed {
				if !s.admits(parsed(a)) {
					t.Errorf("admits(%s) = false, want true", a)
				}
			}
			for _, a := range tt.denied {
				if s.admits(parsed(a)) {
					t.Errorf("admits(%s) = true, want false", a)
				}
			}
		})
	}
}

// One engine is one endpoint however its address is spelt, by the config
// or a discovery source: one set of counts, one rank on every replica.
func TestAnEngineSpeltTwoWaysIsOneEndpoint(t *testing.T) {
	p, _ := testPool(t, policy("least-load"), "[FD00:0::1]:8000", "[::ffff:10.0.0.1]:8000")
	p.SetDiscovered([]Discovered{{Addr: "[fd00::1]:8000"}, {Addr: "10.0.0.1:8000"}})
	if got, want := addrsOf(p.Endpoints()), []string{"[fd00::1]:8000", "10.0.0.1:8000"}; !slices.Equal(got, want) {
		t.Errorf("endpoints %v, want %v", got, want)
	}
}

func TestSelectHonoursTheSubsetHint(t *testing.T) {
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	tests := []struct {
		name    string
		hint    []string
		ejected []string // by failed requests: still routed to when nothing else is
		down    []string // by failed active checks
		want    []string // acceptable picks; nil means an error
		wantErr error
	}{
		{name: "no hint", hint: nil, want: addrs},
		{name: "one allowed", hint: []string{"10.0.0.3:8000"}, want: []string{"10.0.0.3:8000"}},
		{name: "unknown endpoints in the hint are ignored", hint: []string{"10.9.9.9:8000", "10.0.0.2:8000"}, want: []string{"10.0.0.2:8000"}},
		{name: "empty hint", hint: []string{}, wantErr: ErrSubset},
		{name: "none of ours", hint: []string{"10.9.9.9:8000"}, wantErr: ErrSubset},
		{name: "the allowed one is ejected", hint: []string{"10.0.0.1:8000"}, ejected: []string{"10.0.0.1:8000"}, want: []string{"10.0.0.1:8000"}},
		{name: "the allowed one is checked down", hint: []string{"10.0.0.1:8000"}, down: []string{"10.0.0.1:8000"}, wantErr: ErrUnhealthy},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, _ := testPool(t, policy(""), addrs...)
			eject(p, tt.ejected...)
			checkDown(p, tt.down...)
			req := promptRequest("hello")
			req.Subset = ParseSubset(tt.hint)
			for range 20 {
				e, err := p.Select(req)
				if tt.wantErr != nil {
					if !errors.Is(err, tt.wantErr) {
						t.Fatalf("Select() error = %v, want %v", err, tt.wantErr)
					}
					continue
				}
				if err != nil || !slices.Contains(tt.want, e.Addr) {
					t.Fatalf("Select() = %v, %v; want one of %v", e, err, tt.want)
				}
			}
		})
	}
}

func TestThePrefillPoolIgnoresTheSubsetHint(t *testing.T) {
	ps := NewPools(Spec{Prefill: PoolSpec{Endpoints: []string{"10.0.0.1:8000"}}, Decode: PoolSpec{Endpoints: []string{"10.0.0.2:8000"}}}, Deps{})
	req := promptRequest("hello")
	req.Subset = ParseSubset([]string{"10.0.0.2:8000"})
	if e, err := ps.Prefill.Select(req); err != nil || e.Addr != "10.0.0.1:8000" {
		t.Fatalf("prefill Select() = %v, %v; the hint names decode candidates only", e, err)
	}
	req.Subset = ParseSubset([]string{"10.0.0.9:8000"})
	if _, err := ps.Decode.Select(req); !errors.Is(err, ErrSubset) {
		t.Fatalf("decode Select() error = %v, want ErrSubset", err)
	}
	if d := ps.Decide(req, nil); !d.PD {
		t.Fatalf("Decide() = %+v: the decode hint must not make prefill look unavailable", d)
	}
}

// parsed is addr as an Endpoint holds it.
func parsed(addr string) netip.AddrPort { return newEndpoint(addr, nil).ap }
