package scheduling

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// The P/D simulation's tables: each policy against the same requests, its
// ratios to always-P/D in the same run, and the targets it meets.

// pdRates multiply each workload's rates (on top of the load): at nominal
// load, always-P/D's prefill pool is some 65 % busy on (b) and (e). (a)'s
// stops at a third: its requests are many and short, so that at the rate
// that would keep its prefill pool as busy the decode pool would be past
// saturation at 1.5×. The rates are the large cache's; see pdRate for the
// small one.
var pdRates = map[string]float64{multiTurn.name: 1.8, random.name: 0.8, oneShot.name: 3}

// pdRate is a cell's rate factor: pdRates', but (b)'s at 0.8 where caches
// are small. A prefill pool sized for the large cache's hit rates would be
// past saturation at nominal load (always-P/D's 110 % busy at 1.8), and
// operators size a pool for the hit rates they get: at 0.8 always-P/D's is
// some 60 % busy. (a)'s stays at 3, where the small cache's misses keep it
// some 65 % busy (a third with the large).
func pdRate(c pdCell) float64 {
	if c.cache == smallCache && c.workload.name == multiTurn.name {
		return 0.8
	}
	return pdRates[c.workload.name]
}

func pdTokens(n int) *int { return &n }

// The policies of the tables.
var (
	pdAggregated = pdPolicy{name: "aggregated", aggregated: true}
	pdAlways     = pdPolicy{name: "always P/D", pd: config.PD{Mode: config.PDAlways}}
	pdLength     = pdPolicy{name: "length rule", pd: config.PD{Mode: config.PDAuto, MinPromptTokens: 512, MinUncachedTokens: pdTokens(0)}}
	pdCache      = pdPolicy{name: "cache-aware", pd: config.PD{Mode: config.PDAuto}} // pkg/config's defaults
	// The same on decode engines left at vLLM's 2,048-token step budget.
	pdCacheWide = pdPolicy{name: "cache-aware, 2048-token steps", pd: config.PD{Mode: config.PDAuto}, decodeChunkChars: pdChunkChars}
	pdLoadArm   = pdLoaded(2)
	// With both pools following the engines' KV events: the decider reads
	// the decode engine's exact hit.
	pdCacheEvents = pdPolicy{name: "cache-aware + events", pd: config.PD{Mode: config.PDAuto}, events: true}
	// Behind an Envoy that keeps each conversation on one replica.
	pdCachePinned = pdPolicy{name: "cache-aware, sessions pinned", pd: config.PD{Mode: config.PDAuto}, pinned: true}
	pdPolicies    = []pdPolicy{pdAggregated, pdAlways, pdLength, pdCache, pdCacheWide, pdLoadArm, pdCacheEvents, pdCachePinned}
)

func pdLoaded(queue float64) pdPolicy {
	return pdPolicy{name: fmt.Sprintf("cache-aware + load %g", queue), pd: config.PD{Mode: config.PDAuto, Load: config.PDLoad{PrefillQueue: queue}}}
}

// pdSweep is cache-aware at other bounds, and with the load arm.
func pdSweep() []pdPolicy {
	var out []pdPolicy
	for _, ratio := range []float64{0.7, 1} {
		for _, n := range []int{64, 256, 512, 1024, 2048} {
			out = append(out, pdPolicy{name: fmt.Sprintf("min_uncached %d, ratio %g", n, ratio),
				pd: config.PD{Mode: config.PDAuto, MinUncachedTokens: pdTokens(n), MaxUncachedRatio: ratio}})
		}
	}
	for _, q := range []float64{1, 2, 4} {
		out = append(out, pdLoaded(q))
	}
	return out
}

type pdCell struct {
	workload simWorkload
	cache    int // each engine's prefix cache, in characters
	load     float64
	replicas int
	policy   pdPolicy
}

func (c pdCell) String() string {
	return fmt.Sprintf("%s/cache=%d/load=%.1fx/replicas=%d/%s", c.workload.name, c.cache, c.load, c.replicas, c.policy.name)
}

// pdRow is a cell's results, the means over the seeds.
type pdRow struct {
	pdCell
	pdResult
	Same float64 // share of requests decided as at one replica; -1: not compared
}

func pdTable(workloads []simWorkload, caches []int, loads []float64, replicas []int, policies []pdPolicy) []pdCell {
	var cells []pdCell
	for _, w := range workloads {
		for _, c := range caches {
			for _, l := range loads {
				for _, n := range replicas {
					for _, p := range policies {
						cells = append(cells, pdCell{w, c, l, n, p})
					}
				}
			}
		}
	}
	return cells
}

