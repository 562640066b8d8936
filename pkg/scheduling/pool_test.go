package scheduling

import "testing"

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
			p := NewPool("decode", tt.addrs)
			for _, e := range p.Endpoints() {
				for range tt.load[e.Addr] {
					e.Acquire()
				}
			}
			for range max(tt.attempts, 1) {
				got := p.Pick(tt.exclude...)
				switch {
				case got == nil && tt.want != "":
					t.Fatalf("Pick() = nil, want %s", tt.want)
				case got != nil && got.Addr != tt.want:
					t.Fatalf("Pick() = %s, want %s", got.Addr, tt.want)
				}
			}
		})
	}
}

func TestAcquireReleaseIsIdempotent(t *testing.T) {
	e := &Endpoint{Addr: "10.0.0.1:8000"}
	release := e.Acquire()
	e.Acquire()
	release()
	release()
	if got := e.InFlight(); got != 1 {
		t.Fatalf("InFlight() = %d after one double release of two acquires, want 1", got)
	}
}
