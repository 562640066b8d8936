package e2e

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// TestTheLoadArmFollowsTheEnginesQueues: with pd.load on, the decider reads
// the queues the engines report at /metrics. While both prefill engines
// report a queue at pd.load.prefill_queue, a new request goes decode-only
// (prefill_busy): no prefill engine sees it. Once their queues drop, requests
// go P/D again. A decode engine at pd.load.decode_queue takes no
// prefill_busy request, and vetoes the cache rule: a conversation's later
// turn that its decode engine holds goes P/D (decode_busy) while that engine
// is busy, and decode-only (cached_prefix) again once it is not.
func TestTheLoadArmFollowsTheEnginesQueues(t *testing.T) {
	const scrape = "metrics: {interval: 50ms, stale_after: 1h}"
	r := startRig(t, rigOptions{decodes: 1,
		prefillPool: scrape, decodePool: "policy: prefix-affinity, " + scrape,
		extra: "pd: {min_uncached_tokens: 100, load: {prefill_queue: 2, decode_queue: 2}}"})
	queues := func(prefill, decode int) { // what the engines report, once extproc has scraped it
		t.Helper()
		for _, p := range r.prefill {
			p.SetQueues(pdsim.Queues{Waiting: prefill})
		}
		r.decode[0].SetQueues(pdsim.Queues{Waiting: decode})
		waitFor(t, 20*time.Second, "a scrape of the engines' queues", func() bool {
			for _, p := range r.prefill {
				if r.metric(t, fmt.Sprintf(`pd_extproc_endpoint_engine_waiting{endpoint=%q,pool="prefill"}`, p.Addr())) != float64(prefill) {
					return false
				}
			}
			return r.metric(t, fmt.Sprintf(`pd_extproc_endpoint_engine_waiting{endpoint=%q,pool="decode"}`, r.decodeAddrs[0])) == float64(decode)
		})
	}
	oneShot := func(marker string) {
		t.Helper()
		path, body := request("chat", false, marker+" What is a prefill queue?")
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: status %d: %.300s", marker, resp.StatusCode, got)
		}
	}
	c := conversation{marker: "[a conversation under load]"}
	decided := map[string]float64{}
	for i, step := range []struct {
		prefillQ, decodeQ int
		turn              bool // the conversation's next turn, else a one-shot question
		prefillLegs       int  // the request's
		reason            string
	}{
		{prefillQ: 0, decodeQ: 0, prefillLegs: 1, reason: "long_prompt"},
		{prefillQ: 2, decodeQ: 0, prefillLegs: 0, reason: "prefill_busy"},
		{prefillQ: 5, decodeQ: 1, prefillLegs: 0, reason: "prefill_busy"},
		{prefillQ: 1, decodeQ: 0, prefillLegs: 1, reason: "long_prompt"},
		{prefillQ: 3, decodeQ: 2, prefillLegs: 1, reason: "long_prompt"},
		{prefillQ: 0, decodeQ: 0, turn: true, prefillLegs: 1, reason: "long_prompt"},
		{prefillQ: 0, decodeQ: 0, turn: true, prefillLegs: 0, reason: "cached_prefix"},
		{prefillQ: 0, decodeQ: 2, turn: true, prefillLegs: 1, reason: "decode_busy"},
		{prefillQ: 0, decodeQ: 1, turn: true, prefillLegs: 0, reason: "cached_prefix"},
	} {
		queues(step.prefillQ, step.decodeQ)
		marker := fmt.Sprintf("[request %d under load]", i)
		prefillsBefore := sum(legsOn(r.prefill, c.marker))
		if step.turn {
			marker = c.marker
			c.next(t, r)
		} else {
			oneShot(marker)
		}
		prefills := sum(legsOn(r.prefill, marker))
		if step.turn {
			prefills -= prefillsBefore
		}
		if prefills != step.prefillLegs {
			t.Errorf("step %d (prefill queues %d, decode queue %d): %d prefill legs, want %d", i, step.prefillQ, step.decodeQ, prefills, step.prefillLegs)
		}
		if !step.turn {
			if n := legsOn(r.decode, marker)[0]; n != 1 {
				t.Errorf("step %d: %d decode legs, want 1", i, n)
			}
		}
		decided[step.reason]++
		for _, reason := range []string{"long_prompt", "prefill_busy", "decode_busy", "cached_prefix"} {
			if got := max(r.metric(t, fmt.Sprintf(`pd_extproc_pd_decisions_total{reason=%q}`, reason)), 0); got != decided[reason] {
				t.Errorf("step %d (prefill queues %d, decode queue %d): pd_decisions_total{reason=%q} = %v, want %v",
					i, step.prefillQ, step.decodeQ, reason, got, decided[reason])
			}
		}
	}
}
