package scheduling

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// The tables of docs/scheduling.md: every workload, cache size, load and
// replica count, each policy against the same requests, as means over seeds.

// simPolicies are the policies the tables compare: the baselines first, then
// prefix affinity.
var simPolicies = []simPolicy{
	configured(config.PolicyRoundRobin), configured(config.PolicyLeastLoad),
	memoryPolicy, llmdModel, configured(config.PolicyPrefixAffinity), pinnedPolicy, eventsPolicy,
}

// pinnedPolicy is prefix-affinity behind an Envoy that keeps each
// conversation on one replica (its session header hashed): a replica then
// sees its conversations whole, and trusts its own memory of them.
var pinnedPolicy = simPolicy{name: "prefix-affinity, sessions pinned", config: config.PolicyPrefixAffinity, pinned: true}

// eventsPolicy is prefix-affinity with pools.<pool>.kv_events: every replica
// sees the engines' caches as they report them (sim_test.go's event model).
var eventsPolicy = simPolicy{name: "prefix-affinity + events", config: config.PolicyPrefixAffinity, events: true}

// ours reports whether the policy is pd-extproc's, not a baseline.
func ours(p simPolicy) bool { return p.config == config.PolicyPrefixAffinity }

var simSeeds = []uint64{42, 7, 99}

var raceDetector bool // see race_test.go

// simCell is one row of a table: a policy on a workload at a cache size,
// load and replica count.
type simCell struct {
	workload simWorkload
	cache    int
	load     float64
	replicas int
	policy   simPolicy
}

func (c simCell) String() string {
	return fmt.Sprintf("%s/cache=%dk/load=%.1fx/replicas=%d/%s", c.workload.name, c.cache/1000, c.load, c.replicas, c.policy.name)
}

// simRow is a cell's results, averaged over the seeds.
type simRow struct {
	simCell
	HitRate, Failed   float64
	Moves             float64
	Ceiling           float64
	Offered           float64 // prompt characters per second over the engines' prefill capacity
	MeanTTFT, P99TTFT time.Duration
}

func (r simRow) String() string {
	return fmt.Sprintf("%-60s offered %3.0f%%  hit rate %5.1f%%  TTFT mean %7.1f ms  p99 %8.1f ms  failed %5.1f  moves %5.0f",
		r.simCell, 100*r.Offered, 100*r.HitRate, ms(r.MeanTTFT), ms(r.P99TTFT), r.Failed, r.Moves)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// runTable simulates every cell for every seed, on all CPUs.
func runTable(cells []simCell, duration time.Duration, seeds []uint64) []simRow {
	results := simulateCells(cells, seeds, func(c simCell, seed uint64, ws *workloads) simResult {
		p := defaultSimParams()
		p.Workload, p.Seed, p.Duration, p.Load, p.CacheChars = c.workload, seed, duration, c.load, c.cache
		return simulate(p, ws.of(p), c.policy, c.replicas)
	})
	rows := make([]simRow, len(cells))
	for i, rs := range results {
		row := simRow{simCell: cells[i]}
		for _, r := range rs {
			row.HitRate += r.HitRate / float64(len(rs))
			row.Failed += float64(r.Failed) / float64(len(rs))
			row.Offered += r.Offered / float64(len(rs))
			row.Moves += float64(r.Moves) / float64(len(rs))
			row.Ceiling += r.Ceiling / float64(len(rs))
			row.MeanTTFT += r.MeanTTFT / time.Duration(len(rs))
			row.P99TTFT += r.P99TTFT / time.Duration(len(rs))
		}
		rows[i] = row
	}
	return rows
}

// simulateCells runs sim for every cell and seed, on all CPUs: the results
// by cell, then by seed.
func simulateCells[C, R any](cells []C, seeds []uint64, sim func(c C, seed uint64, ws *workloads) R) [][]R {
	results := make([][]R, len(cells))
	for i := range results {
		results[i] = make([]R, len(seeds))
	}
	ws := &workloads{m: map[string]*workload{}}
	type job struct{ cell, seed int }
	jobs := make(chan job)
	var wg sync.WaitGroup
	for range runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			for j := range jobs {
				results[j.cell][j.seed] = sim(cells[j.cell], seeds[j.seed], ws)
			}
		})
	}
	for i := range cells {
		for s := range seeds {
			jobs <- job{i, s}
		}
	}
	close(jobs)
	wg.Wait()
	return results
}

