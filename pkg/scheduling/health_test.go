package scheduling

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// step is one thing that happens to an endpoint, and what a picker then sees.
type step struct {
	do          string // "fail", "ok", "wait:<duration>", "acquire", "release", "claim", "leave", "judged", "take", "taken fail", "taken ok"
	wantHealthy bool
}

func TestEjectionAndRecovery(t *testing.T) {
	tests := []struct {
		name      string
		steps     []step
		ejections uint64 // pd_extproc_endpoint_ejections_total at the end
	}{
		{"two failures do not eject", []step{{"fail", true}, {"fail", true}}, 0},
		{"a success resets the count", []step{{"fail", true}, {"fail", true}, {"ok", true}, {"fail", true}, {"fail", true}}, 0},
		{"three consecutive failures eject for 1s", []step{
			{"fail", true}, {"fail", true}, {"fail", false},
			{"wait:999ms", false}, {"wait:1ms", true}}, 1},
		{"a failed probe doubles the ejection", []step{
			{"fail", true}, {"fail", true}, {"fail", false},
			{"wait:1s", true}, {"fail", false},
			{"wait:1999ms", false}, {"wait:1ms", true}, {"fail", false},
			{"wait:3999ms", false}, {"wait:1ms", true}}, 3},
		{"the ejection is capped at max_ejection", []step{
			{"fail", true}, {"fail", true}, {"fail", false}, // 1s
			{"wait:1s", true}, {"fail", false}, // 2s
			{"wait:2s", true}, {"fail", false}, // 4s
			{"wait:4s", true}, {"fail", false}, // capped at 5s
			{"wait:4999ms", false}, {"wait:1ms", true}}, 4},
		{"a successful probe restores the endpoint and resets the backoff", []step{
			{"fail", true}, {"fail", true}, {"fail", false},
			{"wait:1s", true}, {"fail", false},
			{"wait:2s", true}, {"ok", true},
			{"fail", true}, {"fail", true}, {"fail", false}, {"wait:1s", true}}, 3},
		{"failures of requests already running do not lengthen the ejection", []step{
			{"fail", true}, {"fail", true}, {"fail", false}, {"fail", false}, {"fail", false},
			{"wait:1s", true}}, 1},
		{"a success from before the ejection does not end it", []step{
			{"fail", true}, {"fail", true}, {"fail", false}, {"ok", false}, {"wait:1s", true}}, 1},
		{"half-open takes a single probe", []step{
			{"fail", true}, {"fail", true}, {"fail", false},
			{"wait:1s", true}, {"acquire", false}, {"release", true}}, 1},
		{"a probe claimed for a later verdict holds the endpoint past its leaving", []step{
			{"fail", true}, {"fail", true}, {"fail", false},
			{"wait:1s", true}, {"claim", false}, {"leave", false}, {"judged", true}}, 1},
		{"a claimed probe's failure reported before its verdict ejects again", []step{
			{"fail", true}, {"fail", true}, {"fail", false},
			{"wait:1s", true}, {"claim", false}, {"leave", false}, {"fail", false}, {"judged", false}, {"wait:2s", true}}, 2},
		{"the probe's success restores it for everyone", []step{
			{"fail", true}, {"fail", true}, {"fail", false},
			{"wait:1s", true}, {"acquire", false}, {"ok", true}}, 1},
		{"a request taken before the ejection, served after it, does not restore it: the probe decides", []step{
			{"take", true}, {"fail", true}, {"fail", true}, {"fail", false},
			{"wait:1s", true}, {"claim", false}, {"taken ok", false}, {"leave", false}, {"fail", false}, {"judged", false}}, 2},
		{"a request taken before the ejection, failed after it, does not eject again", []step{
			{"take", true}, {"fail", true}, {"fail", true}, {"fail", false},
			{"wait:1s", true}, {"claim", false}, {"taken fail", false}, {"leave", false}, {"judged", true}}, 1},
		{"a request taken after the ejection ended counts", []step{
			{"fail", true}, {"fail", true}, {"fail", false},
			{"wait:1s", true}, {"take", true}, {"taken ok", true}, {"fail", true}}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, clock := testPool(t, config.PoolScheduling{Health: config.EngineHealth{MaxEjection: config.Duration(5 * time.Second)}}, "10.0.0.1:8000")
			e := p.Endpoints()[0]
			var release func()
			var slot *Slot
			var taken Taken
			for i, s := range tt.steps {
				switch {
				case s.do == "fail":
					e.ReportFailure()
				case s.do == "ok":
					e.ReportSuccess()
				case s.do == "acquire":
					release = acquire(e)
				case s.do == "release":
					release()
				case s.do == "claim":
					slot = e.Claim()
				case s.do == "leave":
					slot.Leave()
				case s.do == "judged":
					slot.Judged()
				case s.do == "take":
					taken = e.Take()
				case s.do == "taken fail":
					taken.Failed()
				case s.do == "taken ok":
					taken.Served()
				case strings.HasPrefix(s.do, "wait:"):
					d, err := time.ParseDuration(strings.TrimPrefix(s.do, "wait:"))
					if err != nil {
						t.Fatal(err)
					}
					clock.Advance(d)
				}
				if got := e.Healthy(); got != s.wantHealthy {
					t.Fatalf("step %d (%s): Healthy() = %v, want %v", i, s.do, got, s.wantHealthy)
				}
			}
			if got := e.Ejections(); got != tt.ejections {
				t.Errorf("Ejections() = %d, want %d", got, tt.ejections)
			}
		})
	}
}

