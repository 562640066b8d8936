package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"
)

// stats are the outcomes of the soak's requests, as the client saw them.
type stats struct {
	mu        sync.Mutex
	outcomes  map[string]int
	latencies map[string][]time.Duration // ok requests, by size
	samples   []string                   // a few unexpected ones, for the report
	requests  int
	// minutes counts requests, and unexpected ones, by the minute they
	// ended in: a soak that slows or fails more as it runs shows it here.
	start   time.Time
	minutes []minute
}

type minute struct{ requests, unexpected int }

func newStats() *stats {
	return &stats{outcomes: map[string]int{}, latencies: map[string][]time.Duration{}, start: time.Now()}
}

func (st *stats) add(class, size string, d time.Duration, detail string) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.requests++
	st.outcomes[class]++
	m := int(time.Since(st.start) / time.Minute)
	for len(st.minutes) <= m {
		st.minutes = append(st.minutes, minute{})
	}
	st.minutes[m].requests++
	if class == okClass {
		st.latencies[size] = append(st.latencies[size], d)
	}
	if strings.HasPrefix(class, unexpectedPrefix) {
		st.minutes[m].unexpected++
		if len(st.samples) < 10 {
			st.samples = append(st.samples, detail)
		}
	}
}

func (st *stats) unexpectedTotal() int {
	st.mu.Lock()
	defer st.mu.Unlock()
	n := 0
	for c, v := range st.outcomes {
		if strings.HasPrefix(c, unexpectedPrefix) {
			n += v
		}
	}
	return n
}

// goroutines reads extproc's goroutine profile: all of them, and those that
// serve HTTP keep-alive connections (net/http persistConn loops). The pool to
// the engines grows to the peak of concurrent legs (kv-sglang legs outlive
// their requests) and idles for 90 s: that is not work left behind.
func (s *stack) goroutines() (total, pooled int) {
	resp, err := http.Get("http://" + s.extproc.AdminAddr + "/debug/pprof/goroutine?debug=1")
	if err != nil {
		return -1, 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, block := range strings.Split(string(b), "\n\n") {
		var n int
		if _, err := fmt.Sscanf(block, "%d @", &n); err != nil {
			continue
		}
		total += n
		if strings.Contains(block, "persistConn).readLoop") || strings.Contains(block, "persistConn).writeLoop") {
			pooled += n
		}
	}
	return total, pooled
}

// working is the goroutine count without idle connection pools.
func (s *stack) working() float64 {
	total, pooled := s.goroutines()
	return float64(total - pooled)
}

// rss is extproc's resident memory in bytes; -1 when it cannot be read.
func (s *stack) rss() float64 {
	v, err := s.extproc.Metric(context.Background(), "process_resident_memory_bytes")
	if err != nil {
		return -1
	}
	return v
}

// usage is what extproc used: goroutines (idle connection pools aside, see
// goroutines) and RSS, at the baseline and at their peak.
type usage struct {
	mu          sync.Mutex
	start, peak figures
}

type figures struct{ goroutines, rss float64 }

// baseline takes the figures the end is compared with.
func (s *stack) baseline() {
	f := figures{s.working(), s.rss()}
	s.usage.mu.Lock()
	defer s.usage.mu.Unlock()
	s.usage.start = f
}

// sample records extproc's goroutines and RSS every interval until ctx ends.
func (s *stack) sample(ctx context.Context, interval time.Duration) {
	for sleep(ctx, interval) {
		f := figures{s.working(), s.rss()}
		s.usage.mu.Lock()
		s.usage.peak = figures{max(s.usage.peak.goroutines, f.goroutines), max(s.usage.peak.rss, f.rss)}
		s.usage.mu.Unlock()
	}
}

// figures returns the baseline and the peaks.
func (u *usage) figures() (start, peak figures) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.start, u.peak
}

// routeCounts counts extproc's own request lines by mode/reason/outcome.
type routeCounts struct {
	mu sync.Mutex
	n  map[string]int
}

// add reads one line extproc logged.
func (r *routeCounts) add(line string) {
	var l struct {
		Msg, Mode, Reason, Outcome string
		HeldTime                   json.RawMessage // logged when the request was held for room
	}
	if json.Unmarshal([]byte(line), &l) != nil || l.Msg != "request" {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n[l.Mode+"/"+l.Reason+"/"+l.Outcome]++
	if l.HeldTime != nil {
		r.n["held, then "+l.Outcome]++
	}
}

// list is "route count" for each route, sorted.
func (r *routeCounts) list() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var parts []string
	for k, v := range r.n {
		parts = append(parts, fmt.Sprintf("%s %d", k, v))
	}
	sort.Strings(parts)
	return parts
}