// workloads generates each workload once per workload, load, seed and
// duration, for every cell that runs it.
type workloads struct {
	mu sync.Mutex
	m  map[string]*workload
}

func (ws *workloads) of(p simParams) *workload {
	key := fmt.Sprint(p.Workload.name, p.Load, p.Seed, p.Duration)
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if w, ok := ws.m[key]; ok {
		return w
	}
	w := newWorkload(p)
	ws.m[key] = w
	return w
}

// table lists the cells of workloads × caches × loads × replicas × policies.
func table(workloads []simWorkload, caches []int, loads []float64, replicas []int, policies []simPolicy) []simCell {
	var cells []simCell
	for _, w := range workloads {
		for _, c := range caches {
			for _, l := range loads {
				for _, n := range replicas {
					for _, p := range policies {
						cells = append(cells, simCell{w, c, l, n, p})
					}
				}
			}
		}
	}
	return cells
}

// A target of docs/scheduling.md that a row of prefix affinity's misses.
type miss struct {
	cell   simCell
	target string // bestBaseline, aboveRoundRobin, likeLeastLoad or tailAtLoad
	detail string
}

const (
	bestBaseline      = "best baseline"             // hit rate at least the best baseline's at one replica, minus 2 points
	aboveRoundRobin   = "above round robin"         // where prefixes are shared: 10 points above round robin's hit rate
	likeLeastLoad     = "like least load"           // where nothing is shared: within 1 point and 5 % of least load
	tailAtLoad        = "p99 at 1.5x"               // at 1.5x load: p99 TTFT within 5 % of least load's
	unreachable       = " (unreachable)"            // appended when the ceiling is under round robin's + 10 points
	notBelowEstimates = "not below prefix-affinity" // with events: a hit rate at least prefix-affinity's without them
)

func (m miss) String() string { return fmt.Sprintf("%s: %s: %s", m.cell, m.target, m.detail) }