func TestBareEndpointUsesDefaults(t *testing.T) {
	e := &Endpoint{Addr: "10.0.0.1:8000"}
	for range 3 {
		e.ReportFailure()
	}
	if e.Healthy() {
		t.Fatal("three failures did not eject an endpoint built without a pool")
	}
}

func TestActiveChecks(t *testing.T) {
	status := http.StatusOK
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(status) })
	srv := httptest.NewServer(mux)
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	dead := "127.0.0.1:1" // nothing listens on port 1

	spec := PoolSpec{Endpoints: []string{addr, dead}, PoolScheduling: config.PoolScheduling{Health: config.EngineHealth{CheckInterval: config.Duration(time.Second)}}}
	p, _ := testPool(t, spec.PoolScheduling, spec.Endpoints...)
	ctx := context.Background()
	check := func() { checkAll(ctx, p.probe, p.Endpoints(), "/health", time.Second, always) }

	check()
	if !byAddr(p, addr).Healthy() || byAddr(p, dead).Healthy() {
		t.Fatalf("after one check: healthy = %v, %v; want true, false", byAddr(p, addr).Healthy(), byAddr(p, dead).Healthy())
	}
	status = http.StatusServiceUnavailable
	check()
	if byAddr(p, addr).Healthy() {
		t.Fatal("an endpoint answering 503 to /health stayed healthy")
	}
	if e, err := p.Select(nil); err == nil {
		t.Fatalf("Select() = %s, want no endpoint when every check fails", e.Addr)
	}
	status = http.StatusOK
	check()
	if !byAddr(p, addr).Healthy() {
		t.Fatal("an endpoint passing its check again stayed down")
	}
	check() // the dead one stays down: no new ejection
	if a, d := byAddr(p, addr).Ejections(), byAddr(p, dead).Ejections(); a != 1 || d != 1 {
		t.Errorf("ejections %d and %d; want 1 each: one failed check while up, however long it stays down", a, d)
	}

	spec.Health.CheckInterval = 0
	p.Update(spec)
	if !byAddr(p, dead).Healthy() {
		t.Fatal("turning checks off kept the last down verdict")
	}
}

