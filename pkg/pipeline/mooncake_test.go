package pipeline_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// mooncakeLeg is what a kv-mooncake prefill engine was sent.
type mooncakeLeg struct {
	rank   string // X-Data-Parallel-Rank
	params struct {
		DoRemoteDecode bool   `json:"do_remote_decode"`
		TransferID     string `json:"transfer_id"`
	}
	maxTokens int
}

// mooncake is a kv-mooncake pipeline, running, in front of a prefill engine
// whose bootstrap server answers query ("503": not ready) and which, given
// hold, answers each leg only when hold lets it; and a decode engine that
// answers nothing itself: the tests report its outcome.
type mooncake struct {
	p         *pipeline.Pipeline
	legs      chan mooncakeLeg // what the prefill engine was sent
	bootstrap string           // its bootstrap server, host:port
}

func startMooncake(t *testing.T, query string, hold chan struct{}) *mooncake {
	m := &mooncake{legs: make(chan mooncakeLeg, 10)}
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return // health checks, scrapes
		}
		var leg mooncakeLeg
		var b struct {
			Params    json.RawMessage `json:"kv_transfer_params"`
			MaxTokens int             `json:"max_tokens"`
		}
		raw, _ := io.ReadAll(r.Body)
		json.Unmarshal(raw, &b)
		json.Unmarshal(b.Params, &leg.params)
		leg.rank, leg.maxTokens = r.Header.Get("X-Data-Parallel-Rank"), b.MaxTokens
		m.legs <- leg
		if hold != nil {
			<-hold
		}
		w.Write([]byte(`{"choices":[]}`))
	}))
	t.Cleanup(engine.Close)
	queried := make(chan struct{}, 100)
	bootstrap := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		queried <- struct{}{}
		if query == "503" {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte(query))
	}))
	t.Cleanup(bootstrap.Close)
	m.bootstrap = bootstrap.Listener.Addr().String()
	decode := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	t.Cleanup(decode.Close)
	_, port, _ := net.SplitHostPort(m.bootstrap)
	m.p, _, _ = newPipeline(t, fmt.Sprintf(`connector: kv-mooncake
pools: {prefill: {endpoints: [%q], bootstrap_port: %s}, decode: {endpoints: [%q]}}`,
		engine.Listener.Addr().String(), port, decode.Listener.Addr().String()))
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { m.p.Run(ctx); close(ran) }()
	t.Cleanup(func() { cancel(); <-ran; m.p.Wait() })
	enginetest.Receive(t, queried, "the bootstrap server was never asked")
	return m
}

