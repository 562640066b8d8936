package scheduling

import (
	"encoding/json"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeClock is a settable clock for ejections and staleness.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// testPool builds a pool over addrs with a fake clock. Picks are
// deterministic: intn is always 0, so two-choices compares the first two
// candidates.
func testPool(t testing.TB, s config.PoolScheduling, addrs ...string) (*Pool, *fakeClock) {
	t.Helper()
	return testPoolNamed(t, "decode", s, addrs...)
}

// testPoolNamed is testPool for the pool of that name, prefill or decode.
func testPoolNamed(t testing.TB, name string, s config.PoolScheduling, addrs ...string) (*Pool, *fakeClock) {
	t.Helper()
	clock := newFakeClock()
	spec := PoolSpec{Endpoints: addrs, PoolScheduling: s}
	return poolOf(map[string]role{"prefill": rolePrefill, "decode": roleDecode}[name], spec, Deps{Now: clock.Now, intn: func(int) int { return 0 }}), clock
}

// promptRequest is a completions request for prompt, read as the pipeline
// reads a client's body.
func promptRequest(prompt string) *Request {
	b, _ := json.Marshal(map[string]string{"model": "m", "prompt": prompt})
	obj, err := body.Parse(b)
	if err != nil {
		panic(err)
	}
	return NewRequest(completions(obj))
}

// completions reads obj as a completions request.
func completions(obj *body.Object) *api.Prompt { return api.Completions.Prompt(obj) }

func policy(name string) config.PoolScheduling { return config.PoolScheduling{Policy: name} }

func addrsOf(eps []*Endpoint) []string {
	out := make([]string, len(eps))
	for i, e := range eps {
		out[i] = e.Addr
	}
	return out
}

func byAddr(p *Pool, addr string) *Endpoint {
	for _, e := range p.Endpoints() {
		if e.Addr == addr {
			return e
		}
	}
	return nil
}

// eject fails each of addrs as many times in a row as eject it by default.
func eject(p *Pool, addrs ...string) {
	for _, a := range addrs {
		for range config.DefaultConsecutiveFailures {
			byAddr(p, a).ReportFailure()
		}
	}
}

// checkDown marks addrs down, as a failed active health check does.
func checkDown(p *Pool, addrs ...string) {
	for _, a := range addrs {
		byAddr(p, a).setActive(refused)
	}
}

// acquire takes a slot of e, as a request the pipeline sends there does
// (Pool.Claim); the returned func releases it.
func acquire(e *Endpoint) (release func()) { return e.Claim().Release }

// poolOf is a pool of role r whose checks and scrapes go by deps' client
// over plain HTTP, as NewPools makes one without TLS.
func poolOf(r role, spec PoolSpec, deps Deps) *Pool {
	return newPool(deps.withDefaults().probe(r, nil, nil, true), spec, deps)
}

// setActive records a check's verdict as a check begun whenever would.
func (e *Endpoint) setActive(v verdict) { e.recordCheck(v, anyEpoch) }

// holdAt is a hold of pool's requests at the saturation lines lines, for
// up to hold, that sheds objective batch.
func holdAt(pool *Pool, lines Lines, hold time.Duration) *Hold {
	h := NewHold(pool)
	h.Set(lines, hold, map[string]int{"batch": -1})
	return h
}
