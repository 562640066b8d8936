package scheduling

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// Shedding (admission.objectives): interactive multi-turn chat beside batch
// work whose objective has a negative priority. With shedding on, a replica
// holds a batch request while every engine of its pool reports a queue at
// or above the line (Pool.Saturated), releasing it as the scrapes show room
// (Hold), and refuses it when its hold runs out (or at once, without a
// hold); the client sends a refused request again after the Retry-After:
// batch work is put off, not dropped. The engines, the caches and the
// scrapes are the aggregated simulation's (sim_test.go).

// batchBeside is (b)'s conversations at their rate beside unrelated
// completions prompts, the batch work, at k times (b)'s rate of them.
func batchBeside(k float64) simWorkload {
	return simWorkload{fmt.Sprintf("b + batch x%g", k), func(r *rand.Rand, w *workload, end, load float64) {
		w.conversations(r, end, 2.6*load, w.tenants(r, 8, 2_000, 8_000))
		w.randoms(r, end, 2.5*k*load)
	}}
}

// shedding is how a run sheds: its queue line (0: no shedding) and how long
// a refused client waits before it sends again (the 429's Retry-After).
type shedding struct {
	line  float64
	retry time.Duration
	hold  time.Duration // how long a request is held before it is refused (simParams.HoldFor)
}

var (
	noShedding   = shedding{}
	shedDefaults = shedding{config.DefaultSaturatedQueue, config.DefaultShedRetryAfter, config.DefaultHold}
	refuseAtOnce = shedding{config.DefaultSaturatedQueue, config.DefaultShedRetryAfter, 0} // admission.hold: 0s
)

type shedRow struct {
	batch  float64 // batchBeside's k
	policy string
	shedding
	shed int // refusals, summed over the seeds
	// the means over the seeds of each class's mean and p99 TTFT
	interactive, batchTTFT simTTFT
	offered                float64
}

func (r shedRow) String() string {
	how := r.shedding.String()
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	return fmt.Sprintf("batch x%-3g %-16s %-30s offered %3.0f%%  shed %6d  interactive TTFT mean %7.0f p99 %7.0f ms  batch mean %7.0f p99 %7.0f ms",
		r.batch, r.policy, how, 100*r.offered, r.shed, ms(r.interactive.Mean), ms(r.interactive.P99), ms(r.batchTTFT.Mean), ms(r.batchTTFT.P99))
}

func shedTable(batches []float64, ways []shedding, policies []string, d time.Duration, seeds []uint64) []shedRow {
	var rows []shedRow
	for _, k := range batches {
		for _, name := range policies {
			for _, how := range ways {
				row := shedRow{batch: k, policy: name, shedding: how}
				for _, seed := range seeds {
					p := defaultSimParams()
					p.Workload, p.Seed, p.Duration = batchBeside(k), seed, d
					how.apply(&p)
					r := simulate(p, newWorkload(p), configured(name), 1)
					row.shed += r.Shed
					row.offered += r.Offered / float64(len(seeds))
					row.interactive.meanOver(r.Interactive, len(seeds))
					row.batchTTFT.meanOver(r.BatchTTFT, len(seeds))
				}
				rows = append(rows, row)
			}
		}
	}
	return rows
}

// BenchmarkShedding is docs/scheduling.md's shedding table: batch work at
// 1, 8, 12 and 16 times (b)'s rate beside its chat, least-load and
// prefix-affinity, without shedding; refused at once at the default line
// (5) with Retry-After 1, 5 and 30 s (the default), and at line 2; and
// held (the defaults), five simulated minutes, three seeds. Run it as
// BenchmarkPolicies: it logs each row, then the table as the docs have it.
func BenchmarkShedding(b *testing.B) {
	ways := []shedding{noShedding, {5, time.Second, 0}, {5, 5 * time.Second, 0}, refuseAtOnce, {2, config.DefaultShedRetryAfter, 0}, shedDefaults}
	rows := shedTable([]float64{1, 8, 12, 16}, ways, []string{"least-load", "prefix-affinity"}, 5*time.Minute, simSeeds)
	for _, r := range rows {
		b.Log(r)
	}
	var lines []string
	for g := range slices.Chunk(rows, len(ways)) {
		cells := make([]string, len(g))
		for i, r := range g {
			cells[i] = shedCell(r.interactive, r.batchTTFT, r.shed)
		}
		lines = append(lines, fmt.Sprintf("| ×%g | %s | %.0f %% | %s |", g[0].batch, g[0].policy, 100*g[0].offered, strings.Join(sameAsFirst(cells), " | ")))
	}
	b.Log("\n| batch | policy | offered | no shedding: mean, p99 | refused, retry 1 s | refused, retry 5 s | refused, retry 30 s | " +
		"refused at line 2, retry 30 s | **held 30 s, then retry 30 s (defaults)** |\n|---|---|---|---|---|---|---|---|---|\n" + strings.Join(lines, "\n"))
}

