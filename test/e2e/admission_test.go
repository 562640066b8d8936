package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

// Requests naming an objective of negative priority (admission.objectives,
// the Inference Extension's x-gateway-inference-objective, or llm-d's
// x-llm-d-inference-objective) are refused, with admission.hold 0s at once, with
// 429 and Retry-After while every decode engine reports itself saturated,
// or, for P/D, every prefill engine; the others are served all along, and
// the shed objective is served again as soon as one engine has room.
// scraped is a pool's config that reads its engines' figures often and
// never lets them go stale: what the admission tests set, the rig sees.
const scraped = "metrics: {interval: 50ms, stale_after: 1h}"

// full is a queue at the saturation line (5) for either role: SGLang's P/D
// queues count as its role's waiting queue.
var full = pdsim.Queues{PrefillBootstrap: 5, DecodePrealloc: 5}

// setQueues gives sims, engines of pool, the queues q, and waits until the
// rig's extproc has scraped them.
func setQueues(t *testing.T, r *rig, pool string, sims []*pdsim.Server, q pdsim.Queues) {
	t.Helper()
	for _, s := range sims {
		s.SetQueues(q)
		series := fmt.Sprintf(`pd_extproc_endpoint_engine_waiting{endpoint=%q,pool=%q}`, s.Addr(), pool)
		want := float64(q.PrefillBootstrap)
		if pool == "decode" {
			want = float64(q.DecodePrealloc)
		}
		waitFor(t, 10*time.Second, series, func() bool { return r.metric(t, series) == want })
	}
}

