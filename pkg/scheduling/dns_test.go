package scheduling

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// fakeResolver answers from a table that tests change as they go.
type fakeResolver struct {
	mu      sync.Mutex
	answers map[string][]string
	err     error
	lookups chan string
}

func newFakeResolver() *fakeResolver {
	return &fakeResolver{answers: map[string][]string{}, lookups: make(chan string, 100)}
}

func (r *fakeResolver) LookupHost(_ context.Context, host string) ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case r.lookups <- host:
	default:
	}
	if r.err != nil {
		return nil, r.err
	}
	return slices.Clone(r.answers[host]), nil
}

func (r *fakeResolver) set(host string, ips []string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.answers[host], r.err = ips, err
}

func dnsPool(t *testing.T, r Resolver, static []string, name string) *Pool {
	t.Helper()
	spec := PoolSpec{Endpoints: static, PoolScheduling: config.PoolScheduling{DNS: name, DNSInterval: config.Duration(10 * time.Millisecond)}}
	return poolOf(roleDecode, spec, Deps{Resolver: r})
}

func TestResolve(t *testing.T) {
	r := newFakeResolver()
	p := dnsPool(t, r, []string{"10.0.0.9:8000"}, "decode.svc:8000")
	ctx := context.Background()

	r.set("decode.svc", []string{"fd00::2", "fd00::1"}, nil)
	p.resolve(ctx, "decode.svc:8000")
	if got, want := addrsOf(p.Endpoints()), []string{"10.0.0.9:8000", "[fd00::1]:8000", "[fd00::2]:8000"}; !slices.Equal(got, want) {
		t.Fatalf("endpoints of an IPv6-only name = %v, want %v", got, want)
	}
	// A dual-stack headless Service answers each pod's two addresses: one
	// engine each, by its IPv4 one (Envoy's V4_PREFERRED).
	r.set("decode.svc", []string{"10.0.0.2", "fd00::2", "10.0.0.1", "10.0.0.2", "fd00::1"}, nil)
	p.resolve(ctx, "decode.svc:8000")
	want := []string{"10.0.0.9:8000", "10.0.0.1:8000", "10.0.0.2:8000"}
	if got := addrsOf(p.Endpoints()); !slices.Equal(got, want) {
		t.Fatalf("endpoints = %v, want static then resolved, IPv4 preferred, sorted, deduplicated: %v", got, want)
	}

	kept := byAddr(p, "10.0.0.2:8000")
	release := acquire(kept)
	r.set("decode.svc", []string{"10.0.0.2", "10.0.0.3"}, nil)
	p.resolve(ctx, "decode.svc:8000")
	if got := addrsOf(p.Endpoints()); !slices.Equal(got, []string{"10.0.0.9:8000", "10.0.0.2:8000", "10.0.0.3:8000"}) {
		t.Fatalf("endpoints after re-resolution = %v", got)
	}
	if byAddr(p, "10.0.0.2:8000") != kept || kept.InFlight() != 1 {
		t.Fatal("an address that stayed in DNS lost its endpoint state")
	}
	release()

	r.set("decode.svc", nil, errors.New("SERVFAIL"))
	p.resolve(ctx, "decode.svc:8000")
	if got := len(p.Endpoints()); got != 3 {
		t.Fatalf("a failed lookup changed the pool to %d endpoints; want the last good set kept", got)
	}
	r.set("decode.svc", nil, nil)
	p.resolve(ctx, "decode.svc:8000")
	if got := len(p.Endpoints()); got != 3 {
		t.Fatalf("an empty answer changed the pool to %d endpoints; want the last good set kept", got)
	}

	p.Update(PoolSpec{Endpoints: []string{"10.0.0.9:8000"}, PoolScheduling: config.PoolScheduling{DNS: "other.svc:9000"}})
	if got := addrsOf(p.Endpoints()); !slices.Equal(got, []string{"10.0.0.9:8000", "10.0.0.2:8000", "10.0.0.3:8000"}) {
		t.Fatalf("a new DNS name emptied the pool before its first answer: %v", got)
	}
	r.set("other.svc", nil, errors.New("NXDOMAIN"))
	p.resolve(ctx, "other.svc:9000")
	if got := len(p.Endpoints()); got != 3 {
		t.Fatalf("a new DNS name that does not resolve changed the pool to %d endpoints; want the old name's kept", got)
	}
	if got := p.dnsNames(); !slices.Equal(got, []string{"other.svc:9000", "decode.svc:8000"}) {
		t.Fatalf("looking up %v while the new name has not answered, want it and the old one", got)
	}
	r.set("decode.svc", []string{"10.0.0.7"}, nil)
	p.resolve(ctx, "decode.svc:8000") // the old name's pods roll meanwhile
	if got := addrsOf(p.Endpoints()); !slices.Equal(got, []string{"10.0.0.9:8000", "10.0.0.7:8000"}) {
		t.Fatalf("the old name's new answer gave %v; want it followed until the new name answers", got)
	}
	r.set("other.svc", []string{"10.0.0.5"}, nil)
	p.resolve(ctx, "other.svc:9000")
	if got := addrsOf(p.Endpoints()); !slices.Equal(got, []string{"10.0.0.9:8000", "10.0.0.5:9000"}) {
		t.Fatalf("the new DNS name's first answer gave %v, want it in place of the old name's", got)
	}
	r.set("decode.svc", []string{"10.0.0.8"}, nil)
	p.resolve(ctx, "decode.svc:8000") // a lookup of the old name that finishes late
	if got := addrsOf(p.Endpoints()); !slices.Equal(got, []string{"10.0.0.9:8000", "10.0.0.5:9000"}) || len(p.dnsNames()) != 1 {
		t.Fatalf("a late answer for the old DNS name was applied (%v), or it is still looked up", got)
	}
}