func TestCheckDuringShutdownGivesNoVerdict(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer srv.Close()
	e := &Endpoint{Addr: strings.TrimPrefix(srv.URL, "http://")}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	checkAll(ctx, probe{client: srv.Client(), scheme: "http"}, []*Endpoint{e}, "/health", time.Second, always)
	if !e.Healthy() {
		t.Fatal("a check cut short by shutdown marked the endpoint down")
	}
}

// A pool whose engines serve TLS is checked and scraped over HTTPS, trusting
// the CA its keys name; plain HTTP or an untrusted certificate reads as down
// and scrapes nothing.
func TestChecksAndScrapesSpeakThePoolsTLS(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("vllm:num_requests_waiting 4\n")) })
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshakes are the point
	srv.StartTLS()
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "https://")
	roots := x509.NewCertPool()
	roots.AddCert(srv.Certificate())

	tests := []struct {
		name   string
		tls    *tls.Config
		wantUp bool
	}{
		{"HTTPS trusting the engines' CA", &tls.Config{RootCAs: roots}, true},
		{"HTTPS checking the name the certificate carries", &tls.Config{RootCAs: roots, ServerName: "example.com"}, true},
		{"HTTPS checking another name", &tls.Config{RootCAs: roots, ServerName: "engine.internal"}, false},
		{"HTTPS not trusting the engines' CA", &tls.Config{}, false},
		{"plain HTTP to a TLS engine", nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Checked and scraped, though not run here: checkAll below is the first check.
			scraped := config.PoolScheduling{Metrics: config.EngineMetrics{Interval: config.Duration(time.Minute)}}
			scraped.Health.CheckInterval = config.Duration(time.Minute)
			spec := PoolSpec{Endpoints: []string{addr}, PoolScheduling: scraped}
			ps := NewPools(Spec{Prefill: spec, Decode: spec}, Deps{PrefillTLS: tt.tls, DecodeTLS: tt.tls})
			for _, p := range []*Pool{ps.Prefill, ps.Decode} {
				defer p.probe.client.CloseIdleConnections()
				e := p.Endpoints()[0]
				checkAll(context.Background(), p.probe, p.Endpoints(), "/health", time.Second, always)
				p.scrapeAll(context.Background(), p.Endpoints(), "/metrics", time.Second)
				l, scrapedOK := e.Fresh()
				if e.Healthy() != tt.wantUp || scrapedOK != tt.wantUp || scrapedOK && l.Waiting != 4 {
					t.Errorf("%s pool: healthy %v, scraped %v (%+v); want both %v", p.Name(), e.Healthy(), scrapedOK, l, tt.wantUp)
				}
			}
		})
	}
}

