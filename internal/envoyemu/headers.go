package envoyemu

import (
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
)

// headerEntry is one header line. Keys are always lower-case, as in Envoy's
// header maps (§1.3).
type headerEntry struct {
	key, value string
}

// headerMap is an ordered multi-map of lower-case header names, the stand-in
// for Envoy's RequestHeaderMap / ResponseHeaderMap / trailer maps. Repeated
// names are separate entries, as Envoy keeps them (and as it sends them to the
// ext_proc server, one HeaderValue per entry).
type headerMap struct {
	entries []headerEntry
}

// get returns the first value of key.
func (h *headerMap) get(key string) (string, bool) {
	for _, e := range h.entries {
		if e.key == key {
			return e.value, true
		}
	}
	return "", false
}

func (h *headerMap) has(key string) bool {
	_, ok := h.get(key)
	return ok
}

// set replaces every value of key by one value (Envoy setCopy).
func (h *headerMap) set(key, value string) {
	for i, e := range h.entries {
		if e.key == key {
			h.entries[i].value = value
			h.removeFrom(key, i+1)
			return
		}
	}
	h.entries = append(h.entries, headerEntry{key, value})
}

// add appends another value for key (Envoy addCopy).
func (h *headerMap) add(key, value string) {
	h.entries = append(h.entries, headerEntry{key, value})
}

func (h *headerMap) remove(key string) {
	h.removeFrom(key, 0)
}

func (h *headerMap) removeFrom(key string, start int) {
	out := h.entries[:start]
	for _, e := range h.entries[start:] {
		if e.key != key {
			out = append(out, e)
		}
	}
	h.entries = out
}

// byteSize approximates Envoy's header map byte size (keys + values).
func (h *headerMap) byteSize() int {
	n := 0
	for _, e := range h.entries {
		n += len(e.key) + len(e.value)
	}
	return n
}

// toProto renders the map the way Envoy sends it to the server: the value only
// in raw_value, value empty (§1.3, runtime guard send_header_raw_value on).
// allow filters the entries by forward_rules (nil = everything).
func (h *headerMap) toProto(allow func(string) bool) *corev3.HeaderMap {
	out := &corev3.HeaderMap{}
	for _, e := range h.entries {
		if allow != nil && !allow(e.key) {
			continue
		}
		out.Headers = append(out.Headers, &corev3.HeaderValue{Key: e.key, RawValue: []byte(e.value)})
	}
	return out
}

// hopByHop lists connection-specific headers that an HTTP/1 proxy never
// forwards; Envoy's codecs strip them too.
var hopByHop = map[string]bool{
	"connection":        true,
	"keep-alive":        true,
	"proxy-connection":  true,
	"transfer-encoding": true,
	"upgrade":           true,
	"te":                true,
	"trailer":           true,
}

// fromHTTPHeader converts a Go header map into lower-case entries in a stable
// (sorted) order, dropping hop-by-hop headers.
func fromHTTPHeader(hdr http.Header, out *headerMap) {
	keys := make([]string, 0, len(hdr))
	for k := range hdr {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		lk := strings.ToLower(k)
		if hopByHop[lk] {
			continue
		}
		for _, v := range hdr[k] {
			out.add(lk, v)
		}
	}
}

// toHTTPHeader copies the non-pseudo entries into dst.
func (h *headerMap) toHTTPHeader(dst http.Header) {
	for _, e := range h.entries {
		if strings.HasPrefix(e.key, ":") || hopByHop[e.key] {
			continue
		}
		k := http.CanonicalHeaderKey(e.key)
		dst[k] = append(dst[k], e.value)
	}
}

// appendXFF is Envoy's Utility::appendXff, run with use_remote_address: the
// peer's IP joins x-forwarded-for after a "," (Envoy holds the header as one
// inline entry, the client's values joined by ","), or the node's address
// for a peer on 127.0.0.1 or ::1 (mutateRequestHeaders).
func appendXFF(h *headerMap, remoteAddr string) {
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		return
	}
	if host == "127.0.0.1" || host == "::1" {
		host = nodeAddress()
	}
	var vals []string
	for _, e := range h.entries {
		if e.key == "x-forwarded-for" {
			vals = append(vals, e.value)
		}
	}
	h.set("x-forwarded-for", strings.Join(append(vals, host), ","))
}

// nodeAddress is Envoy's local_info address under the default
// --local-address-ip-version v4 (Network::Utility::getLocalAddress in
// source/common/network/utility.cc): the first IPv4 interface address other
// than 127.0.0.1, or 127.0.0.1 when there is none.
var nodeAddress = sync.OnceValue(func() string {
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.Equal(net.IPv4(127, 0, 0, 1)) {
			return ipn.IP.String()
		}
	}
	return "127.0.0.1"
})

// steering are the x-envoy-* request headers (after the bootstrap's
// header_prefix) the connection manager removes from an external request,
// and edgeSteering the ones it also removes from an edge request
// (cleanInternalHeaders in source/common/http/conn_manager_utility.cc).
var (
	steering = []string{"-retriable-status-codes", "-retriable-header-names", "-retry-on", "-retry-grpc-on",
		"-max-retries", "-upstream-alt-stat-name", "-upstream-rq-timeout-ms", "-upstream-rq-per-try-timeout-ms",
		"-upstream-rq-timeout-alt-response", "-expected-rq-timeout-ms", "-force-trace", "-ip-tags",
		"-original-url", "-hedge-on-per-try-timeout"}
	edgeSteering = []string{"-decorator-operation", "-downstream-service-cluster", "-downstream-service-node"}
)

// cleanExternal is what the connection manager does to the x-envoy-*
// headers of a request it deems external, as Envoy 1.33 and later deem
// every request without internal_address_config: x-envoy-internal always
// goes, and so do the headers that would steer Envoy; edge is
// use_remote_address (mutateRequestHeaders, conn_manager_utility.cc).
func cleanExternal(h *headerMap, prefix string, edge bool) {
	prefix = strings.ToLower(prefix)
	h.remove(prefix + "-internal")
	names := steering
	if edge {
		names = append(names[:len(names):len(names)], edgeSteering...)
	}
	for _, n := range names {
		h.remove(prefix + n)
	}
}