func TestSheddableRequestsAreRefusedWhileThePoolsAreSaturated(t *testing.T) {
	r := startRig(t, rigOptions{connector: "kv-sglang", prefillPool: scraped, decodePool: scraped,
		extra: "admission: {objectives: {batch: -1, chat: 10}, hold: 0s}"})
	set := func(pool string, sims []*pdsim.Server, q pdsim.Queues) { setQueues(t, r, pool, sims, q) }
	steps := []struct {
		name       string
		state      func()
		objectives map[string]int // objective -> status; "llm-d:" sends it under llm-d's header
		refusedBy  string         // the pool the 429 names
	}{
		{"idle", func() {}, map[string]int{"batch": 200, "chat": 200, "": 200}, ""},
		{"every decode engine saturated", func() { set("decode", r.decode, full) },
			map[string]int{"batch": 429, "chat": 200, "": 200, "unknown": 200, "llm-d:batch": 429}, "decode"},
		{"one decode engine with room", func() { set("decode", r.decode[:1], pdsim.Queues{}) }, map[string]int{"batch": 200}, ""},
		{"every prefill engine saturated", func() { set("decode", r.decode, pdsim.Queues{}); set("prefill", r.prefill, full) },
			map[string]int{"batch": 429, "chat": 200}, "prefill"},
	}
	shed := 0
	for _, st := range steps {
		st.state()
		for objective, want := range st.objectives {
			header := http.Header{}
			if name, ok := strings.CutPrefix(objective, "llm-d:"); ok {
				header.Set("x-llm-d-inference-objective", name)
			} else if objective != "" {
				header.Set("x-gateway-inference-objective", objective)
			}
			path, body := request("chat", false, st.name+" "+objective)
			resp, got := r.must(t, path, body, header)
			if resp.StatusCode != want {
				t.Fatalf("%s, objective %q: status %d, want %d: %.300s", st.name, objective, resp.StatusCode, want, got)
			}
			if want != http.StatusTooManyRequests {
				continue
			}
			shed++
			if resp.Header.Get("Retry-After") != "30" || !strings.Contains(got, `"type":"rate_limit_exceeded"`) ||
				!strings.Contains(got, "the "+st.refusedBy+" engines are saturated") {
				t.Errorf("%s: Retry-After %q, body %s; want admission.retry_after (30 s) and an OpenAI error naming the %s engines",
					st.name, resp.Header.Get("Retry-After"), got, st.refusedBy)
			}
		}
	}
	if got := r.metric(t, `pd_extproc_limit_refusals_total{limit="saturated"}`); got != float64(shed) {
		t.Errorf("pd_extproc_limit_refusals_total{limit=\"saturated\"} %g, want %d", got, shed)
	}

	// A reload that gives batch a priority of 0 applies at once: it is served, the prefill
	// engines still saturated.
	config := strings.Replace(r.config, "batch: -1", "batch: 0", 1)
	if err := os.WriteFile(r.extproc.ConfigPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	r.extproc.waitLog(t, `"config reloaded"`)
	header := http.Header{"X-Gateway-Inference-Objective": {"batch"}}
	path, body := request("chat", false, "reloaded batch")
	if resp, got := r.must(t, path, body, header); resp.StatusCode != http.StatusOK {
		t.Errorf("batch after the reload: status %d, want 200: %.300s", resp.StatusCode, got)
	}
}

// With the default admission.hold, a request that may be shed and meets
// every decode engine saturated waits in pd-extproc rather than being
// refused: pd_extproc_held_requests counts it, and it is served once an
// engine reports room. With admission.max_held requests held, the next is
// refused at once; one whose hold runs out (a reload shortens it) with the
// engines still saturated is refused as without a hold.
func TestRequestsThatMayBeShedWaitForRoom(t *testing.T) {
	r := startRig(t, rigOptions{connector: "kv-sglang", prefillPool: scraped, decodePool: scraped,
		extra: "admission: {objectives: {batch: -1}, max_held: 1}"})
	setQueues(t, r, "decode", r.decode, full)
	batch := http.Header{"X-Gateway-Inference-Objective": {"batch"}}
	type answer struct {
		status int
		body   string
		err    error
		took   time.Duration
	}
	answered := make(chan answer, 1)
	go func() { // r.send, not r.must: t.Fatal belongs to the test's goroutine
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		path, body := request("chat", false, "held batch")
		start := time.Now()
		resp, got, err := r.send(ctx, path, body, batch)
		if err != nil {
			answered <- answer{err: err}
			return
		}
		answered <- answer{resp.StatusCode, got, nil, time.Since(start)}
	}()
	held := `pd_extproc_held_requests{pool="decode"}`
	waitFor(t, 10*time.Second, held+" 1", func() bool { return r.metric(t, held) == 1 })
	path, body := request("chat", false, "one more held batch")
	if resp, got := r.must(t, path, body, batch); resp.StatusCode != http.StatusTooManyRequests {
		t.Errorf("past admission.max_held: status %d, want 429: %.300s", resp.StatusCode, got)
	}
	select {
	case a := <-answered:
		t.Fatalf("answered while held: status %d, %v: %.300s", a.status, a.err, a.body)
	default:
	}
	setQueues(t, r, "decode", r.decode[:1], pdsim.Queues{})
	a := <-answered
	if a.err != nil || a.status != http.StatusOK {
		t.Fatalf("released: status %d, %v, want 200: %.300s", a.status, a.err, a.body)
	}
	// The time held is the engines' lack of room, not pd-extproc's work: the
	// histogram of what the service adds leaves it out (its alert fires at 50 ms).
	if added := r.metric(t, `pd_extproc_request_processing_seconds_sum{mode="pd"}`); added*2 > a.took.Seconds() {
		t.Errorf("pd_extproc_request_processing_seconds counts %.3fs of a request answered in %v: the hold is counted as processing", added, a.took)
	}
	if n := r.metric(t, held); n != 0 {
		t.Errorf("%s %g after the release, want 0", held, n)
	}
	// Its time held is observed, as released; the one refused past max_held was never held.
	released := `pd_extproc_held_seconds_count{outcome="released",pool="decode"}`
	if n, sum := r.metric(t, released), r.metric(t, `pd_extproc_held_seconds_sum{outcome="released",pool="decode"}`); n != 1 || sum <= 0 || sum > a.took.Seconds() {
		t.Errorf("%s %g, its sum %.3fs, want 1 request held within the %v it took", released, n, sum, a.took)
	}

	config := strings.Replace(r.config, "max_held: 1", "max_held: 1, hold: 200ms", 1)
	if err := os.WriteFile(r.extproc.ConfigPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	// The hold counts toward envoy.override_message_timeout's default, which a
	// reload does not change: the log says so.
	r.extproc.waitLog(t, `"msg":"config reloaded, but these keys take effect only on restart`)
	setQueues(t, r, "decode", r.decode[:1], full)
	path, body = request("chat", false, "batch held too long")
	resp, got := r.must(t, path, body, batch)
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "30" {
		t.Errorf("hold run out: status %d, Retry-After %q, want 429 and 30: %.300s", resp.StatusCode, resp.Header.Get("Retry-After"), got)
	}
	if got := r.metric(t, `pd_extproc_limit_refusals_total{limit="saturated"}`); got != 2 {
		t.Errorf("pd_extproc_limit_refusals_total{limit=\"saturated\"} %g, want 2", got)
	}
	refused := `pd_extproc_held_seconds_count{outcome="refused",pool="decode"}`
	if n, sum := r.metric(t, refused), r.metric(t, `pd_extproc_held_seconds_sum{outcome="refused",pool="decode"}`); n != 1 || sum < 0.2 {
		t.Errorf("%s %g, its sum %.3fs, want 1 request held its 200ms", refused, n, sum)
	}
}
