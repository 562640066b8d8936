package scheduling

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// sglangEngine is a test engine that answers GET path with answer (status
// 200 when it parses as JSON, else answer is a status line's code, as
// "401"), and 404 (FastAPI's) elsewhere; it counts the server info asked.
type sglangEngine struct {
	mu     sync.Mutex
	path   string
	answer string
	asked  atomic.Int64
	addr   string
}

func newSGLangEngine(t *testing.T, path, answer string) *sglangEngine {
	t.Helper()
	e := &sglangEngine{path: path, answer: answer}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		path, answer := e.path, e.answer
		e.mu.Unlock()
		if r.URL.Path != path {
			w.WriteHeader(http.StatusNotFound)
			w.Write([]byte(`{"detail":"Not Found"}`))
			return
		}
		e.asked.Add(1)
		switch answer {
		case "401", "500":
			w.WriteHeader(map[string]int{"401": 401, "500": 500}[answer])
			w.Write([]byte(`{"error":"no"}`))
		default:
			w.Write([]byte(answer))
		}
	}))
	t.Cleanup(srv.Close)
	e.addr = strings.TrimPrefix(srv.URL, "http://")
	return e
}

func (e *sglangEngine) set(path, answer string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.path, e.answer = path, answer
}

// sglangInfo is SGLang's server info, cut to what matters and a field on
// each side of it.
func sglangInfo(mode string, port int) string {
	return `{"model_path":"m","disaggregation_mode":"` + mode + `","disaggregation_transfer_backend":"mooncake","disaggregation_bootstrap_port":` +
		strconv.Itoa(port) + `,"internal_states":[{}],"version":"0.5.9"}`
}

func TestFetchServerInfo(t *testing.T) {
	tests := []struct {
		name, path, answer string
		wantPort           int
		wantMode           string
		wantErr            string
	}{
		{"current SGLang", "/server_info", sglangInfo("prefill", 9001), 9001, "prefill", ""},
		{"SGLang before /server_info", "/get_server_info", sglangInfo("prefill", 9002), 9002, "prefill", ""},
		{"a decode engine says so", "/server_info", sglangInfo("decode", 8998), 8998, "decode", ""},
		{"--api-key", "/server_info", "401", 0, "", "answered 401"},
		{"an error", "/server_info", "500", 0, "", "answered 500"},
		{"no port", "/server_info", `{"disaggregation_mode":"prefill"}`, 0, "", "names no disaggregation_bootstrap_port"},
		{"a null port", "/server_info", `{"disaggregation_bootstrap_port":null}`, 0, "", "names no disaggregation_bootstrap_port"},
		{"no port number", "/server_info", `{"disaggregation_bootstrap_port":70000}`, 0, "", "names no disaggregation_bootstrap_port"},
		{"not JSON", "/server_info", `<html>`, 0, "", "invalid character"},
		{"neither path", "/other", sglangInfo("prefill", 9001), 0, "", "/get_server_info answered 404"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newSGLangEngine(t, tc.path, tc.answer)
			got := fetchServerInfo(context.Background(), probe{client: http.DefaultClient, scheme: "http"}, e.addr, time.Second)
			if got.bootstrapPort != tc.wantPort || got.mode != tc.wantMode {
				t.Errorf("port %d, mode %q; want %d, %q", got.bootstrapPort, got.mode, tc.wantPort, tc.wantMode)
			}
			if tc.wantErr == "" && got.err != "" || !strings.Contains(got.err, tc.wantErr) {
				t.Errorf("error %q, want one with %q", got.err, tc.wantErr)
			}
		})
	}
}

// The engine's own report comes first: it is the port its bootstrap server
// listens on. A pod's annotation, then the pool's port, stand in until it is
// read, or where it cannot be (an engine behind --api-key). A failed read
// later keeps what was read.
func TestBootstrapPortPrecedence(t *testing.T) {
	var logs strings.Builder
	var logMu sync.Mutex
	engine := newSGLangEngine(t, "/server_info", "401")
	p, clock := testPoolNamed(t, "prefill", policy(config.PolicyRoundRobin))
	p.deps.Log = funcr.New(func(prefix, args string) {
		logMu.Lock()
		defer logMu.Unlock()
		logs.WriteString(args + "\n")
	}, funcr.Options{})
	p.SetDiscovered([]Discovered{{Addr: engine.addr, BootstrapPort: 9100}})
	e := p.Endpoints()[0]
	read := func() {
		t.Helper()
		st := p.state.Load()
		p.readServerInfo(context.Background(), st, st.endpoints)
	}
	steps := []struct {
		name   string
		path   string
		answer string
		after  time.Duration
		want   int
		asked  int64
		logged string
	}{
		{"not read yet: the annotation", "", "", 0, 9100, 0, ""},
		{"an engine behind --api-key: the annotation", "/server_info", "401", 0, 9100, 1, "cannot read the engine's server info"},
		{"a failed read is tried again at once", "/server_info", sglangInfo("prefill", 9001), 0, 9001, 2, `"bootstrap_port"=9001`},
		{"a read port is not read again within the refresh", "/server_info", sglangInfo("prefill", 9002), serverInfoRefresh / 2, 9001, 2, ""},
		{"after it, it is", "/server_info", sglangInfo("prefill", 9002), serverInfoRefresh / 2, 9002, 3, `"bootstrap_port"=9002`},
		{"a failed read keeps the port read", "/server_info", "500", serverInfoRefresh, 9002, 4, "answered 500"},
		{"a decode engine in the prefill pool is named", "/server_info", sglangInfo("decode", 9002), 0, 9002, 5, `"disaggregation_mode"="decode"`},
	}
	for _, s := range steps {
		logMu.Lock()
		logs.Reset()
		logMu.Unlock()
		clock.Advance(s.after)
		if s.path != "" {
			engine.set(s.path, s.answer)
			read()
		}
		if got := e.BootstrapPort(8998); got != s.want {
			t.Errorf("%s: bootstrap port %d, want %d", s.name, got, s.want)
		}
		if got := engine.asked.Load(); got != s.asked {
			t.Errorf("%s: asked %d times, want %d", s.name, got, s.asked)
		}
		logMu.Lock()
		got := logs.String()
		logMu.Unlock()
		if s.logged == "" && got != "" || !strings.Contains(got, s.logged) {
			t.Errorf("%s: logged %q, want a line with %q", s.name, got, s.logged)
		}
	}
	if got := (&Endpoint{}).BootstrapPort(8998); got != 8998 {
		t.Errorf("an endpoint nothing names a port for: %d, want the pool's 8998", got)
	}
}