// runPD simulates every cell for every seed, on all CPUs.
func runPD(cells []pdCell, duration time.Duration, seeds []uint64) []pdRow {
	results := simulateCells(cells, seeds, func(c pdCell, seed uint64, ws *workloads) pdResult {
		p := defaultPDParams()
		p.Workload, p.Seed, p.Duration, p.Load = c.workload, seed, duration, c.load*pdRate(c)
		p.CacheChars = c.cache
		return simulatePD(p, ws.of(p.simParams), c.policy, c.replicas)
	})

	one := map[string]int{} // the cell at one replica of each workload, load and policy
	for i, c := range cells {
		if c.replicas == 1 {
			one[fmt.Sprint(c.workload.name, c.cache, c.load, c.policy.name)] = i
		}
	}
	rows := make([]pdRow, len(cells))
	for i, rs := range results {
		row := pdRow{pdCell: cells[i], Same: -1}
		k := float64(len(rs))
		j, compared := one[fmt.Sprint(cells[i].workload.name, cells[i].cache, cells[i].load, cells[i].policy.name)]
		if compared = compared && cells[i].replicas > 1 && !cells[i].policy.aggregated; compared {
			row.Same = 0
		}
		for s, r := range rs {
			row.Requests += r.Requests
			row.DecodeOnly += r.DecodeOnly / k
			row.MeanTTFT += r.MeanTTFT / time.Duration(k)
			row.P99TTFT += r.P99TTFT / time.Duration(k)
			row.MeanITL += r.MeanITL / time.Duration(k)
			row.P99ITL += r.P99ITL / time.Duration(k)
			row.PrefillWork += r.PrefillWork / time.Duration(k)
			row.LocalWork += r.LocalWork / time.Duration(k)
			row.PrefillUtil += r.PrefillUtil / k
			row.HeldRatio += r.HeldRatio / k
			row.Unseen += r.Unseen / k
			row.Cached += r.Cached / k
			row.PrefillBusy += r.PrefillBusy / k
			row.DecodeBusy += r.DecodeBusy / k
			if compared {
				row.Same += sameDecisions(r.Decisions, results[j][s].Decisions) / k
			}
		}
		row.Requests /= len(rs)
		rows[i] = row
	}
	return rows
}

// result sums up a run.
func (s *pdSim) result() pdResult {
	n := len(s.ttfts)
	res := pdResult{Requests: n, DecodeOnly: 1 - float64(s.pd)/float64(n), PrefillWork: s.prefillWork, LocalWork: s.local,
		PrefillUtil: s.prefillWork.Seconds() / (float64(s.p.Prefill) * s.p.Duration.Seconds()), Decisions: s.decisions,
		Unseen: float64(s.unseen) / float64(n), Cached: float64(s.reasons[metrics.ReasonCachedPrefix]) / float64(n),
		PrefillBusy: float64(s.reasons[metrics.ReasonPrefillBusy]) / float64(n), DecodeBusy: float64(s.reasons[metrics.ReasonDecodeBusy]) / float64(n)}
	if s.heldEst > 0 {
		res.HeldRatio = s.heldReal / s.heldEst
	}
	res.Shed, res.Interactive, res.BatchTTFT = s.shed, ttftOf(s.byClass[0]), ttftOf(s.byClass[1])
	all := ttftOf(s.ttfts)
	res.MeanTTFT, res.P99TTFT = all.Mean, all.P99
	slices.SortFunc(s.steps, func(a, b pdStep) int { return cmp.Compare(a.d, b.d) })
	var gaps int
	var total time.Duration
	for _, st := range s.steps {
		gaps += st.n
		total += st.d * time.Duration(st.n)
	}
	res.MeanITL = total / time.Duration(max(gaps, 1))
	for i, seen := 0, 0; i < len(s.steps); i++ {
		if seen += s.steps[i].n; float64(seen) >= 0.99*float64(gaps) {
			res.P99ITL = s.steps[i].d
			break
		}
	}
	return res
}

// sameDecisions is the share of the requests (by session and turn) of a that
// b decided alike, among those both sent.
func sameDecisions(a, b map[[2]int]bool) float64 {
	same, both := 0, 0
	for k, pd := range a {
		if other, ok := b[k]; ok {
			both++
			if other == pd {
				same++
			}
		}
	}
	return float64(same) / float64(max(both, 1))
}

// A pdTarget is one target of a row: got against bound (at most, or at
// least for the share of decisions).
type pdTarget struct {
	name       string
	got, bound float64
	atLeast    bool
}

func (t pdTarget) met() bool {
	if t.atLeast {
		return t.got >= t.bound
	}
	return t.got <= t.bound
}

func (t pdTarget) String() string {
	op := "≤"
	if t.atLeast {
		op = "≥"
	}
	return fmt.Sprintf("%s %.3f %s %g", t.name, t.got, op, t.bound)
}