// TestActiveCheckThresholds: as Envoy's HTTP checker, checks that go
// unanswered (a timeout, a connection refused) mark an established endpoint
// (one that passed a check, or served while checks were off) down only
// after unhealthy_threshold of them in a row; an answer that is not 2xx, or
// a new endpoint's first check that fails, marks it down at once; and
// healthy_threshold passes in a row bring it back. Requests served or
// failed between checks (passive health) change none of it.
func TestActiveCheckThresholds(t *testing.T) {
	tests := []struct {
		name      string
		th        checkThresholds
		verdicts  []verdict
		wantDown  bool
		ejections uint64
	}{
		{"two unanswered after a pass", envoyGatewayThresholds, []verdict{passed, unanswered, unanswered}, false, 0},
		{"three unanswered after a pass", envoyGatewayThresholds, []verdict{passed, unanswered, unanswered, unanswered}, true, 1},
		{"a pass starts the count over", envoyGatewayThresholds, []verdict{passed, unanswered, unanswered, passed, unanswered, unanswered}, false, 0},
		{"a 503 after a pass", envoyGatewayThresholds, []verdict{passed, refused}, true, 1},
		{"a first check unanswered", envoyGatewayThresholds, []verdict{unanswered}, true, 1},
		// Checks turned on by a reload find the endpoint serving: it is established.
		{"a first check unanswered, serving before checks", envoyGatewayThresholds, []verdict{servedUnchecked, unanswered}, false, 0},
		{"three unanswered, serving before checks", envoyGatewayThresholds, []verdict{servedUnchecked, unanswered, unanswered, unanswered}, true, 1},
		{"a first check's 503, serving before checks", envoyGatewayThresholds, []verdict{servedUnchecked, refused}, true, 1},
		{"down, then one pass", envoyGatewayThresholds, []verdict{refused, passed}, false, 1},
		{"down, then one pass of two needed", checkThresholds{unhealthy: 3, healthy: 2}, []verdict{refused, passed}, true, 1},
		{"down, then two passes of two needed", checkThresholds{unhealthy: 3, healthy: 2}, []verdict{refused, passed, passed}, false, 1},
		{"down for long: one ejection", envoyGatewayThresholds, []verdict{passed, refused, unanswered, unanswered, unanswered, refused}, true, 1},
		{"a request failed and one served, then one unanswered", envoyGatewayThresholds, []verdict{passed, requestFailed, requestServed, unanswered}, false, 0},
		{"a request served between two passes of two needed", checkThresholds{unhealthy: 3, healthy: 2}, []verdict{refused, passed, requestServed, passed}, false, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var s atomic.Pointer[settings]
			st := defaultSettings
			st.unhealthy, st.healthy = tt.th.unhealthy, tt.th.healthy
			s.Store(&st)
			e := newEndpoint("a", &s)
			for _, v := range tt.verdicts {
				switch v {
				case requestFailed:
					e.ReportFailure()
				case requestServed:
					e.ReportSuccess()
				case servedUnchecked:
					e.unchecked()
				default:
					e.setActive(v)
				}
			}
			if e.CheckedDown() != tt.wantDown || e.Healthy() == tt.wantDown || e.Ejections() != tt.ejections {
				t.Errorf("down %v, healthy %v, %d ejections; want down %v, %d ejections", e.CheckedDown(), e.Healthy(), e.Ejections(), tt.wantDown, tt.ejections)
			}
		})
	}
}

// TestAHungCheckGoesUnanswered: a /health that does not answer within
// check_timeout counts as unanswered, not as a refusal: an established
// endpoint stays up through fewer than unhealthy_threshold of them.
func TestAHungCheckGoesUnanswered(t *testing.T) {
	var hang atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		if hang.Load() {
			<-r.Context().Done()
		}
	}))
	defer srv.Close()
	e := &Endpoint{Addr: strings.TrimPrefix(srv.URL, "http://")}
	pr := probe{client: srv.Client(), scheme: "http"}
	checkAll(context.Background(), pr, []*Endpoint{e}, "/health", time.Second, always)
	hang.Store(true)
	for range 2 {
		checkAll(context.Background(), pr, []*Endpoint{e}, "/health", 20*time.Millisecond, always)
	}
	if !e.Healthy() {
		t.Fatal("two hung checks marked an established endpoint down")
	}
	checkAll(context.Background(), pr, []*Endpoint{e}, "/health", 20*time.Millisecond, always)
	if e.Healthy() {
		t.Fatal("three hung checks left the endpoint up")
	}
}

// checkThresholds are a pool's unhealthy_threshold and healthy_threshold,
// for TestActiveCheckThresholds; envoyGatewayThresholds are config's
// defaults: 3 unanswered checks mark an endpoint down, 1 that passes up.
type checkThresholds struct{ unhealthy, healthy int }

var envoyGatewayThresholds = checkThresholds{unhealthy: config.DefaultUnhealthyThreshold, healthy: config.DefaultHealthyThreshold}

// Passive health's reports, and the endpoint serving while checks are off
// (Pool.Update runs unchecked), among TestActiveCheckThresholds' verdicts.
const (
	requestFailed verdict = iota + 100
	requestServed
	servedUnchecked
)

func always(*Endpoint) bool { return true }

