package e2e

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
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

// deadAddr is a loopback address nothing listens on.
func deadAddr(t *testing.T) string { return fmt.Sprintf("127.0.0.1:%d", testbed.MustFreePort(t)) }

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

// recorder is an HTTP endpoint that only counts and keeps what reaches it:
// somewhere nothing may go (an attacker's host), or, with next set, a
// transparent proxy in front of a simulator that keeps the headers it saw.
type recorder struct {
	*httptest.Server
	mu      sync.Mutex
	headers []http.Header
	paths   []string
}

func newRecorder(t *testing.T, next string) *recorder {
	rec := &recorder{}
	var proxy http.Handler
	if next != "" {
		target := "http://" + next
		proxy = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			out, err := http.NewRequestWithContext(r.Context(), r.Method, target+r.URL.RequestURI(), r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			out.Header = r.Header.Clone()
			out.ContentLength = r.ContentLength
			resp, err := http.DefaultTransport.RoundTrip(out)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			defer resp.Body.Close()
			for k, v := range resp.Header {
				w.Header()[k] = v
			}
			w.WriteHeader(resp.StatusCode)
			rc := http.NewResponseController(w)
			buf := make([]byte, 32<<10)
			for {
				n, err := resp.Body.Read(buf)
				if n > 0 {
					w.Write(buf[:n])
					rc.Flush()
				}
				if err != nil {
					return
				}
			}
		})
	}
	rec.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec.mu.Lock()
		rec.headers = append(rec.headers, r.Header.Clone())
		rec.paths = append(rec.paths, r.URL.Path)
		rec.mu.Unlock()
		if proxy == nil {
			http.Error(w, "recorder: nothing should reach me", http.StatusTeapot)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(rec.Close)
	return rec
}

func (rec *recorder) addr() string { return rec.Listener.Addr().String() }

func (rec *recorder) seen() ([]http.Header, []string) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]http.Header(nil), rec.headers...), append([]string(nil), rec.paths...)
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