// pdRatios are r's mean TTFT, p99 TTFT, p99 ITL and prefill work over
// always-P/D's.
func pdRatios(r, always pdRow) (ttft, p99, itl, work float64) {
	ratio := func(a, b time.Duration) float64 {
		if b == 0 {
			return math.NaN()
		}
		return float64(a) / float64(b)
	}
	return ratio(r.MeanTTFT, always.MeanTTFT), ratio(r.P99TTFT, always.P99TTFT), ratio(r.P99ITL, always.P99ITL), ratio(r.PrefillWork, always.PrefillWork)
}

// pdTargets are the targets of a row of the cache rule's (auto mode, the
// rule on):
//   - (b) multi-turn: mean TTFT at most 0.8 × always-P/D's, prefill work at
//     most 0.6 ×, p99 inter-token latency at most 1.1 ×;
//   - (e) random: mean and p99 TTFT, p99 ITL and prefill work no more than
//     2 % above always-P/D's;
//   - more than one replica: at least 95 % of the requests decided as at
//     one replica.
func pdTargets(r, always pdRow) []pdTarget {
	if r.policy.aggregated || r.policy.pd.Mode != config.PDAuto || r.policy.pd.UncachedTokens(config.PolicyPrefixAffinity) == 0 {
		return nil
	}
	ttft, p99, itl, work := pdRatios(r, always)
	var ts []pdTarget
	switch name := r.workload.name; {
	case always.Requests == 0: // no always-P/D row to compare with
	case name == multiTurn.name:
		ts = append(ts, pdTarget{"TTFT", ttft, 0.8, false}, pdTarget{"work", work, 0.6, false}, pdTarget{"p99 ITL", itl, 1.1, false})
	case name == random.name:
		ts = append(ts, pdTarget{"TTFT", ttft, 1.02, false}, pdTarget{"p99 TTFT", p99, 1.02, false},
			pdTarget{"p99 ITL", itl, 1.02, false}, pdTarget{"work", work, 1.02, false})
	}
	if r.Same >= 0 {
		ts = append(ts, pdTarget{"same decision", r.Same, 0.95, true})
	}
	return ts
}

// alwaysOf indexes the always-P/D rows by workload, cache, load and replicas.
func alwaysOf(rows []pdRow) func(pdRow) pdRow {
	index := map[string]pdRow{}
	key := func(r pdRow) string { return fmt.Sprint(r.workload.name, r.cache, r.load, r.replicas) }
	for _, r := range rows {
		if r.policy.name == pdAlways.name {
			index[key(r)] = r
		}
	}
	return func(r pdRow) pdRow { return index[key(r)] }
}

// pdMarkdown renders rows as tables, one per workload: a line per row, in
// order, with its ratios to always-P/D (among all) and the targets it misses.
func pdMarkdown(title string, rows, all []pdRow) string {
	always := alwaysOf(all)
	var b strings.Builder
	var last pdCell
	for _, r := range rows {
		if r.workload.name != last.workload.name || r.cache != last.cache {
			last = r.pdCell
			fmt.Fprintf(&b, "\n**%s (%s), cache %s characters**, rates × %g\n\n", title, r.workload.name, thousands(r.cache), pdRate(r.pdCell))
			b.WriteString("| policy | load | replicas | requests | decode-only | mean TTFT, ms | p99 TTFT, ms | p99 ITL, ms | prefill work, s (busy) | local prefill, s | same decision | vs always: TTFT / p99 / ITL / work | cached_prefix / prefill_busy / decode_busy | targets |\n")
			b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
		}
		same := "—"
		if r.Same >= 0 {
			same = fmt.Sprintf("%.1f%%", 100*r.Same)
		}
		ttft, p99, itl, work := pdRatios(r, always(r))
		targets := "—"
		if ts := pdTargets(r, always(r)); ts != nil {
			var missed []string
			for _, t := range ts {
				if !t.met() {
					missed = append(missed, t.String())
				}
			}
			targets = "met"
			if missed != nil {
				targets = "missed: " + strings.Join(missed, "; ")
			}
		}
		fmt.Fprintf(&b, "| %s | %.1f× | %d | %d | %.1f%% | %.0f | %.0f | %.1f | %.0f (%.0f%%) | %.0f | %s | %.2f / %.2f / %.2f / %.2f | %.1f / %.1f / %.1f%% | %s |\n",
			r.policy.name, r.load, r.replicas, r.Requests, 100*r.DecodeOnly, ms(r.MeanTTFT), ms(r.P99TTFT), ms(r.P99ITL),
			r.PrefillWork.Seconds(), 100*r.PrefillUtil, r.LocalWork.Seconds(), same, ttft, p99, itl, work,
			100*r.Cached, 100*r.PrefillBusy, 100*r.DecodeBusy, targets)
	}
	return b.String()
}