// A kv-sglang prefill pool reads each engine's port as the pool starts:
// two engines on one host, each its own port. A decode pool, or the prefill
// pool of another connector, asks nothing.
func TestPairedPrefillPoolReadsItsEngines(t *testing.T) {
	a := newSGLangEngine(t, "/server_info", sglangInfo("prefill", 9001))
	b := newSGLangEngine(t, "/server_info", sglangInfo("prefill", 9002))
	d := newSGLangEngine(t, "/server_info", sglangInfo("decode", 8998))
	for _, paired := range []bool{true, false} {
		ps := NewPools(Spec{
			Prefill:    PoolSpec{Endpoints: []string{a.addr, b.addr}},
			Decode:     PoolSpec{Endpoints: []string{d.addr}},
			Rendezvous: map[bool]kv.Rendezvous{true: kv.SGLangBootstrapPort}[paired],
		}, Deps{})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { ps.Run(ctx); close(done) }()
		if paired {
			for i, want := range []int{9001, 9002} {
				e := ps.Prefill.Endpoints()[i]
				waitFor(t, "the engine's port", func() bool { return e.BootstrapPort(8998) == want })
			}
		}
		cancel()
		<-done
		if n := d.asked.Load(); n != 0 {
			t.Errorf("paired=%v: the decode engine was asked %d times", paired, n)
		}
		if !paired {
			if n := a.asked.Load() + b.asked.Load(); n != 2 {
				t.Errorf("unpaired: the prefill engines were asked %d times, want 2 (by the paired pools only)", n)
			}
		}
	}
}

// An engine that joined a kv-sglang prefill pool is not picked until it was
// asked for its port, while others were; a pool that starts uses them all.
func TestEnginesNotYetAskedWait(t *testing.T) {
	tests := []struct {
		name  string
		asked []bool
		want  []string
	}{
		{"none asked: all", []bool{false, false}, []string{"10.0.0.1:8000", "10.0.0.2:8000"}},
		{"one asked", []bool{true, false}, []string{"10.0.0.1:8000"}},
		{"one asked, in vain (--api-key): it counts", []bool{false, true}, []string{"10.0.0.2:8000"}},
		{"both", []bool{true, true}, []string{"10.0.0.1:8000", "10.0.0.2:8000"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := testPoolNamed(t, "prefill", policy(config.PolicyRoundRobin), "10.0.0.1:8000", "10.0.0.2:8000")
			p.probe.rendezvous = kv.SGLangBootstrapPort
			for i, e := range p.Endpoints() {
				if tc.asked[i] {
					e.info.Store(&serverInfo{bootstrapPort: 9000 + i, err: map[bool]string{true: "answered 401"}[i == 1]})
				}
			}
			var picked []string
			for range 4 {
				e, err := p.Select(nil)
				if err != nil {
					t.Fatal(err)
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
}

// An engine taken out of rotation (its requests failed, or its check) is
// asked again at the next round, whatever the refresh: it may come back
// restarted with another port. Until it answers, the port read before
// stands.
func TestAnEjectedEngineIsAskedAgain(t *testing.T) {
	engine := newSGLangEngine(t, "/server_info", sglangInfo("prefill", 9001))
	p, _ := testPoolNamed(t, "prefill", policy(config.PolicyRoundRobin), engine.addr)
	e := p.Endpoints()[0]
	read := func() {
		st := p.state.Load()
		p.readServerInfo(context.Background(), st, st.endpoints)
	}
	read()
	engine.set("/server_info", "500") // restarting
	for range 3 {
		e.ReportFailure()
	}
	if e.Healthy() {
		t.Fatal("three failures did not eject the endpoint: the test shows nothing")
	}
	read()
	if got := e.BootstrapPort(8998); got != 9001 {
		t.Errorf("while the engine restarts: port %d, want the one read before, 9001", got)
	}
	engine.set("/server_info", sglangInfo("prefill", 9002))
	read()
	if got, asked := e.BootstrapPort(8998), engine.asked.Load(); got != 9002 || asked != 3 {
		t.Errorf("after the restart: port %d, asked %d times; want 9002, 3", got, asked)
	}
}
