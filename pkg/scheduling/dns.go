package scheduling

import (
	"context"
	"net"
	"net/netip"
	"slices"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// Resolver looks up a host's addresses; *net.Resolver is one.
type Resolver interface {
	LookupHost(ctx context.Context, host string) ([]string, error)
}

// resolve looks up the pool's DNS name (name:port) and makes its addresses the
// pool's discovered endpoints. A failed lookup keeps the last good set: a DNS
// hiccup must not empty a pool, and passive health handles endpoints that died.
func (p *Pool) resolve(ctx context.Context, hostport string) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		p.deps.Log.Error(err, "bad DNS name for pool", "pool", p.Name(), "dns", hostport)
		return
	}
	ips, err := p.deps.Resolver.LookupHost(ctx, host)
	if err == nil && len(ips) > 0 {
		if ips = p.engines(hostport, ips); len(ips) == 0 {
			return // said by engines; the endpoints found before stay
		}
	}
	if err != nil || len(ips) == 0 {
		if ctx.Err() == nil {
			p.deps.Log.Info("DNS lookup failed; keeping the endpoints found before", "pool", p.Name(), "dns", hostport, "error", errString(err))
		}
		return
	}
	addrs := make([]string, 0, len(ips))
	for _, ip := range v4Preferred(ips) {
		addrs = append(addrs, net.JoinHostPort(ip, port))
	}
	slices.Sort(addrs)
	addrs = slices.Compact(addrs)
	p.setResolved(hostport, addrs)
}

// engines drops from name's answer the addresses that name no engine
// (config.NoEngine: a DNS sinkhole answers 0.0.0.0 or :: for a blocked
// name), in one log line each time what it drops changes.
func (p *Pool) engines(name string, ips []string) []string {
	var skipped []string
	ips = slices.DeleteFunc(slices.Clone(ips), func(ip string) bool {
		a, err := netip.ParseAddr(ip)
		if err != nil || config.NoEngine(a) == "" {
			return false
		}
		skipped = append(skipped, ip+" is "+config.NoEngine(a))
		return true
	})
	p.mu.Lock()
	changed := !slices.Equal(skipped, p.skipped[name])
	p.skipped[name] = skipped
	p.mu.Unlock()
	if changed && len(skipped) > 0 {
		p.deps.Log.Info("DNS answered addresses that name no engine; skipping them", "pool", p.Name(), "dns", name, "skipped", skipped)
	}
	return ips
}

// v4Preferred are the IPv4 addresses among ips, or all of them when there is
// none, as Envoy's V4_PREFERRED lookup family (its default) takes them: a
// dual-stack headless Service answers each pod's two addresses, which would
// otherwise be two endpoints of one engine, its load split between them.
func v4Preferred(ips []string) []string {
	v4 := slices.DeleteFunc(slices.Clone(ips), func(ip string) bool {
		a, err := netip.ParseAddr(ip)
		return err != nil || !a.Unmap().Is4()
	})
	if len(v4) == 0 {
		return ips
	}
	return v4
}

func errString(err error) string {
	if err == nil {
		return "no addresses"
	}
	return err.Error()
}

// setResolved replaces the endpoints found through DNS under name: the
// pool's name, or the old one while the pool's has not answered yet.
func (p *Pool) setResolved(name string, addrs []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if name != p.spec.DNS && (name != p.resolvedName || p.resolvedName == "") {
		return
	}
	if name == p.resolvedName && slices.Equal(addrs, p.resolved) {
		return
	}
	p.resolved, p.resolvedName = addrs, name
	p.rebuild()
}

// dnsNames are the names to look up: the spec's, and the one the pool's
// resolved addresses came from while the spec's has not answered.
func (p *Pool) dnsNames() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.resolvedName != "" && p.resolvedName != p.spec.DNS {
		return []string{p.spec.DNS, p.resolvedName}
	}
	return []string{p.spec.DNS}
}

// warm keeps, as a reload sets next, what the pool's DNS served until
// next's name first answers (setResolved), as Envoy keeps a changed
// cluster's old hosts until the new one has warmed: a reload must not empty
// a pool, nor freeze it on a name no longer asked. An old name's addresses
// follow its answers meanwhile (dnsNames); a reload from static endpoints
// keeps those it drops. Without a name, the static endpoints apply at once.
func (p *Pool) warm(next PoolSpec) {
	switch {
	case next.DNS == "":
		p.resolved, p.resolvedName = nil, ""
	case p.spec.DNS == "":
		p.resolved = p.spec.Endpoints
	}
}
