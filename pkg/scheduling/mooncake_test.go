package scheduling

import (
	"context"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// twoRanks is a bootstrap server's /query of an engine with two
// data-parallel ranks, as vLLM's MooncakeBootstrapServer answers it.
const twoRanks = `{"0":{"engine_id":"e-dp0","worker_addr":{"0":{"0":"tcp://10.0.0.1:17000"}}},` +
	`"1":{"engine_id":"e-dp1","worker_addr":{"0":{"0":"tcp://10.0.0.1:17001"}}}}`

func TestFetchEngineIDs(t *testing.T) {
	tests := []struct {
		name, answer string
		want         map[string]string
		err          string
	}{
		{name: "two ranks", answer: twoRanks, want: map[string]string{"0": "e-dp0", "1": "e-dp1"}},
		{name: "not ready (workers still registering)", answer: "500", err: "answered 500"},
		{name: "a rank without its engine id", answer: `{"0":{"worker_addr":{}}}`, err: `rank "0" names no engine_id`},
		{name: "a rank that is no number", answer: `{"dp0":{"engine_id":"e"}}`, err: `rank "dp0" names no engine_id`},
		{name: "no rank", answer: `{}`, err: "lists no rank"},
		{name: "not JSON", answer: `<html>`, err: "invalid character"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := newSGLangEngine(t, "/query", tc.answer)
			info := fetchEngineIDs(context.Background(), probe{client: http.DefaultClient}, srv.addr, time.Second)
			if !maps.Equal(info.engineIDs, tc.want) || !strings.Contains(info.err, tc.err) || (tc.err == "") != (info.err == "") {
				t.Errorf("read %v, error %q; want %v, error %q", info.engineIDs, info.err, tc.want, tc.err)
			}
		})
	}
}

// Of a kv-mooncake prefill pool, only the engines whose bootstrap server
// told their engine ids take P/D requests, and the pool is ready only with one; each request names one rank,
// and the engine id is that rank's.
func TestMooncakeEndpointsWithoutEngineIDsWait(t *testing.T) {
	tests := []struct {
		name  string
		known []bool
		want  []string // nil: no endpoint
	}{
		{"none known: none", []bool{false, false}, nil},
		{"one known: only it", []bool{false, true}, []string{"10.0.0.2:8000"}},
		{"both", []bool{true, true}, []string{"10.0.0.1:8000", "10.0.0.2:8000"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := testPoolNamed(t, "prefill", policy(config.PolicyRoundRobin), "10.0.0.1:8000", "10.0.0.2:8000")
			p.probe.rendezvous = kv.MooncakeEngineIDs
			for i, e := range p.Endpoints() {
				if tc.known[i] {
					info := engineInfo(map[string]string{"0": "e" + strconv.Itoa(i)})
					e.info.Store(&info)
				} else {
					e.info.Store(&serverInfo{err: "connection refused"})
				}
			}
			if ready := p.Ready(); ready != (tc.want != nil) {
				t.Errorf("Ready() = %v, want %v: the decider goes decode-only (no_prefill) while none is pairable", ready, tc.want != nil)
			}
			var picked []string
			for range 4 {
				e, err := p.Select(nil)
				if err != nil {
					if tc.want != nil {
						t.Fatal(err)
					}
					return
				}
				if !slices.Contains(picked, e.Addr) {
					picked = append(picked, e.Addr)
				}
			}
			slices.Sort(picked)
			if !slices.Equal(picked, tc.want) {
				t.Errorf("picked %v, want %v", picked, tc.want)
			}
		})
	}

	e := &Endpoint{Addr: "10.0.0.1:8000"}
	info := engineInfo(map[string]string{"0": "e-dp0", "1": "e-dp1"})
	e.info.Store(&info)
	for seed, want := range []string{"0", "1", "0"} {
		if rank, id, ranks := e.EngineID(uint64(seed)); ranks != 2 || rank != want || id != "e-dp"+want {
			t.Errorf("EngineID(%d) = %s %s of %d, want rank %s and its id, of 2", seed, rank, id, ranks, want)
		}
	}
}

// A kv-mooncake prefill pool reads its engines' ids from their bootstrap
// servers, on the pool's bootstrap port of each engine's host, as it
// starts; the decode pool reads nothing.
func TestMooncakePrefillPoolReadsEngineIDs(t *testing.T) {
	bootstrap := newSGLangEngine(t, "/query", twoRanks)
	_, port, _ := net.SplitHostPort(bootstrap.addr)
	poolPort, _ := strconv.Atoi(port)
	ps := NewPools(Spec{
		Prefill:       PoolSpec{Endpoints: []string{"127.0.0.1:9"}},
		Decode:        PoolSpec{Endpoints: []string{bootstrap.addr}},
		Rendezvous:    kv.MooncakeEngineIDs,
		BootstrapPort: poolPort,
	}, Deps{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { ps.Run(ctx); close(done) }()
	e := ps.Prefill.Endpoints()[0]
	waitFor(t, "the engine ids", func() bool { return e.Ranks() > 0 })
	cancel()
	<-done
	if _, id, _ := e.EngineID(1); id != "e-dp1" || e.Ranks() != 2 {
		t.Errorf("rank 1's id %q of %d ranks, want e-dp1 of 2", id, e.Ranks())
	}
	if n := bootstrap.asked.Load(); n != 1 {
		t.Errorf("the bootstrap server was asked %d times, want once (by the prefill pool)", n)
	}
}

// A failed read keeps the engine ids read before, unless the endpoint was
// ejected since: a restarted engine has ids of its own, and until they are
// read it takes no P/D request.
func TestMooncakeEngineIDsAfterARestart(t *testing.T) {
	bootstrap := newSGLangEngine(t, "/query", `{"0":{"engine_id":"before"}}`)
	_, port, _ := net.SplitHostPort(bootstrap.addr)
	n, _ := strconv.Atoi(port)
	p, clock := testPoolNamed(t, "prefill", policy(config.PolicyRoundRobin))
	p.probe.rendezvous = kv.MooncakeEngineIDs
	p.SetDiscovered([]Discovered{{Addr: "127.0.0.1:9", BootstrapPort: n}})
	e := p.Endpoints()[0]
	steps := []struct {
		name, answer string
		eject        bool
		want         string // rank 0's id; "" for none
	}{
		{"read", `{"0":{"engine_id":"before"}}`, false, "before"},
		{"a failed read keeps them", "500", false, "before"},
		{"a failed read after an ejection does not", "500", true, ""},
		{"the restarted engine's", `{"0":{"engine_id":"after"}}`, false, "after"},
	}
	for _, s := range steps {
		bootstrap.set("/query", s.answer)
		if s.eject {
			e.ejections.Add(1)
		}
		clock.Advance(serverInfoRefresh)
		st := p.state.Load()
		p.readServerInfo(context.Background(), st, st.endpoints)
		if _, id, _ := e.EngineID(0); id != s.want {
			t.Errorf("%s: engine id %q, want %q", s.name, id, s.want)
		}
	}
}
