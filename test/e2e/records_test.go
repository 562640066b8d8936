package e2e

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// served returns the record of requestID on whichever simulator saw it.
func served(t *testing.T, sims []*pdsim.Server, pick func(pdsim.Record) bool) (*pdsim.Server, pdsim.Record) {
	t.Helper()
	var found *pdsim.Server
	var rec pdsim.Record
	for _, s := range sims {
		for _, r := range s.Requests() {
			if pick(r) {
				if found != nil {
					t.Fatalf("two simulators served the same leg: %s and %s", found.Addr(), s.Addr())
				}
				found, rec = s, r
			}
		}
	}
	if found == nil {
		t.Fatal("no simulator served the leg")
	}
	return found, rec
}

// waitFor polls cond until it holds, for at most d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond) // polling state we do not own; bounded above
	}
}

// recordsWith returns every record, over sims, whose body contains marker.
func recordsWith(sims []*pdsim.Server, marker string) []pdsim.Record {
	var out []pdsim.Record
	for _, s := range sims {
		for _, rec := range s.Requests() {
			if strings.Contains(string(rec.Body), marker) {
				out = append(out, rec)
			}
		}
	}
	return out
}

// hostPort splits an address for config that wants them apart.
func hostPort(t *testing.T, addr string) (string, string) {
	t.Helper()
	h, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	return h, p
}