// The answers are loopback, port 1 refused: Run asks each endpoint found
// for its models (10.0.0.1:8000 was asked, a host of the network).
func TestRunReResolves(t *testing.T) {
	r := newFakeResolver()
	r.set("decode.svc", []string{"127.0.0.1"}, nil)
	p := dnsPool(t, r, nil, "decode.svc:1")
	if len(p.Endpoints()) != 0 {
		t.Fatal("a DNS-only pool has endpoints before the first lookup")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("Run did not return after cancel")
		}
	}()

	waitFor(t, "the first lookup", func() bool { return slices.Equal(addrsOf(p.Endpoints()), []string{"127.0.0.1:1"}) })
	r.set("decode.svc", []string{"127.0.0.1", "127.0.0.2"}, nil)
	waitFor(t, "re-resolution", func() bool { return len(p.Endpoints()) == 2 })

	p.Update(PoolSpec{PoolScheduling: config.PoolScheduling{}}) // DNS off
	waitFor(t, "DNS turned off", func() bool { return len(p.Endpoints()) == 0 })
	time.Sleep(20 * time.Millisecond) // a lookup already under way may finish
	for len(r.lookups) > 0 {
		<-r.lookups
	}
	select {
	case h := <-r.lookups:
		t.Fatalf("looked up %s after DNS was turned off", h)
	case <-time.After(50 * time.Millisecond):
	}
}

// waitFor polls cond for up to five seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// A reload that gives a pool a DNS name keeps what served before until the
// name first answers, as Envoy warms a changed cluster: requests meanwhile
// are routed, not answered 503 for an empty pool. A reload that takes the
// name away applies the static list at once.
func TestReloadToDNSKeepsServingUntilTheNameAnswers(t *testing.T) {
	const name = "decode.svc:8000"
	static := func(addrs ...string) PoolSpec { return PoolSpec{Endpoints: addrs} }
	withDNS := func(addrs ...string) PoolSpec {
		return PoolSpec{Endpoints: addrs, PoolScheduling: config.PoolScheduling{DNS: name}}
	}
	for _, tc := range []struct {
		name           string
		from, to       PoolSpec
		before, answer []string // the endpoints until the name answers, and once it has
	}{
		{"static to dns", static("10.0.0.1:8000"), withDNS(),
			[]string{"10.0.0.1:8000"}, []string{"10.0.0.5:8000"}},
		{"static to static and dns", static("10.0.0.1:8000", "10.0.0.2:8000"), withDNS("10.0.0.2:8000"),
			[]string{"10.0.0.2:8000", "10.0.0.1:8000"}, []string{"10.0.0.2:8000", "10.0.0.5:8000"}},
		{"dns to static", withDNS(), static("10.0.0.1:8000"),
			[]string{"10.0.0.1:8000"}, []string{"10.0.0.1:8000"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newFakeResolver()
			p := poolOf(roleDecode, tc.from, Deps{Resolver: r})
			ctx := context.Background()
			r.set("decode.svc", []string{"10.0.0.9"}, nil)
			p.resolve(ctx, name) // what the old spec's name, if any, answered

			p.Update(tc.to)
			r.set("decode.svc", nil, errors.New("NXDOMAIN"))
			p.resolve(ctx, name)
			if got := addrsOf(p.Endpoints()); !slices.Equal(got, tc.before) {
				t.Errorf("endpoints after the reload, its name not answering = %v, want %v", got, tc.before)
			}
			if _, err := p.Select(nil); err != nil || !p.Ready() {
				t.Errorf("a request after the reload: %v (ready %v), want it routed", err, p.Ready())
			}
			r.set("decode.svc", []string{"10.0.0.5"}, nil)
			p.resolve(ctx, name)
			if got := addrsOf(p.Endpoints()); !slices.Equal(got, tc.answer) {
				t.Errorf("endpoints once the name answered = %v, want %v", got, tc.answer)
			}
		})
	}
}

