package envoyemu

import (
	"net/netip"
	"strings"

	"google.golang.org/protobuf/types/known/structpb"
)

// chooseHosts is the ORIGINAL_DST load balancer's host choice (§8.1): the
// dynamic metadata at metadata_key first, then the first value of the
// configured header. Each must parse as a strict IP:port; a list or a
// hostname fails and falls through. The restored local address (source 4)
// never applies: the emulated listener has no original_dst listener filter.
// A gateway (Config.GatewayFallbacks) reads either value as the
// endpoint-picker protocol's list (§8.2): its valid entries, in order.
func chooseHosts(od *OriginalDst, h *headerMap, md map[string]*structpb.Struct, gateway bool) []string {
	parse := func(s string) []string {
		entries := []string{s}
		if gateway {
			entries = strings.Split(s, ",")
			for i := range entries {
				entries[i] = strings.TrimSpace(entries[i])
			}
		}
		var hosts []string
		for _, e := range entries {
			if addr, ok := parseIPPort(e, od.PortOverride); ok {
				hosts = append(hosts, addr)
			}
		}
		return hosts
	}
	if od.MetadataNamespace != "" {
		if v, ok := metadataValue(md, od.MetadataNamespace, od.MetadataPath); ok {
			if l := v.GetListValue(); l != nil {
				v = nil
				if vs := l.GetValues(); len(vs) > 0 {
					v = vs[0]
				}
			}
			if s, ok := v.GetKind().(*structpb.Value_StringValue); ok {
				if hosts := parse(s.StringValue); len(hosts) > 0 {
					return hosts
				}
			}
		}
	}
	if od.UseHTTPHeader {
		if v, ok := h.get(od.HeaderName); ok {
			return parse(v)
		}
	}
	return nil
}

// parseIPPort is parseInternetAddressAndPortNoThrow: "10.0.0.7:8000" or
// "[fd00::7]:8000", nothing else.
func parseIPPort(s string, portOverride uint32) (string, bool) {
	ap, err := netip.ParseAddrPort(s)
	if err != nil || ap.Addr().Zone() != "" {
		return "", false
	}
	if portOverride != 0 {
		ap = netip.AddrPortFrom(ap.Addr(), uint16(portOverride))
	}
	return ap.String(), true
}
