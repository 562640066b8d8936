package main

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

// report is the soak's outcome in markdown: the outcome table, latencies,
// extproc's goroutines and RSS, and the routes extproc logged.
func report(o options, stacks []*stack, st *stats, elapsed time.Duration) string {
	st.mu.Lock()
	defer st.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "\n## Soak: %v, %d in flight, prefill 503 every %d, decode kill every %v, a pool saturated every %v, 1 MiB prompt 1 in %d\n\n",
		elapsed.Round(time.Second), o.concurrency, o.failEvery, o.killEvery, o.saturateEvery, o.bigEvery)
	fmt.Fprintf(&b, "| outcome | requests |\n|---|---:|\n")
	classes := make([]string, 0, len(st.outcomes))
	for c := range st.outcomes {
		classes = append(classes, c)
	}
	sort.Strings(classes)
	for _, c := range classes {
		fmt.Fprintf(&b, "| %s | %d |\n", c, st.outcomes[c])
	}
	fmt.Fprintf(&b, "| **total** | **%d** (%.0f/s) |\n\n", st.requests, float64(st.requests)/elapsed.Seconds())
	var perMinute []string
	for _, m := range st.minutes {
		perMinute = append(perMinute, fmt.Sprintf("%d (%d)", m.requests, m.unexpected))
	}
	fmt.Fprintf(&b, "Requests (unexpected) by minute: %s\n\n", strings.Join(perMinute, ", "))
	// The slow prefill's 1.2 s spikes meet about one request in a hundred, so
	// the p99 lands either side of them from run to run: the share over a
	// second tells a shift apart from that.
	fmt.Fprintf(&b, "| latency of completed requests | n | p50 | p99 | max | over 1 s |\n|---|---:|---:|---:|---:|---:|\n")
	for _, size := range []string{"small prompt", "1MiB prompt", "may be shed (time held included)"} {
		l := slices.Clone(st.latencies[size])
		if len(l) == 0 {
			continue
		}
		slices.Sort(l)
		q := func(p float64) time.Duration { return l[min(len(l)-1, int(p*float64(len(l))))] }
		slow := len(l) - sort.Search(len(l), func(i int) bool { return l[i] > time.Second })
		fmt.Fprintf(&b, "| %s | %d | %v | %v | %v | %.2f %% |\n", size, len(l), q(.5).Round(100*time.Microsecond), q(.99).Round(100*time.Microsecond),
			l[len(l)-1].Round(100*time.Microsecond), 100*float64(slow)/float64(len(l)))
	}
	fmt.Fprintf(&b, "\n| extproc | goroutines start / peak / end | + idle pool at the end | RSS start / peak / end (MiB) | decode kills | saturations |\n|---|---:|---:|---:|---:|---:|\n")
	for _, s := range stacks {
		start, peak := s.usage.figures()
		total, pooled := s.goroutines()
		fmt.Fprintf(&b, "| %s | %.0f / %.0f / %d | %d | %.1f / %.1f / %.1f | %d | %d |\n", s.connector,
			start.goroutines, peak.goroutines, total-pooled, pooled,
			start.rss/(1<<20), peak.rss/(1<<20), s.rss()/(1<<20), s.kills.count(), s.saturated.count())
	}
	fmt.Fprintf(&b, "\n| extproc | its requests by mode / reason / outcome |\n|---|---|\n")
	for _, s := range stacks {
		fmt.Fprintf(&b, "| %s | %s |\n", s.connector, strings.Join(s.routes.list(), ", "))
	}
	if len(st.samples) > 0 {
		fmt.Fprintf(&b, "\nUnexpected (first %d):\n\n", len(st.samples))
		for _, s := range st.samples {
			fmt.Fprintf(&b, "- %s\n", s)
		}
	}
	return b.String()
}
