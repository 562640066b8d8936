package scheduling

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// pdSeeds are the seeds of BenchmarkPD's rows, every policy on the same:
// one, so that the run fits in go test's default timeout of ten minutes on
// two CPUs.
var pdSeeds = simSeeds[:1]

// BenchmarkPD is the P/D simulation's tables. Run it with
//
//	GOEXPERIMENT=simd go test -run '^$' -bench '^BenchmarkPD$' -benchtime 1x ./pkg/scheduling/
//
// It simulates ten minutes of (b), (e) and (a) at nominal and 1.5× load, at
// one and three replicas, for each policy of pdPolicies, then the sweep of
// the cache rule's bounds and the load arm's line on (b) and (e) at one
// replica; each sub-benchmark reports its row, and the last, "tables", prints
// them as markdown with the ratios to always-P/D and the targets met (to
// standard output: go test would cut a benchmark's log to ten lines).
func BenchmarkPD(b *testing.B) {
	main := pdTable([]simWorkload{multiTurn, random, oneShot}, []int{largeCache}, []float64{1, 1.5}, []int{1, 3}, pdPolicies)
	sweep := pdTable([]simWorkload{multiTurn, random}, []int{largeCache}, []float64{1, 1.5}, []int{1}, pdSweep())
	rows := runPD(slices.Concat(main, sweep), 10*time.Minute, pdSeeds)
	for _, r := range rows {
		b.Run(r.pdCell.String(), func(b *testing.B) {
			b.ReportMetric(100*r.DecodeOnly, "decode-only%")
			b.ReportMetric(ms(r.MeanTTFT), "mean-ttft-ms")
			b.ReportMetric(ms(r.P99TTFT), "p99-ttft-ms")
			b.ReportMetric(ms(r.P99ITL), "p99-itl-ms")
			b.ReportMetric(r.PrefillWork.Seconds(), "prefill-s")
		})
	}
	b.Run("tables", func(b *testing.B) {
		fmt.Print(pdMarkdown("P/D", rows[:len(main)], rows), pdMarkdown("Sweep, one replica", rows[len(main):], rows))
	})
}

// BenchmarkPDSmallCache is BenchmarkPD's (b) and (a) where each engine's
// prefix cache is smallCache, a quarter to a half of the tenants' system
// prompts and far less than the conversations' histories: the decode
// engines evict what the cache rule assumes they hold. Run it with
//
//	GOEXPERIMENT=simd go test -run '^$' -bench '^BenchmarkPDSmallCache$' -benchtime 1x ./pkg/scheduling/
func BenchmarkPDSmallCache(b *testing.B) {
	policies := []pdPolicy{pdAggregated, pdAlways, pdLength, pdCache, pdLoadArm, pdCacheEvents, pdCachePinned}
	rows := runPD(pdTable([]simWorkload{multiTurn, oneShot}, []int{smallCache}, []float64{1, 1.5}, []int{1, 3}, policies), 10*time.Minute, pdSeeds)
	b.Run("tables", func(b *testing.B) { fmt.Print(pdMarkdown("P/D", rows, rows)) })
}

// TestSimulatedPDTargets checks the targets of pdTargets on a short run that
// make test affords: three simulated minutes of (b) and (e), one seed,
// always-P/D against cache-aware with pkg/config's defaults, without and
// with the engines' KV events, at one replica and (for the decisions)
// three.
func TestSimulatedPDTargets(t *testing.T) {
	if testing.Short() || raceDetector {
		t.Skip("simulation: make test runs it without -race")
	}
	cells := slices.Concat(
		pdTable([]simWorkload{multiTurn, random}, []int{largeCache}, []float64{1, 1.5}, []int{1}, []pdPolicy{pdAlways, pdCache, pdCacheEvents}),
		pdTable([]simWorkload{multiTurn}, []int{largeCache}, []float64{1, 1.5}, []int{3}, []pdPolicy{pdCache, pdCacheEvents}))
	rows := runPD(cells, 3*time.Minute, simSeeds[:1])
	always := alwaysOf(rows)
	for _, r := range rows {
		t.Logf("%-50v decode-only %5.1f%%  TTFT mean %6.1f ms  p99 %7.1f ms  p99 ITL %5.1f ms  prefill %4.0f s  same %.3f",
			r.pdCell, 100*r.DecodeOnly, ms(r.MeanTTFT), ms(r.P99TTFT), ms(r.P99ITL), r.PrefillWork.Seconds(), r.Same)
		for _, target := range pdTargets(r, always(r)) {
			if !target.met() {
				t.Errorf("%v: target missed: %v", r.pdCell, target)
			}
		}
	}
}

// TestSimulatedPDSmallCacheEstimates checks, on a short run that make test
// affords, what the engines' counters give the cache rule on decode caches
// smaller than the prompts (docs/scheduling.md, "Small caches"): one-shot
// questions under shared system prompts get their first token in at most
// 0.35 × always-P/D's mean time (0.28 with the counters, 0.45 without them,
// on this run: three simulated minutes, seed 42, one replica).
func TestSimulatedPDSmallCacheEstimates(t *testing.T) {
	if testing.Short() || raceDetector {
		t.Skip("simulation: make test runs it without -race")
	}
	rows := runPD(pdTable([]simWorkload{oneShot}, []int{smallCache}, []float64{1}, []int{1}, []pdPolicy{pdAlways, pdCache}), 3*time.Minute, simSeeds[:1])
	always := alwaysOf(rows)
	for _, r := range rows[1:] {
		if ttft, _, _, _ := pdRatios(r, always(r)); ttft > 0.35 {
			t.Errorf("%v: mean TTFT %.0f ms, %.2f × always-P/D's; want at most 0.35 ×", r.pdCell, ms(r.MeanTTFT), ttft)
		}
	}
}