// route routes a chat request, waiting up to 5 s for the first P/D one
// while the engine ids are being read when pd is set, and returns it with
// its decision and the decode leg's kv_transfer_params.
func (m *mooncake) route(t *testing.T, pd bool) (*pipeline.Request, *pipeline.Decision, map[string]any) {
	t.Helper()
	return m.routeTo(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64}`, pd)
}

// routeTo is route with a request of another API.
func (m *mooncake) routeTo(t *testing.T, path, body string, pd bool) (*pipeline.Request, *pipeline.Decision, map[string]any) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; {
		r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: path, RequestID: "r", Body: []byte(body)}
		d, err := m.p.Route(context.Background(), r)
		if err != nil {
			t.Fatal(err)
		}
		if pd && r.Report.Mode != metrics.ModePD && time.Now().Before(deadline) {
			d.Release()
			continue
		}
		var b struct {
			Params map[string]any `json:"kv_transfer_params"`
		}
		json.Unmarshal(d.Body.Bytes(), &b)
		return r, d, b.Params
	}
}

// TestMooncakeLegsMeet: under kv-mooncake both legs carry one transfer id;
// the decode leg names the prefill engine's bootstrap server and the engine
// id of the rank the prefill leg is pinned to, as the bootstrap server
// listed them; an engine of one rank is not told one. Until the server
// answers, requests go decode-only.
func TestMooncakeLegsMeet(t *testing.T) {
	tests := []struct {
		name, query string
		ranks       int
	}{
		{name: "one rank", query: `{"0":{"engine_id":"e-0","worker_addr":{"0":{"0":"tcp://10.0.0.1:17000"}}}}`, ranks: 1},
		{name: "two ranks", query: `{"0":{"engine_id":"e-0"},"1":{"engine_id":"e-1"}}`, ranks: 2},
		{name: "a bootstrap server not ready", query: "503"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := startMooncake(t, tc.query, nil)
			r, d, params := m.route(t, tc.ranks > 0)
			d.Release()
			if tc.ranks == 0 {
				if r.Report.Mode != metrics.ModeDecodeOnly || r.Report.Reason != metrics.ReasonNoPrefill || params != nil {
					t.Errorf("%s %s with kv_transfer_params %v; want decode-only, no_prefill, none", r.Report.Mode, r.Report.Reason, params)
				}
				return
			}
			leg := enginetest.Receive(t, m.legs, "the prefill leg never reached its engine")
			wantRank := leg.rank
			if tc.ranks == 1 {
				if leg.rank != "" {
					t.Errorf("X-Data-Parallel-Rank %q for an engine of one rank, want none", leg.rank)
				}
				wantRank = "0"
			}
			want := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": leg.params.TransferID,
				"remote_bootstrap_addr": "http://" + m.bootstrap, "remote_engine_id": "e-" + wantRank}
			if fmt.Sprint(params) != fmt.Sprint(want) || !strings.HasPrefix(leg.params.TransferID, "xfer-") {
				t.Errorf("decode kv_transfer_params %v, want %v", params, want)
			}
			if !leg.params.DoRemoteDecode || leg.maxTokens != 1 || tc.ranks == 2 && leg.rank != "0" && leg.rank != "1" {
				t.Errorf("prefill leg %+v, want do_remote_decode, max_tokens 1, a rank of the two", leg)
			}
		})
	}
}

// TestMooncakeResponsesPairOnlyWithOneRank: vLLM's Responses handler does
// not read X-Data-Parallel-Rank, so a Responses request's prefill leg to an
// engine of several ranks would run on any of them while its decode leg
// names one: it goes decode-only (unpaired_api), with no leg and no
// kv_transfer_params. An engine of one rank takes it P/D.
func TestMooncakeResponsesPairOnlyWithOneRank(t *testing.T) {
	tests := []struct {
		name, query string
		pd          bool
	}{
		{name: "one rank", query: `{"0":{"engine_id":"e-0"}}`, pd: true},
		{name: "two ranks", query: `{"0":{"engine_id":"e-0"},"1":{"engine_id":"e-1"}}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := startMooncake(t, tc.query, nil)
			_, d, _ := m.route(t, true) // the engine ids are read
			d.Release()
			enginetest.Receive(t, m.legs, "the chat request's prefill leg never reached its engine")
			r, d, params := m.routeTo(t, "/v1/responses", `{"model":"m","input":"hi","max_output_tokens":64}`, tc.pd)
			d.Release()
			if tc.pd {
				leg := enginetest.Receive(t, m.legs, "the prefill leg never reached its engine")
				if r.Report.Mode != metrics.ModePD || params["transfer_id"] != leg.params.TransferID {
					t.Errorf("%s %s with kv_transfer_params %v, leg %+v; want P/D with the leg's transfer id", r.Report.Mode, r.Report.Reason, params, leg)
				}
				return
			}
			if r.Report.Mode != metrics.ModeDecodeOnly || r.Report.Reason != metrics.ReasonUnpairedAPI || params != nil || r.Report.Prefill != "" {
				t.Errorf("%s %s, prefill %q, kv_transfer_params %v; want decode-only, unpaired_api, no prefill, none",
					r.Report.Mode, r.Report.Reason, r.Report.Prefill, params)
			}
			select {
			case leg := <-m.legs:
				t.Errorf("a prefill leg %+v was sent", leg)
			default:
			}
		})
	}
}

