package envoyemu

import (
	"net/netip"

	"google.golang.org/protobuf/types/known/structpb"
)

// chooseHost is the ORIGINAL_DST load balancer's host choice (§8.1): the
// dynamic metadata at metadata_key first, then the first value of the
// configured header. Each must parse as a strict IP:port; a list or a
// hostname fails and falls through. The restored local address (source 4)
// never applies: the emulated listener has no original_dst listener filter.
func chooseHost(od *OriginalDst, h *headerMap, md map[string]*structpb.Struct) (string, bool) {
	if od.MetadataNamespace != "" {
		if v, ok := metadataValue(md, od.MetadataNamespace, od.MetadataPath); ok {
			if l := v.GetListValue(); l != nil {
				v = nil
				if vs := l.GetValues(); len(vs) > 0 {
					v = vs[0]
				}
			}
			if s, ok := v.GetKind().(*structpb.Value_StringValue); ok {
				if addr, ok := parseIPPort(s.StringValue, od.PortOverride); ok {
					return addr, true
				}
			}
		}
	}
	if od.UseHTTPHeader {
		if v, ok := h.get(od.HeaderName); ok {
			if addr, ok := parseIPPort(v, od.PortOverride); ok {
				return addr, true
			}
		}
	}
	return "", false
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