// TestAVerdictAfterChecksStopIsDropped: a check still running when checks
// are turned off (or the pool changes) gives no verdict, which would stand
// with no check left to clear it.
func TestAVerdictAfterChecksStopIsDropped(t *testing.T) {
	e := &Endpoint{Addr: "127.0.0.1:1"} // nothing listens on port 1
	checkAll(context.Background(), probe{client: http.DefaultClient, scheme: "http"}, []*Endpoint{e}, "/health", time.Second,
		func(*Endpoint) bool { return false })
	if !e.Healthy() {
		t.Fatal("a verdict from a round the pool has moved past marked the endpoint down")
	}
}

// TestAVerdictHoldsWhileItsEndpointStays: a check's verdict applies to an
// endpoint still in the pool, however the pool changed while it ran (a
// pool that keeps changing would otherwise never mark a hung engine down);
// not to one that left, nor after checks were turned off.
func TestAVerdictHoldsWhileItsEndpointStays(t *testing.T) {
	spec := PoolSpec{Endpoints: []string{"10.0.0.1:8000"}}
	spec.Health.CheckInterval = config.Duration(time.Hour)
	p := poolOf(roleDecode, spec, Deps{})
	e := byAddr(p, "10.0.0.1:8000")
	p.SetDiscovered([]Discovered{{Addr: "10.0.0.2:8000"}})
	if !p.checked(e) {
		t.Error("a verdict on an endpoint that stayed, the pool having changed, was dropped")
	}
	left := byAddr(p, "10.0.0.2:8000")
	p.SetDiscovered(nil)
	if p.checked(left) {
		t.Error("a verdict on an endpoint that left applies")
	}
	spec.Health.CheckInterval = 0
	p.Update(spec)
	if p.checked(e) {
		t.Error("a verdict given after checks were turned off applies")
	}
}

// TestAVerdictLandingAsChecksAreTurnedOffIsDropped: a reload that turns
// checks off may land after a running check's verdict was found current and
// before it is recorded; the verdict is dropped all the same, or the
// endpoint would stay down with no check left to bring it back.
func TestAVerdictLandingAsChecksAreTurnedOffIsDropped(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) }))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	for _, tt := range []struct {
		name string
		next func(PoolSpec) PoolSpec // the reload that lands
		down bool                    // the verdict stands
	}{
		{"checks turned off", func(s PoolSpec) PoolSpec { s.Health.CheckInterval = 0; return s }, false},
		{"checks kept on", func(s PoolSpec) PoolSpec { s.Health.CheckInterval = config.Duration(time.Minute); return s }, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			spec := PoolSpec{Endpoints: []string{addr}}
			spec.Health.CheckInterval = config.Duration(time.Hour)
			p := poolOf(roleDecode, spec, Deps{})
			e := byAddr(p, addr)
			checkAll(context.Background(), p.probe, []*Endpoint{e}, "/health", time.Second, func(e *Endpoint) bool {
				current := p.checked(e)
				p.Update(tt.next(spec)) // the reload, between the verdict's test and its record
				return current
			})
			if e.Healthy() == tt.down || e.CheckedDown() != tt.down {
				t.Errorf("healthy %v, checked down %v; want the 503's verdict to stand: %v", e.Healthy(), e.CheckedDown(), tt.down)
			}
		})
	}
}

// TestAChecksRedirectIsItsAnswer: an engine that answers its check (or a
// scrape) with a redirect is not followed: pd-extproc asks no host outside
// its pools, and the redirect, not 2xx, is the engine's verdict.
func TestAChecksRedirectIsItsAnswer(t *testing.T) {
	var asked atomic.Int32
	elsewhere := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { asked.Add(1) }))
	defer elsewhere.Close()
	for _, code := range []int{http.StatusMovedPermanently, http.StatusFound, http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, elsewhere.URL+"/health", code)
		}))
		if v, ok := check(t.Context(), probeClient(nil), engine.URL+"/health", time.Second); v != refused || !ok || asked.Load() != 0 {
			t.Errorf("%d: verdict %v (ok %v), the other host asked %d times; want refused and never asked", code, v, ok, asked.Load())
		}
		engine.Close()
	}
}

