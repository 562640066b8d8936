package scheduling

import (
	"context"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// A reload that changes a pool's kv_events starts its event view anew, but
// its counters go on from where they were: Prometheus counters never go back
// within one process.
func TestEventCountersOutliveAReload(t *testing.T) {
	s := policy(config.PolicyPrefixAffinity)
	s.KVEvents = config.KVEvents{ConnectPort: 1, StaleAfter: config.Duration(30 * time.Second)} // nothing publishes there
	p, _ := testPool(t, s, "127.0.0.1:8000")
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); p.followEvents(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	following := func(not *poolEvents) *poolEvents {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			if ev := p.events.Load(); ev != nil && ev != not {
				return ev
			}
			if time.Now().After(deadline) {
				t.Fatal("the pool follows no new events")
			}
			time.Sleep(time.Millisecond)
		}
	}
	first := following(nil)
	first.sub.Counts().Batches.Add(3)

	s.KVEvents.StaleAfter = config.Duration(45 * time.Second)
	p.Update(PoolSpec{Endpoints: []string{"127.0.0.1:8000"}, PoolScheduling: s})
	if got := following(first).sub.Counts().Batches.Load(); got != 3 {
		t.Errorf("batches after the reload = %d, want the 3 before it", got)
	}
}
