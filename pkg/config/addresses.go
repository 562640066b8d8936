package config

import (
	"fmt"
	"net/netip"
)

// This file holds the checks of the addresses a config names.

// validateEndpoints requires literal ip:port: Envoy's ORIGINAL_DST cluster cannot
// resolve host names, so a name here would only fail later, per request.
func validateEndpoints(key string, addrs []string) []error {
	var errs []error
	seen := map[netip.AddrPort]bool{}
	for i, a := range addrs {
		ap, err := netip.ParseAddrPort(a)
		ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()) // one engine, however spelt
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s[%d]: %q is not ip:port", key, i, a))
		case ap.Port() == 0:
			errs = append(errs, fmt.Errorf("%s[%d]: %q has no port", key, i, a))
		case ap.Addr().Zone() != "":
			errs = append(errs, fmt.Errorf("%s[%d]: %q names a zone: no URL nor Envoy's destination header can carry it", key, i, a))
		case NoEngine(ap.Addr()) != "":
			errs = append(errs, fmt.Errorf("%s[%d]: %q is %s", key, i, a, NoEngine(ap.Addr())))
		case seen[ap]:
			errs = append(errs, fmt.Errorf("%s[%d]: %q is listed twice", key, i, a))
		}
		seen[ap] = true
	}
	return errs
}

// NoEngine says why a, unmapped, names no engine a connection can reach:
// it is the unspecified address (a listener's wildcard, and what DNS
// sinkholes answer for a blocked name) or a group of hosts; "" for one
// host's address. Static endpoints are refused for it, DNS answers and pod
// IPs skipped.
func NoEngine(a netip.Addr) string {
	switch a = a.Unmap(); {
	case a.IsUnspecified():
		return "the unspecified address, a listener's wildcard: it names no engine"
	case notOneHost(a) != "":
		return notOneHost(a) + ": TCP connects to one host"
	}
	return ""
}

// notOneHost says what a, unmapped, is when it is a group of hosts, to which
// TCP neither connects nor binds: "" for one host's address.
func notOneHost(a netip.Addr) string {
	switch {
	case a.IsMulticast():
		return "a multicast address"
	case a == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "the broadcast address"
	}
	return ""
}