// missedTargets checks prefix affinity's rows against the targets and
// returns the misses:
//   - bestBaseline: its hit rate is at least the best baseline's at one
//     replica, on the same workload, cache and load, minus 2 points;
//   - aboveRoundRobin: where prefixes are shared (a-d), at least 10 points
//     above round robin's at the same replica count; marked unreachable
//     where round robin is within 10 points of the ceiling;
//   - likeLeastLoad: where nothing is shared (e), within 1 point of least
//     load's hit rate and 5 % of its mean and p99 TTFT;
//   - tailAtLoad: at 1.5× load, its p99 TTFT within 5 % of least load's or
//     better;
//   - notBelowEstimates: with the engines' KV events, a hit rate at least
//     prefix-affinity's without them, at the same replica count.
//
// The baselines it compares with must be among rows.
func missedTargets(rows []simRow) []miss {
	type at struct {
		workload string
		cache    int
		load     float64
		replicas int
		policy   string
	}
	index := map[at]simRow{}
	for _, r := range rows {
		index[at{r.workload.name, r.cache, r.load, r.replicas, r.policy.name}] = r
	}
	var missed []miss
	for _, r := range rows {
		if !ours(r.policy) {
			continue
		}
		base := func(policy string, replicas int) (simRow, bool) {
			b, ok := index[at{r.workload.name, r.cache, r.load, replicas, policy}]
			return b, ok
		}
		add := func(target, format string, args ...any) {
			missed = append(missed, miss{r.simCell, target, fmt.Sprintf(format, args...)})
		}
		var best simRow
		for _, p := range simPolicies {
			if b, ok := base(p.name, 1); ok && !ours(p) && b.HitRate > best.HitRate {
				best = b
			}
		}
		if best.policy.name != "" && r.HitRate < best.HitRate-0.02 {
			add(bestBaseline, "hit rate %.1f%%, %s's at one replica %.1f%%", 100*r.HitRate, best.policy.name, 100*best.HitRate)
		}
		rr, okRR := base(config.PolicyRoundRobin, r.replicas)
		ll, okLL := base(config.PolicyLeastLoad, r.replicas)
		switch {
		case r.workload.name == random.name && okLL:
			if r.HitRate < ll.HitRate-0.01 || r.MeanTTFT > ll.MeanTTFT*105/100 || r.P99TTFT > ll.P99TTFT*105/100 {
				add(likeLeastLoad, "TTFT mean %.0f ms, p99 %.0f ms; least load's %.0f ms, %.0f ms", ms(r.MeanTTFT), ms(r.P99TTFT), ms(ll.MeanTTFT), ms(ll.P99TTFT))
			}
		case r.workload.name != random.name && okRR && r.HitRate < rr.HitRate+0.10:
			target := aboveRoundRobin
			if r.Ceiling < rr.HitRate+0.10 {
				target += unreachable
			}
			add(target, "hit rate %.1f%%, round robin's %.1f%%, ceiling %.1f%%", 100*r.HitRate, 100*rr.HitRate, 100*r.Ceiling)
		}
		if r.load == 1.5 && okLL && r.P99TTFT > ll.P99TTFT*105/100 {
			add(tailAtLoad, "p99 TTFT %.0f ms, least load's %.0f ms", ms(r.P99TTFT), ms(ll.P99TTFT))
		}
		if pa, ok := base(config.PolicyPrefixAffinity, r.replicas); ok && r.policy.events && r.HitRate < pa.HitRate {
			add(notBelowEstimates, "hit rate %.1f%%, prefix-affinity's %.1f%%", 100*r.HitRate, 100*pa.HitRate)
		}
	}
	return missed
}

// markdown renders rows as docs/scheduling.md's tables: one per workload and
// cache, a line per policy and load, the replica counts side by side, and
// for prefix affinity the targets its line misses.
func markdown(rows []simRow) string {
	type line struct {
		workload string
		cache    int
		policy   string
		load     float64
	}
	type group struct {
		workload string
		cache    int
	}
	var order []line
	cells := map[line][]simRow{}
	for _, r := range rows {
		l := line{r.workload.name, r.cache, r.policy.name, r.load}
		if cells[l] == nil {
			order = append(order, l)
		}
		cells[l] = append(cells[l], r)
	}
	missed := map[line][]string{}        // targets, in order
	at := map[line]map[string][]string{} // target → replica counts
	for _, m := range missedTargets(rows) {
		l := line{m.cell.workload.name, m.cell.cache, m.cell.policy.name, m.cell.load}
		if at[l] == nil {
			at[l] = map[string][]string{}
		}
		if at[l][m.target] == nil {
			missed[l] = append(missed[l], m.target)
		}
		at[l][m.target] = append(at[l][m.target], fmt.Sprint(m.cell.replicas))
	}
	var b strings.Builder
	var last group
	for _, l := range order {
		rs := cells[l]
		if g := (group{l.workload, l.cache}); g != last {
			last = g
			fmt.Fprintf(&b, "\n**(%s), cache %s characters** (ceiling %.1f%%)\n\n", l.workload, thousands(l.cache), 100*rs[0].Ceiling)
			b.WriteString("| policy | load | hit rate, replicas 1 / 2 / 4 / 8 | mean TTFT, ms | p99 TTFT, ms | failed | targets missed |\n|---|---|---|---|---|---|---|\n")
		}
		col := func(f func(simRow) string) string {
			out := make([]string, len(rs))
			for i, r := range rs {
				out[i] = f(r)
			}
			return strings.Join(out, " / ")
		}
		targets := ""
		if strings.HasPrefix(l.policy, config.PolicyPrefixAffinity) {
			targets = "none"
			if m := missed[l]; m != nil {
				for i, target := range m {
					m[i] = target + " at " + strings.Join(at[l][target], ", ")
				}
				targets = strings.Join(m, "; ")
			}
		}
		name := l.policy
		if strings.HasPrefix(name, config.PolicyPrefixAffinity) {
			name = "**" + name + "**"
		}
		fmt.Fprintf(&b, "| %s | %.1f× | %s | %s | %s | %s | %s |\n", name, l.load,
			col(func(r simRow) string { return fmt.Sprintf("%.1f", 100*r.HitRate) }),
			col(func(r simRow) string { return fmt.Sprintf("%.0f", ms(r.MeanTTFT)) }),
			col(func(r simRow) string { return fmt.Sprintf("%.0f", ms(r.P99TTFT)) }),
			col(func(r simRow) string { return fmt.Sprintf("%.0f", r.Failed) }),
			targets)
	}
	return b.String()
}

