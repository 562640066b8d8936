package scheduling

import (
	"net/netip"
	"strconv"
	"strings"
)

// Subset is the endpoint-picker protocol's subset hint: when the proxy sends
// one (metadata envoy.lb.subset_hint / x-gateway-destination-endpoint-subset),
// the request may only go to endpoints in it, and an empty hint or one naming
// none of ours means no endpoint at all (the protocol's 503). The zero Subset
// is "no hint": every endpoint is allowed.
type Subset struct {
	ports map[netip.AddrPort]bool // the entries that are ip:port, parsed once
	ips   map[netip.Addr]bool     // those that are a bare IP: any port of it
	set   bool
}

// ParseSubset reads a subset hint's entries (pipeline.Request.Subset), each
// an "ip:port" or a bare "ip" or several of them comma-separated, as GIE's
// own pickers read it (pkg/lwepp/handlers/request.go in
// kubernetes-sigs/gateway-api-inference-extension splits list items on
// commas too). A nil hint is "no hint"; an empty one allows nothing.
func ParseSubset(hint []string) Subset {
	if hint == nil {
		return Subset{}
	}
	// Sets, as a hint may name most of a large pool and each endpoint is
	// looked up in it.
	s := Subset{set: true, ports: map[netip.AddrPort]bool{}, ips: map[netip.Addr]bool{}}
	for _, p := range hint {
		for a := range strings.SplitSeq(p, ",") {
			a = strings.TrimSpace(a)
			if ap, err := netip.ParseAddrPort(a); err == nil {
				s.ports[unmapped(ap)] = true
				continue
			}
			if ip, err := netip.ParseAddr(a); err == nil {
				s.ips[ip.Unmap()] = true
			}
			// An IPv6 ip:port unbracketed, as GIE's full picker read one (split at
			// the last colon, pkg/epp/requestcontrol/candidates.go @ 1748e829):
			// also read so, beside the bare IP it spells.
			if i := strings.LastIndexByte(a, ':'); strings.Count(a, ":") > 1 {
				if ip, err := netip.ParseAddr(a[:i]); err == nil && ip.Is6() {
					if port, err := strconv.ParseUint(a[i+1:], 10, 16); err == nil {
						s.ports[unmapped(netip.AddrPortFrom(ip, uint16(port)))] = true
					}
				}
			}
		}
	}
	return s
}

// admits reports whether the hint lets the request go to the endpoint at ap
// (Endpoint.ap): named with its port (which tells a data-parallel rank's
// port from another's), or by its IP alone (any port of it, as GIE's
// pkg/lwepp/handlers/request.go @ 84436a96 matches a bare IP), in any
// spelling of the address. Pool endpoints are ip:port: a name is in no hint.
func (s Subset) admits(ap netip.AddrPort) bool {
	return !s.set || ap.IsValid() && (s.ports[ap] || s.ips[ap.Addr()])
}

func unmapped(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}