// shedCell is a cell of the shedding tables: the chat's then the batch
// work's time to first token, mean and p99 in ms, and the refusals.
func shedCell(chat, batch simTTFT, shed int) string {
	in := func(d time.Duration) string { return thousands(int(math.RoundToEven(ms(d)))) }
	s := fmt.Sprintf("%s, %s / %s, %s", in(chat.Mean), in(chat.P99), in(batch.Mean), in(batch.P99))
	if shed > 0 {
		s += fmt.Sprintf(" (%s refused)", thousands(shed))
	}
	return s
}

// sameAsFirst reads "the same" for each cell after the first that reads as
// the first: a way of shedding that changed nothing.
func sameAsFirst(cells []string) []string {
	out := slices.Clone(cells)
	for i := 1; i < len(out); i++ {
		if out[i] == cells[0] {
			out[i] = "the same"
		}
	}
	return out
}

// With its defaults (a hold of 30 s) shedding changes nothing where the
// engines keep up; under heavy overload it at least halves the chat's mean
// and p99 time to first token under either policy, and does as well for the
// chat as refusing at once or better. In P/D it halves them where the
// prefill pool is saturated (always P/D at 4 × the batch work), and under
// cache-aware P/D at 6 ×, where refusing at once made the chat 4 times
// slower, it leaves the chat no slower than without shedding.
func TestSimulatedShedding(t *testing.T) {
	if testing.Short() || raceDetector {
		t.Skip("simulation: make test runs it without -race")
	}
	rows := shedTable([]float64{1, 16}, []shedding{noShedding, refuseAtOnce, shedDefaults}, []string{"least-load", "prefix-affinity"}, 2*time.Minute, simSeeds[:1])
	for i := 0; i < len(rows); i += 3 {
		off, refuse, on := rows[i], rows[i+1], rows[i+2]
		t.Log(off)
		t.Log(refuse)
		t.Log(on)
		switch {
		// Within 1 %: with shedding on the engines are scraped past the window,
		// which the few requests retried after it see.
		case off.batch == 1 && (on.shed > 0 || !near(on.interactive, off.interactive) || !near(on.batchTTFT, off.batchTTFT)):
			t.Errorf("%s at nominal load: %d shed, figures changed", on.policy, on.shed)
		case off.batch > 1 && (on.interactive.Mean > off.interactive.Mean/2 || on.interactive.P99 > off.interactive.P99/2):
			t.Errorf("%s, batch x%g: the chat's TTFT mean %v, p99 %v with shedding against %v, %v without; want at most half",
				on.policy, on.batch, on.interactive.Mean, on.interactive.P99, off.interactive.Mean, off.interactive.P99)
		case off.batch > 1 && (on.interactive.Mean > refuse.interactive.Mean || on.interactive.P99 > refuse.interactive.P99):
			t.Errorf("%s, batch x%g: the chat's TTFT mean %v, p99 %v holding against %v, %v refusing at once; want no more",
				on.policy, on.batch, on.interactive.Mean, on.interactive.P99, refuse.interactive.Mean, refuse.interactive.P99)
		}
	}
	pd := func(pol pdPolicy, k float64, how shedding) simTTFT {
		p := defaultPDParams()
		p.Workload, p.Duration, p.Load = batchBeside(k), 2*time.Minute, pdRates[multiTurn.name]
		how.apply(&p.simParams)
		r := simulatePD(p, newWorkload(p.simParams), pol, 1)
		t.Logf("P/D, %s, batch x%g, %v: shed %d, chat TTFT mean %v p99 %v", pol.name, k, how, r.Shed, r.Interactive.Mean, r.Interactive.P99)
		return r.Interactive
	}
	if off, on := pd(pdAlways, 4, noShedding), pd(pdAlways, 4, shedDefaults); on.Mean > off.Mean/2 || on.P99 > off.P99/2 {
		t.Errorf("P/D, always: shedding left the chat's TTFT at mean %v, p99 %v against %v, %v; want at most half", on.Mean, on.P99, off.Mean, off.P99)
	}
	if off, on := pd(pdCache, 6, noShedding), pd(pdCache, 6, shedDefaults); on.Mean > off.Mean*11/10 || on.P99 > off.P99*11/10 {
		t.Errorf("P/D, cache-aware: shedding left the chat's TTFT at mean %v, p99 %v against %v, %v; want within a tenth", on.Mean, on.P99, off.Mean, off.P99)
	}
}