func thousands(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// BenchmarkPolicies is the tables of docs/scheduling.md. Run it with
//
//	go test -run '^$' -bench Policies -benchtime 1x -v -timeout 1h ./pkg/scheduling/
//
// (-v, or go test cuts the tables' log to ten lines).
//
// Every row is simulated for each seed first, on all CPUs; each sub-benchmark
// then reports its row, and the last, "tables", logs the tables as
// docs/scheduling.md has them and the targets missed.
func BenchmarkPolicies(b *testing.B) {
	cells := table(simWorkloads, []int{largeCache, smallCache}, []float64{1, 1.5}, []int{1, 2, 4, 8}, simPolicies)
	rows := runTable(cells, 10*time.Minute, simSeeds)
	for _, r := range rows {
		b.Run(r.simCell.String(), func(b *testing.B) {
			b.ReportMetric(100*r.HitRate, "hit%")
			b.ReportMetric(ms(r.MeanTTFT), "mean-ttft-ms")
			b.ReportMetric(ms(r.P99TTFT), "p99-ttft-ms")
			b.ReportMetric(r.Failed, "failed")
			b.ReportMetric(r.Moves, "moves")
			b.ReportMetric(100*r.Ceiling, "ceiling%")
			b.ReportMetric(100*r.Offered, "offered%")
		})
	}
	b.Run("tables", func(b *testing.B) {
		b.Log(markdown(rows))
		for _, m := range missedTargets(rows) {
			b.Log("missed: ", m)
		}
	})
}

// The targets, on a short run that make test affords: three simulated
// minutes of (a), (c) and (e) on the small cache, at 1 and 4 replicas, one
// seed. It fails on any target missed but those knownMisses names, which
// docs/scheduling.md explains; a known miss that is met is logged, so that
// the list can shrink.
func TestSimulatedTargets(t *testing.T) {
	if testing.Short() || raceDetector {
		t.Skip("simulation: make test runs it without -race")
	}
	// Without sessions pinned: that row tells how requests reach the replicas, not what the
	// policy does, and only the tables (BenchmarkPolicies) show it.
	policies := slices.DeleteFunc(slices.Clone(simPolicies), func(p simPolicy) bool { return p.pinned })
	rows := runTable(table([]simWorkload{oneShot, mixed, random}, []int{smallCache}, []float64{1, 1.5}, []int{1, 4}, policies),
		3*time.Minute, simSeeds[:1])
	for _, r := range rows {
		t.Log(r)
	}
	missed := map[string]bool{}
	for _, m := range missedTargets(rows) {
		key := fmt.Sprintf("%s/%.1fx/%d/%s", m.cell.workload.name, m.cell.load, m.cell.replicas, m.target)
		missed[key] = true
		if !knownMisses[key] {
			t.Errorf("target missed: %v", m)
		}
	}
	for key := range knownMisses {
		if !missed[key] {
			t.Logf("known miss %s is met on this run", key)
		}
	}
}

// knownMisses are the targets the short run misses, by workload, load,
// replicas and target (docs/scheduling.md, "Where it loses"):
//   - (c) on the small cache at four replicas: its conversations lose their
//     cached history when a load spill moves a turn that no other replica
//     remembers;
//   - (e) at one replica: one seed's p99 over three minutes, 6.5 % above
//     least load's where the picks differ only from a client's retries on
//     (the ten-minute means over three seeds meet it).
//   - with events, on (a) at 1.5× load and four replicas: one seed of three
//     minutes puts prefix-affinity up to 0.1 points above, as first
//     requests go to a system prompt's holders only where no busier than
//     the mean while their engines write their caches over within a minute
//     and a half (the ten-minute means over three seeds are 0.2
//     points above prefix-affinity's).
var knownMisses = map[string]bool{
	"a one-shot/1.5x/4/" + notBelowEstimates: true,
	"c mixed/1.0x/4/" + bestBaseline:         true,
	"c mixed/1.5x/4/" + bestBaseline:         true,
	"e random/1.0x/1/" + likeLeastLoad:       true,
}

// namespacePolicies are what the namespaces table compares on workload (f):
// the baselines, prefix affinity blind to the requests' namespaces (model
// and cache_salt: as it was before it ranked by them), and prefix affinity.
var namespacePolicies = []simPolicy{
	configured(config.PolicyRoundRobin), configured(config.PolicyLeastLoad), memoryPolicy, llmdModel,
	{name: "prefix-affinity, blind", config: config.PolicyPrefixAffinity, blind: true},
	configured(config.PolicyPrefixAffinity), eventsPolicy,
}

// BenchmarkNamespaces is docs/scheduling.md's namespaces table: workload
// (f), one system prompt under many tenants' cache_salts, on both caches,
// at nominal and 1.5x load, 1 and 4 replicas. Run it as BenchmarkPolicies
// (-benchtime 1x -v); it takes some three minutes on 2 vCPUs.
func BenchmarkNamespaces(b *testing.B) {
	rows := runTable(table([]simWorkload{salted}, []int{largeCache, smallCache}, []float64{1, 1.5}, []int{1, 4}, namespacePolicies),
		10*time.Minute, simSeeds)
	for _, r := range rows {
		b.Log(r)
	}
}

// agentPolicies are what the agents table compares on workload (g).
var agentPolicies = []simPolicy{
	configured(config.PolicyLeastLoad), memoryPolicy, llmdModel,
	configured(config.PolicyPrefixAffinity), pinnedPolicy, eventsPolicy,
}

// BenchmarkAgents is docs/scheduling.md's agents table: workload (g),
// conversations under preambles longer than the key, on both caches, at
// nominal and 1.5x load, 1 and 4 replicas. Run it as BenchmarkPolicies
// (-benchtime 1x -v).
func BenchmarkAgents(b *testing.B) {
	rows := runTable(table([]simWorkload{agents}, []int{largeCache, smallCache}, []float64{1, 1.5}, []int{1, 4}, agentPolicies),
		10*time.Minute, simSeeds)
	for _, r := range rows {
		b.Log(r)
	}
}

// BenchmarkNamedSessions is docs/scheduling.md's named-sessions table: multi-turn
// chat (b) and mixed traffic (c) on the small cache, where half or nine in
// ten of the conversations name their session (pinned to a replica) and the
// rest go in turn, beside all and none. Run it as BenchmarkPolicies.
func BenchmarkNamedSessions(b *testing.B) {
	half := simPolicy{name: "sessions pinned, half named", config: config.PolicyPrefixAffinity, pinned: true, pinShare: 0.5}
	most := simPolicy{name: "sessions pinned, 9 in 10 named", config: config.PolicyPrefixAffinity, pinned: true, pinShare: 0.9}
	rows := runTable(table([]simWorkload{multiTurn, mixed}, []int{smallCache}, []float64{1, 1.5}, []int{2, 4, 8},
		[]simPolicy{configured(config.PolicyPrefixAffinity), half, most, pinnedPolicy}), 10*time.Minute, simSeeds)
	for _, r := range rows {
		b.Log(r)
	}
}

// BenchmarkClientAddresses is docs/scheduling.md's client-addresses table:
// multi-turn chat (b) and mixed traffic (c) on the small cache, where every
// conversation, or half of them, keeps one client address (64 clients),
// which the shipped Envoy configs hash to a replica, and the rest leave from
// an application's 16 pods in turn; each counted per address, or with one
// count for all, as before; and the memory policy and llm-d's model behind
// the same Envoy. Run it as BenchmarkPolicies.
func BenchmarkClientAddresses(b *testing.B) {
	byAddress := func(p simPolicy, name string, share float64, oneCount bool) simPolicy {
		p.name, p.pinned, p.pinShare, p.byAddress, p.oneCount = name, true, share, true, oneCount
		return p
	}
	ours := configured(config.PolicyPrefixAffinity)
	rows := runTable(table([]simWorkload{multiTurn, mixed}, []int{smallCache}, []float64{1, 1.5}, []int{2, 4, 8},
		[]simPolicy{byAddress(ours, "half by address, one count", 0.5, true), byAddress(ours, "half by address", 0.5, false),
			byAddress(ours, "all by address, one count", 0, true), byAddress(ours, "all by address", 0, false),
			byAddress(memoryPolicy, "prefix-memory, half by address", 0.5, false), byAddress(memoryPolicy, "prefix-memory, all by address", 0, false),
			byAddress(llmdModel, "llm-d approx, half by address", 0.5, false), byAddress(llmdModel, "llm-d approx, all by address", 0, false)}),
		10*time.Minute, simSeeds)
	for _, r := range rows {
		b.Log(r)
	}
}

// TestSimulatedNamespaces: on a short run of workload (f), small cache, at
// 1 and 4 replicas, prefix affinity that ranks requests by their namespace,
// with or without events, caches 10 points more than the same policy blind
// to it, and no less than the best baseline minus 2 points (the tables'
// target).
func TestSimulatedNamespaces(t *testing.T) {
	if testing.Short() || raceDetector {
		t.Skip("simulation: make test runs it without -race")
	}
	rows := runTable(table([]simWorkload{salted}, []int{smallCache}, []float64{1}, []int{1, 4}, namespacePolicies), 3*time.Minute, simSeeds[:1])
	var ourRows []simRow
	blind, best := map[int]simRow{}, map[int]simRow{} // by replicas
	for _, r := range rows {
		t.Log(r)
		switch {
		case r.policy.blind:
			blind[r.replicas] = r
		case ours(r.policy):
			ourRows = append(ourRows, r)
		case r.HitRate > best[r.replicas].HitRate:
			best[r.replicas] = r
		}
	}
	if len(ourRows) != 4 || len(blind) != 2 || len(best) != 2 {
		t.Fatalf("rows of prefix-affinity %d, blind %d, baselines %d; want 4, 2, 2", len(ourRows), len(blind), len(best))
	}
	for _, r := range ourRows {
		if b := blind[r.replicas]; r.HitRate < b.HitRate+0.1 {
			t.Errorf("%v: hit rate %.1f %%, blind %.1f %%", r.simCell, 100*r.HitRate, 100*b.HitRate)
		}
		if b := best[r.replicas]; r.HitRate < b.HitRate-0.02 {
			t.Errorf("%v: hit rate %.1f %%, %s's %.1f %%", r.simCell, 100*r.HitRate, b.policy.name, 100*b.HitRate)
		}
	}
}