// With active checks on, an endpoint that leaves a DNS answer for a while
// (a name answering varied subsets) comes back with its checks' verdict, as
// Envoy keeps a host its checks pass (updateDynamicHostList): readiness
// does not await a check of it again, nor does its first unanswered check
// take it out; one they found down stays down. Past rerankWindow it comes
// back new.
func TestAnEndpointBackInTheAnswerKeepsItsChecksVerdict(t *testing.T) {
	const name, back = "decode.svc:8000", "10.0.0.2:8000"
	for _, tc := range []struct {
		name    string
		verdict verdict    // of both endpoints' checks, an hour before the answers change
		answers [][]string // then, away apart
		away    time.Duration
		awaits  bool // back awaits a check on its return
		down    bool // back is down after an unanswered check
	}{
		{"back at the next answer", passed, [][]string{{"10.0.0.1"}, {"10.0.0.1", "10.0.0.2"}}, 0, false, false},
		{"every endpoint away in turn", passed, [][]string{{"10.0.0.1"}, {"10.0.0.2"}}, time.Minute, false, false},
		{"back past the window", passed, [][]string{{"10.0.0.1"}, {"10.0.0.1", "10.0.0.2"}}, rerankWindow, true, true},
		{"found down, back", refused, [][]string{{"10.0.0.1"}, {"10.0.0.1", "10.0.0.2"}}, time.Minute, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, clock := newFakeResolver(), newFakeClock()
			spec := PoolSpec{PoolScheduling: config.PoolScheduling{DNS: name}}
			spec.Health.CheckInterval = config.Duration(time.Minute) // on, but not run here
			p := poolOf(roleDecode, spec, Deps{Resolver: r, Now: clock.Now})
			r.set("decode.svc", []string{"10.0.0.1", "10.0.0.2"}, nil)
			p.resolve(t.Context(), name)
			for _, e := range p.Endpoints() {
				e.setActive(tc.verdict)
			}
			clock.Advance(time.Hour)
			for i, ips := range tc.answers {
				if i > 0 {
					clock.Advance(tc.away)
				}
				r.set("decode.svc", ips, nil)
				p.resolve(t.Context(), name)
			}
			e := byAddr(p, back)
			if awaits := p.AwaitsCheck(e); awaits != tc.awaits {
				t.Fatalf("%s awaits a check on its return: %v, want %v", back, awaits, tc.awaits)
			}
			e.setActive(unanswered)
			if down := e.CheckedDown(); down != tc.down {
				t.Errorf("%s down after an unanswered check: %v, want %v", back, down, tc.down)
			}
		})
	}
}

// A DNS answer of an address no connection can reach (a sinkhole's 0.0.0.0
// or ::, a multicast or the broadcast address) is skipped, with one log line
// each time what is skipped changes, not at each lookup; an answer of
// nothing else keeps the endpoints found before, as an empty one does.
func TestResolveSkipsAddressesThatNameNoEngine(t *testing.T) {
	r := newFakeResolver()
	var logged []string
	p := dnsPool(t, r, nil, "decode.svc:8000")
	p.deps.Log = funcr.New(func(_, args string) { logged = append(logged, args) }, funcr.Options{})
	steps := []struct {
		answer    []string
		endpoints []string
		logged    string // the line this lookup adds, "" for none
	}{
		{[]string{"10.0.0.1", "0.0.0.0"}, []string{"10.0.0.1:8000"},
			`"level"=0 "msg"="DNS answered addresses that name no engine; skipping them" "pool"="decode" "dns"="decode.svc:8000" "skipped"=["0.0.0.0 is the unspecified address, a listener's wildcard: it names no engine"]`},
		{[]string{"10.0.0.1", "0.0.0.0"}, []string{"10.0.0.1:8000"}, ""},
		{[]string{"0.0.0.0", "::", "224.0.0.1", "255.255.255.255"}, []string{"10.0.0.1:8000"},
			`"level"=0 "msg"="DNS answered addresses that name no engine; skipping them" "pool"="decode" "dns"="decode.svc:8000" "skipped"=["0.0.0.0 is the unspecified address, a listener's wildcard: it names no engine" ":: is the unspecified address, a listener's wildcard: it names no engine" "224.0.0.1 is a multicast address: TCP connects to one host" "255.255.255.255 is the broadcast address: TCP connects to one host"]`},
		{[]string{"0.0.0.0", "::", "224.0.0.1", "255.255.255.255"}, []string{"10.0.0.1:8000"}, ""},
		{[]string{"::", "fd00::2"}, []string{"[fd00::2]:8000"},
			`"level"=0 "msg"="DNS answered addresses that name no engine; skipping them" "pool"="decode" "dns"="decode.svc:8000" "skipped"=[":: is the unspecified address, a listener's wildcard: it names no engine"]`},
		{[]string{"10.0.0.2"}, []string{"10.0.0.2:8000"}, ""},
	}
	for i, s := range steps {
		r.set("decode.svc", s.answer, nil)
		before := len(logged)
		p.resolve(context.Background(), "decode.svc:8000")
		if got := addrsOf(p.Endpoints()); !slices.Equal(got, s.endpoints) {
			t.Errorf("step %d: answer %v gave endpoints %v, want %v", i, s.answer, got, s.endpoints)
		}
		if got := strings.Join(logged[before:], "\n"); got != s.logged {
			t.Errorf("step %d: logged\n%s\nwant\n%s", i, got, s.logged)
		}
	}
}