// TestACheckedDownEndpointStaysDownThroughAnAbsence: an endpoint its
// checks found down that leaves the pool for a moment (a discovery set or
// a DNS answer without it) comes back as the same Endpoint, down until its
// checks pass, as a passively ejected one does. It came back new and
// healthy, and took requests until its first check ended.
func TestACheckedDownEndpointStaysDownThroughAnAbsence(t *testing.T) {
	spec := PoolSpec{Endpoints: []string{"10.0.0.1:8000"}}
	spec.Health.CheckInterval = config.Duration(time.Minute) // on, but not run here
	ps := NewPools(Spec{Decode: spec}, Deps{})
	const addr = "10.0.0.2:8000"
	ps.Decode.SetDiscovered([]Discovered{{Addr: addr}})
	down := byAddr(ps.Decode, addr)
	down.setActive(refused)
	if !down.CheckedDown() {
		t.Fatal("not checked down: the test shows nothing")
	}
	ps.Decode.SetDiscovered(nil)
	ps.Decode.SetDiscovered([]Discovered{{Addr: addr}})
	if back := byAddr(ps.Decode, addr); back != down || !back.CheckedDown() {
		t.Errorf("back as the same Endpoint: %v, checked down: %v; want both", back == down, back.CheckedDown())
	}
}

// A pick finds an endpoint healthy before it takes the endpoint's slot, so
// two picks may both find a half-open endpoint healthy: the first to claim
// it is its probe, and the second holds nothing (Pool.Claim picks again).
// Many picks at once from two pools' worth of contention: only the probe
// reaches the half-open endpoint, whatever the interleaving.
func TestAHalfOpenEndpointTakesOnlyItsProbe(t *testing.T) {
	t.Run("two picks that found it healthy", func(t *testing.T) {
		p, clock := testPool(t, config.PoolScheduling{}, "10.0.0.1:8000")
		e := p.Endpoints()[0]
		eject(p, e.Addr)
		clock.Advance(time.Second)
		if !e.Healthy() {
			t.Fatal("not half-open after its ejection")
		}
		first, second := e.claim(true), e.claim(true)
		if first == nil || !first.probe || second != nil {
			t.Fatalf("claims: first %+v, second %+v; want the probe, then nothing", first, second)
		}
		if n := e.InFlight(); n != 1 {
			t.Errorf("in flight %d, want the probe's 1", n)
		}
		first.Release()
		if !e.Healthy() {
			t.Error("the probe's release did not free it")
		}
	})
	t.Run("many picks at once", func(t *testing.T) {
		for _, pool := range []string{"prefill", "decode"} {
			p, clock := testPoolNamed(t, pool, policy(config.PolicyRoundRobin), "10.0.0.1:8000", "10.0.0.2:8000")
			eject(p, "10.0.0.1:8000")
			clock.Advance(time.Second)
			start := make(chan struct{})
			slots := make([]*Slot, 64)
			var wg sync.WaitGroup
			for i := range slots {
				wg.Go(func() {
					<-start
					_, slots[i], _ = p.Claim(nil, 1)
				})
			}
			close(start)
			wg.Wait()
			var probes, others int
			for _, s := range slots {
				if s.Endpoint().Addr == "10.0.0.1:8000" {
					if s.probe {
						probes++
					} else {
						others++
					}
				}
				s.Release()
			}
			if probes != 1 || others != 0 {
				t.Errorf("%s pool: the half-open endpoint took %d probes and %d other requests; want its probe alone", pool, probes, others)
			}
		}
	})
}

