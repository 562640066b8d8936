package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// footprint is what the ext_proc replicas of a run hold together.
type footprint struct {
	RSS        uint64 // resident memory, from /proc
	Heap       uint64 // live heap after a collection: go_memstats_heap_alloc_bytes
	Goroutines int
}

func (f footprint) minus(g footprint) footprint {
	return footprint{RSS: f.RSS - min(f.RSS, g.RSS), Heap: f.Heap - min(f.Heap, g.Heap), Goroutines: f.Goroutines - g.Goroutines}
}

// measure collects garbage in every replica first (the heap profile's gc=1),
// so that the heap is what is live, then reads their figures.
func measure(ctx context.Context, rs []server) (footprint, error) {
	var f footprint
	for _, r := range rs {
		if err := fetch(ctx, "http://"+r.admin+"/debug/pprof/heap?gc=1", io.Discard); err != nil {
			return f, fmt.Errorf("%s: %w", r.Name, err)
		}
		rss, _, err := testbed.Memory(r.Pid())
		if err != nil {
			return f, err
		}
		heap, err := testbed.Metric(ctx, r.admin, "go_memstats_heap_alloc_bytes")
		if err != nil {
			return f, fmt.Errorf("%s: %w", r.Name, err)
		}
		g, err := testbed.Metric(ctx, r.admin, "go_goroutines")
		if err != nil {
			return f, fmt.Errorf("%s: %w", r.Name, err)
		}
		f.RSS += rss
		f.Heap += uint64(heap)
		f.Goroutines += int(g)
	}
	return f, nil
}

// cpuSeconds is the CPU the replicas have used so far, together.
func cpuSeconds(rs []server) (float64, error) {
	var total float64
	for _, r := range rs {
		s, err := testbed.CPUSeconds(r.Pid())
		if err != nil {
			return 0, err
		}
		total += s
	}
	return total, nil
}

// heapTop saves the first replica's heap profile in dir and returns the
// biggest holders of live memory, as `go tool pprof -top` lists them.
func heapTop(ctx context.Context, r server, dir, name string) (string, error) {
	path := filepath.Join(dir, name+".heap.pprof")
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	err = fetch(ctx, "http://"+r.admin+"/debug/pprof/heap?gc=1", f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, "go", "tool", "pprof", "-top", "-sample_index=inuse_space", "-nodecount=6", path).Output()
	if err != nil {
		return "", fmt.Errorf("go tool pprof %s: %w", path, err)
	}
	var top []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		// flat flat% sum% cum cum% name...
		if len(f) >= 6 && strings.HasSuffix(f[1], "%") && strings.HasSuffix(f[4], "%") {
			top = append(top, fmt.Sprintf("%s %s", f[1], strings.Join(f[5:], " ")))
		}
	}
	return strings.Join(top, "; "), nil
}

// fetch copies what GET url answers to w; only a 200 counts.
func fetch(ctx context.Context, url string, w io.Writer) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	if err == nil {
		_, err = io.Copy(w, resp.Body)
	}
	if resp != nil {
		resp.Body.Close()
	}
	return err
}
