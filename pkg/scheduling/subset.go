package scheduling

import (
	"slices"
	"strings"
)

// Subset is the endpoint-picker protocol's subset hint: when the proxy sends
// one (metadata envoy.lb.subset_hint / x-gateway-destination-endpoint-subset),
// the request may only go to endpoints in it, and an empty hint or one naming
// none of ours means no endpoint at all (the protocol's 503). The zero Subset
// is "no hint": every endpoint is allowed.
type Subset struct {
	addrs []string
	set   bool
}

// ParseSubset reads a subset hint as it arrives: a list of "ip:port" strings
// (from protobuf Struct metadata: []any), or one comma-separated string. A nil
// hint is "no hint"; anything else that is not a list of strings is an empty
// hint, which allows nothing: a hint we cannot read must not widen the choice.
func ParseSubset(hint any) Subset {
	var parts []string
	switch v := hint.(type) {
	case nil:
		return Subset{}
	case string:
		parts = strings.Split(v, ",")
	case []string:
		parts = v
	case []any:
		for _, x := range v {
			s, ok := x.(string)
			if !ok {
				return Subset{set: true}
			}
			parts = append(parts, s)
		}
	default:
		return Subset{set: true}
	}
	s := Subset{set: true}
	for _, p := range parts {
		if p = strings.TrimSpace(p); p != "" {
			s.addrs = append(s.addrs, p)
		}
	}
	return s
}

// Allows reports whether the hint lets the request go to addr.
func (s Subset) Allows(addr string) bool { return !s.set || slices.Contains(s.addrs, addr) }
