package scheduling

import (
	"regexp"
	"strings"
	"testing"
)

// TestResponseID: an id names the endpoint it was made for among those
// that may take it, and no other id names one.
func TestResponseID(t *testing.T) {
	pool := []*Endpoint{{Addr: "10.1.1.1:8000"}, {Addr: "10.1.1.2:8000"}, {Addr: "[fd00::3]:8000"}}
	gone := &Endpoint{Addr: "10.1.1.4:8000"}
	of := func(e *Endpoint) string { return NewResponseID(e) }
	tests := []struct {
		name, id string
		want     *Endpoint
	}{
		{"the first", of(pool[0]), pool[0]},
		{"the second", of(pool[1]), pool[1]},
		{"IPv6", of(pool[2]), pool[2]},
		{"an endpoint no longer in the pool", of(gone), nil},
		{"vLLM's own", "resp_0123456789abcdef0123456789abcdef", nil},
		{"cut short", of(pool[0])[:30], nil},
		{"not hex", "resp_pdzzzzzzzz" + strings.Repeat("0", 32), nil},
		{"none", "", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := storedOn(tt.id, pool); got != tt.want {
				t.Errorf("%q names %v, want %v", tt.id, got, tt.want)
			}
		})
	}
	a, b := of(pool[0]), of(pool[0])
	if a == b || !regexp.MustCompile(`^resp_pd[0-9a-f]{40}$`).MatchString(a) || a[:15] != b[:15] {
		t.Errorf("two ids of one endpoint %q and %q: want the same hash, different random digits", a, b)
	}
}