// TestMooncakePrefillIsJudgedByItsDecode: a Mooncake prefill engine answers
// 200 once it computed the prompt; whether it served is its decode engine's
// pull. Three requests whose decode engine failed eject the prefill
// endpoint whichever of the two outcomes came first; three that it served
// do not.
func TestMooncakePrefillIsJudgedByItsDecode(t *testing.T) {
	for _, tc := range []struct {
		name        string
		status      int  // the decode engine's
		decodeFirst bool // its outcome reported before the prefill leg ends
		ejected     bool
	}{
		{"the decode engine fails its pull", 500, false, true},
		{"the decode engine fails before the prefill engine answered", 500, true, true},
		{"the decode engine serves", 200, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hold := make(chan struct{})
			m := startMooncake(t, `{"0":{"engine_id":"e-0"}}`, hold)
			for range 3 {
				_, d, _ := m.route(t, true)
				enginetest.Receive(t, m.legs, "the prefill leg never reached its engine")
				if tc.decodeFirst {
					d.Observe(tc.status, false)
					d.Release()
				}
				hold <- struct{}{}
				m.p.Wait() // the leg has ended
				if !tc.decodeFirst {
					d.Observe(tc.status, false)
					d.Release()
				}
			}
			m.p.Wait()
			prefill, _ := m.p.Pools()
			if healthy := prefill.Endpoints()[0].Healthy(); healthy == tc.ejected {
				t.Errorf("prefill endpoint healthy = %v after three such requests, want %v", healthy, !tc.ejected)
			}
		})
	}
}

// kv-mooncake's decode engine can compute a prompt itself, so a request for
// which no prefill endpoint can be claimed goes as prefill.on_failure says
// (decode-only by default), as a sequential connector's does: here a pool of
// two models whose second engine has not told its engine ids (its bootstrap
// server unreachable), while the first's let the decision be P/D. It was
// answered 503 "no healthy prefill endpoint: prefill.on_failure is fail".
func TestMooncakeWithoutALegFollowsOnFailure(t *testing.T) {
	engine := func(model string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && r.URL.Path == "/v1/models" {
				enginetest.JSON(200, `{"object":"list","data":[{"id":"`+model+`","object":"model"}]}`)(w, r)
				return
			}
			io.Copy(io.Discard, r.Body)
			w.Write([]byte(`{"choices":[]}`))
		}
	}
	listen := func(addr string, h http.HandlerFunc) string {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			t.Skip(err) // no second loopback address
		}
		s := httptest.NewUnstartedServer(h)
		s.Listener.Close()
		s.Listener = l
		s.Start()
		t.Cleanup(s.Close)
		return l.Addr().String()
	}
	a, b := listen("127.0.0.1:0", engine("a")), listen("127.0.0.2:0", engine("b"))
	boot := listen("127.0.0.1:0", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte(`{"0":{"engine_id":"e-0"}}`)) })
	_, port, _ := net.SplitHostPort(boot) // nothing listens there on 127.0.0.2: b has no ids
	// The pools ask the decode endpoint for its models: port 1 of loopback refuses.
	p, _, _ := newPipeline(t, fmt.Sprintf(`connector: kv-mooncake
pools: {prefill: {endpoints: [%q, %q], bootstrap_port: %s}, decode: {endpoints: ["127.0.0.1:1"]}}`, a, b, port))
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { p.Run(ctx); close(ran) }()
	t.Cleanup(func() { cancel(); <-ran; p.Wait() })
	route := func(model string) (*pipeline.Request, error) {
		r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: "r",
			Body: []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]}`)}
		d, err := p.Route(context.Background(), r)
		d.Release()
		return r, err
	}
	until := func(what string, ok func() (bool, string)) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			done, last := ok()
			if done {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: last %s", what, last)
			}
		}
	}
	until("model a routed P/D", func() (bool, string) {
		r, err := route("a")
		return err == nil && r.Report.Mode == metrics.ModePD, fmt.Sprint(err, r.Report)
	})
	until("model b routed decode-only as prefill.on_failure says", func() (bool, string) {
		r, err := route("b")
		return err == nil && r.Report.Mode == metrics.ModeDecodeOnly && r.Report.Reason == metrics.ReasonPrefillFailed, fmt.Sprint(err, r.Report)
	})
}