// pdShedRow is one row of the P/D shedding table: the means over the seeds.
type pdShedRow struct {
	batch    float64
	policy   string
	replicas int
	shedding
	shed                   int
	interactive, batchTTFT simTTFT
	prefillUtil            float64
	p99ITL                 time.Duration
}

func (r pdShedRow) String() string {
	how := r.shedding.String()
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	return fmt.Sprintf("replicas %d batch x%-3g %-12s %-30s prefill busy %3.0f%%  shed %6d  chat TTFT mean %7.0f p99 %7.0f ms  batch mean %7.0f p99 %7.0f ms  p99 ITL %5.1f ms",
		r.replicas, r.batch, r.policy, how, 100*r.prefillUtil, r.shed, ms(r.interactive.Mean), ms(r.interactive.P99), ms(r.batchTTFT.Mean), ms(r.batchTTFT.P99), ms(r.p99ITL))
}

// BenchmarkSheddingPD is docs/scheduling.md's shedding table for P/D: the P/D
// simulation (simpd_test.go: four prefill and four decode engines) with
// batchBeside's traffic at (b)'s P/D rate, always P/D and cache-aware P/D,
// without shedding, refused at once and held (the defaults), at one and
// three replicas, five simulated minutes, three seeds. Run it as
// BenchmarkPolicies: it logs each row, then the table as the docs have it.
func BenchmarkSheddingPD(b *testing.B) {
	ways := []shedding{noShedding, refuseAtOnce, shedDefaults}
	var lines []string
	for _, replicas := range []int{1, 3} {
		for _, k := range []float64{1, 3, 4, 6, 8} {
			for _, pol := range []pdPolicy{pdAlways, pdCache} {
				cells, itl := make([]string, len(ways)), make([]string, len(ways))
				var busy float64
				for i, how := range ways {
					r := sheddingPD(b, replicas, k, pol, how)
					cells[i], itl[i] = shedCell(r.interactive, r.batchTTFT, r.shed), fmt.Sprintf("%.1f", ms(r.p99ITL))
					if i == 0 {
						busy = r.prefillUtil
					}
				}
				lines = append(lines, fmt.Sprintf("| %d | ×%g | %s | %.0f %% | %s | %s |", replicas, k, pol.name, 100*busy,
					strings.Join(sameAsFirst(cells), " | "), strings.Join(itl, " → ")))
			}
		}
	}
	b.Log("\n| replicas | batch | policy | prefill busy | no shedding | refused at once | **held (defaults)** | p99 ITL, ms |\n" +
		"|---|---|---|---|---|---|---|---|\n" + strings.Join(lines, "\n"))
}

// sheddingPD is the row of batch work at k times the chat's rate, at that
// many replicas, under pol, shed as how says; it logs it.
func sheddingPD(b *testing.B, replicas int, k float64, pol pdPolicy, how shedding) pdShedRow {
	row := pdShedRow{batch: k, policy: pol.name, shedding: how, replicas: replicas}
	for _, seed := range simSeeds {
		p := defaultPDParams()
		p.Workload, p.Seed, p.Duration, p.Load = batchBeside(k), seed, 5*time.Minute, pdRates[multiTurn.name]
		how.apply(&p.simParams)
		r := simulatePD(p, newWorkload(p.simParams), pol, replicas)
		row.shed += r.Shed
		row.prefillUtil += r.PrefillUtil / float64(len(simSeeds))
		row.p99ITL += r.P99ITL / time.Duration(len(simSeeds))
		row.interactive.meanOver(r.Interactive, len(simSeeds))
		row.batchTTFT.meanOver(r.BatchTTFT, len(simSeeds))
	}
	b.Log(row)
	return row
}

// apply makes p's completions prompts batch work, shed as s says.
func (s shedding) apply(p *simParams) {
	p.Batch, p.Shed, p.ShedQueue, p.ShedRetry, p.HoldFor = true, s.line > 0, s.line, s.retry, s.hold
}

func (s shedding) String() string {
	switch {
	case s.line == 0:
		return "off"
	case s.hold > 0:
		return fmt.Sprintf("line %g, hold %v, retry %v", s.line, s.hold, s.retry)
	}
	return fmt.Sprintf("line %g, retry %v", s.line, s.retry)
}

// near: a's figures within 1 % of b's.
func near(a, b simTTFT) bool {
	within := func(x, y time.Duration) bool { return (x - y).Abs() <= y/100 }
	return within(a.Mean, b.Mean) && within(a.P99, b.P99)
}
