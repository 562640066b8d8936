package main

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// maxRatio is the target: an extproc replica holds a stream for at most this
// many times the echo server's memory per stream.
const maxRatio = 1.2

type report struct {
	o       options
	files   uint64
	started time.Time
	load0   string
	results []result
}

func newReport(o options, files uint64) *report {
	return &report{o: o, files: files, started: time.Now(), load0: testbed.LoadAverage()}
}

func (r *report) add(res result) { r.results = append(r.results, res) }

func (r *report) header() string {
	cpu := "unknown"
	if b, err := exec.Command("sh", "-c", "lscpu | sed -n 's/^Model name: *//p'").Output(); err == nil {
		cpu = strings.TrimSpace(string(b))
	}
	rev := "unknown"
	if b, err := exec.Command("git", "describe", "--always", "--dirty").Output(); err == nil {
		rev = strings.TrimSpace(string(b))
	}
	o := r.o
	return strings.Join([]string{
		"- source: " + rev,
		fmt.Sprintf("- machine: %s/%s, %d CPUs (%s), %s", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), cpu, runtime.Version()),
		fmt.Sprintf("- open files allowed to this process: %d", r.files),
		"- command: " + strings.Join(os.Args, " "),
		fmt.Sprintf("- per run: %d streamed chat requests of %d bytes opened over %v across %d emulator processes, in front of %d ext_proc replicas; each stream %d tokens, one every %v; two decode engines (and two prefill engines for pd)",
			o.streams, len(chatBody(o.bodyBytes)), o.ramp, o.emulators, replicas, o.tokens, o.tpot),
		"- load average at the start (other sessions share this machine): " + r.load0,
	}, "\n")
}

func (r *report) String() string {
	var b strings.Builder
	b.WriteString(r.header())
	fmt.Fprintf(&b, "\n- load average at the end: %s; the run took %v\n\n", testbed.LoadAverage(), time.Since(r.started).Round(time.Second))
	b.WriteString("| target | response path | completed | failed | lost | held at once | RSS / stream | heap / stream | goroutines / stream | CPU while holding | Envoy overflows |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, res := range r.results {
		rss, heap, g := res.perStream()
		fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %v | %.1f KiB | %.1f KiB | %.2f | %.2f cores | %d |\n",
			res.Target, res.Response, res.Completed, res.Failed, res.Lost, res.Plateau.Round(time.Second),
			rss/1024, heap/1024, g, res.CPU, res.Overflows)
	}
	b.WriteString("\n")
	for _, res := range r.results {
		fmt.Fprintf(&b, "- %s, response %s: idle %s; holding %s", res.Target, res.Response, res.Idle, res.Held)
		if res.FirstFailure != "" {
			fmt.Fprintf(&b, "; first failure: %s", res.FirstFailure)
		}
		if res.Err != nil {
			fmt.Fprintf(&b, "; error: %v", res.Err)
		}
		if res.HeapTop != "" {
			fmt.Fprintf(&b, "; heap profile while holding: %s", res.HeapTop)
		}
		b.WriteString("\n")
	}
	b.WriteString("\nVerdicts (memory per held stream against echo's in the same response mode, target ≤ 1.2 ×; requests lost or failed, target 0):\n\n")
	for _, v := range r.verdicts() {
		b.WriteString("- " + v + "\n")
	}
	return b.String()
}

func (r *report) verdicts() []string {
	echo := map[string]result{}
	for _, res := range r.results {
		if res.Target == targetEcho {
			echo[res.Response] = res
		}
	}
	var out []string
	for _, res := range r.results {
		lostOrFailed := res.Failed + res.Lost
		v := fmt.Sprintf("%s, response %s: %d lost or failed (%s)", res.Target, res.Response, lostOrFailed, metOr(lostOrFailed == 0))
		if e, ok := echo[res.Response]; ok && res.Target != targetEcho {
			v += "; " + memoryVerdict(res, e)
		}
		out = append(out, v)
	}
	return out
}

// memoryVerdict judges the replicas' memory per held stream against echo's.
// A server that keeps no goroutine per stream holds no stream: Envoy closed
// its ext_proc stream once the request was routed, and what is left above
// idle is what opening the streams allocated, not what holding them costs.
func memoryVerdict(res, echo result) string {
	rss, heap, g := res.perStream()
	ers, eheap, eg := echo.perStream()
	if g < 0.5 && eg < 0.5 {
		return fmt.Sprintf("no stream held by either server (%.1f KiB RSS per stream left by the ramp, echo %.1f KiB): met", rss/1024, ers/1024)
	}
	return fmt.Sprintf("RSS per stream %.2f × echo (%s), heap per stream %.2f × echo (%s)",
		rss/ers, metOr(rss <= maxRatio*ers), heap/eheap, metOr(heap <= maxRatio*eheap))
}

func metOr(ok bool) string {
	if ok {
		return "met"
	}
	return "missed"
}

// failures are what makes the command fail: streams lost or failed, Envoy
// overflowing, a run that could not hold its streams.
func (r *report) failures() []error {
	var errs []error
	for _, res := range r.results {
		if res.Failed+res.Lost > 0 || res.Overflows > 0 {
			errs = append(errs, fmt.Errorf("%s/%s: %d failed, %d lost, %d Envoy overflows", res.Target, res.Response, res.Failed, res.Lost, res.Overflows))
		}
	}
	return errs
}

func (f footprint) String() string {
	return fmt.Sprintf("%.1f MiB RSS, %.1f MiB heap, %d goroutines", float64(f.RSS)/(1<<20), float64(f.Heap)/(1<<20), f.Goroutines)
}