// An ejection is the base doubled at each one in a row, up to
// max_ejection, however long the base: the doubling was a shift, which past
// a base of some 2.4 hours overflows; at this one (2^44 ns and a
// microsecond, some 4.9 hours) the 21st ejection in a row lasted a second.
func TestEjectionsGrowToTheMostWithoutOverflow(t *testing.T) {
	const base, most = time.Duration(1<<44) + time.Microsecond, 1000 * time.Hour
	p, clock := testPool(t, config.PoolScheduling{Health: config.EngineHealth{ConsecutiveFailures: 1,
		BaseEjection: config.Duration(base), MaxEjection: config.Duration(most)}}, "10.0.0.1:8000")
	e := p.Endpoints()[0]
	want := base
	for i := range 25 {
		e.ReportFailure()
		clock.Advance(want - time.Second)
		if e.Healthy() {
			t.Fatalf("ejection %d ended before %v", i+1, want)
		}
		clock.Advance(time.Second)
		if !e.Healthy() {
			t.Fatalf("ejection %d lasts past %v", i+1, want)
		}
		want = min(2*want, most)
	}
}

// The checks' client closes an idle connection before the engine does
// (uvicorn's timeout_keep_alive, 5 s): its POSTs (a decode engine asked for
// a request's token ids) are not retried, and one sent on a connection the
// engine is closing would fail, leaving the request to the estimates.
func TestProbeClientClosesIdleConnectionsBeforeTheEngine(t *testing.T) {
	const engineKeepAlive = 5 * time.Second
	for _, tls := range []*tls.Config{nil, {}} {
		tr := probeClient(tls).Transport.(*http.Transport)
		if tr.IdleConnTimeout <= 0 || tr.IdleConnTimeout >= engineKeepAlive {
			t.Errorf("TLS %v: idle connections kept %s; the engines close theirs at %s", tls != nil, tr.IdleConnTimeout, engineKeepAlive)
		}
	}
}

// TestAPoolWithNoWayAroundItRoutesAmongItsEjected: when passive health has
// ejected every endpoint of a pool a request cannot do without, it routes
// among them (Envoy's panic routing) and stays ready, rather than answer
// every request 503 until an ejection, grown to max_ejection, runs out: the
// decode pool, and the prefill pool of paired engines (kv-sglang), whose
// decode engines serve only pairs. Other prefill pools have decode-only
// (no_prefill). Endpoints the active checks find down are left out.
func TestAPoolWithNoWayAroundItRoutesAmongItsEjected(t *testing.T) {
	const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
	tests := []struct {
		name      string
		paired    bool
		pool      string
		checkDown bool // b is found down by the active checks too
		want      string
	}{
		{name: "decode", pool: "decode", want: a},
		{name: "prefill of paired engines", paired: true, pool: "prefill", want: a},
		{name: "prefill of paired engines, one checked down", paired: true, pool: "prefill", checkDown: true, want: a},
		{name: "prefill with decode-only to fall back on", pool: "prefill"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			ps := NewPools(Spec{Paired: tt.paired, Prefill: PoolSpec{Endpoints: []string{a, b}}, Decode: PoolSpec{Endpoints: []string{a, b}}},
				Deps{Now: clock.Now, intn: func(int) int { return 0 }})
			p := map[string]*Pool{"prefill": ps.Prefill, "decode": ps.Decode}[tt.pool]
			eject(p, a, b)
			if tt.checkDown {
				checkDown(p, a)
			}
			eps, slot, err := p.Claim(promptRequest("hi"), 1)
			got := ""
			if err == nil {
				got = eps[0].Addr
				slot.Release()
			}
			if tt.checkDown {
				tt.want = b
			}
			if got != tt.want || (err != nil) != (tt.want == "") || p.Ready() != (tt.want != "") {
				t.Errorf("with every endpoint ejected: picked %q (%v), ready %v; want %q", got, err, p.Ready(), tt.want)
			}
			if tt.pool == "prefill" {
				want := map[bool]bool{true: true}[tt.want != ""]
				if split := ps.Decide(promptRequest("hi"), ps.Decode.Endpoints()[0]); split.PD != want {
					t.Errorf("decided %+v, want P/D %v", split, want)
				}
			}
		})
	}
}
