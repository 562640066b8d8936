package pipeline_test

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// A client can eject no prefill endpoint with requests no engine could
// serve: a leg net/http refuses to send (a control byte in a header) and an
// engine's redirect say nothing of its health. A 5xx still does, and so does
// an engine that never answers within prefill.timeout (its attempt having
// the whole phase, attempt_timeout left at its default).
func TestOnlyTheEndpointsOwnFailuresEjectIt(t *testing.T) {
	tests := []struct {
		name       string
		answer     http.HandlerFunc
		requestID  string
		auth       string
		wantReason metrics.Failure
		wantStatus int  // the client's under on_failure=fail; 0: decode-only under decode-only too
		failStatus int  // the client's under on_failure=fail when wantStatus is 0 (0: 502)
		ejected    bool // after three requests
	}{
		{name: "a control byte in the request id", answer: enginetest.JSON(200, `{}`), requestID: "r\x01", wantReason: metrics.FailureNotSent, wantStatus: 400},
		{name: "a newline in Authorization", answer: enginetest.JSON(200, `{}`), requestID: "r1", auth: "Bearer a\nb",
			wantReason: metrics.FailureNotSent, wantStatus: 400},
		{name: "a redirect", answer: func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, "http://203.0.113.9/", http.StatusTemporaryRedirect)
		},
			requestID: "r1", wantReason: metrics.FailureRedirect},
		{name: "a 5xx", answer: enginetest.JSON(503, `{}`), requestID: "r1", wantReason: metrics.FailureStatus5xx, ejected: true},
		{name: "a 200 that is not JSON (a proxy's page)", answer: enginetest.JSON(200, `<html>upstream connect error</html>`),
			requestID: "r1", wantReason: metrics.FailureMalformed, ejected: true},
		{name: "a 429: busy, not broken", answer: enginetest.JSON(429, `{"error":"too many requests"}`),
			requestID: "r1", wantReason: metrics.FailureOverloaded, failStatus: 503},
		{name: "a 404 for a model (an adapter) it does not serve", answer: enginetest.JSON(404, unservedModel),
			requestID: "r1", wantReason: metrics.FailureNotFound, failStatus: 404},
		{name: "no answer within prefill.timeout", answer: func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() },
			requestID: "r1", wantReason: metrics.FailureTimeout, failStatus: 503, ejected: true},
	}
	for _, tt := range tests {
		for _, onFailure := range []string{config.OnFailureDecodeOnly, config.OnFailureFail} {
			t.Run(tt.name+"/"+onFailure, func(t *testing.T) {
				engine := enginetest.Start(t, tt.answer)
				p, m, _ := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {on_failure: %s, attempts: 1, timeout: 100ms}`, engine.Addr(), onFailure))
				for range 3 {
					r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: tt.requestID,
						Body: []byte(`{"model":"m","prompt":"hi"}`), Forward: http.Header{}}
					if tt.auth != "" {
						r.Forward.Set("Authorization", tt.auth)
					}
					d, err := p.Route(context.Background(), r)
					want := tt.wantStatus
					if want == 0 && onFailure == config.OnFailureFail {
						want = cmp.Or(tt.failStatus, 502)
					}
					switch {
					case want == 0 && err != nil:
						t.Fatalf("Route: %v, want decode-only", err)
					case want != 0 && (err == nil || pipeline.AsError(err, "r").Status != want):
						t.Fatalf("Route: %v, want %d", err, want)
					}
					d.Release()
				}
				if got := counter(t, m, "pd_extproc_prefill_failures_total", "reason", tt.wantReason.String()); got != 3 {
					t.Errorf("prefill_failures_total{reason=%q} = %v, want 3", tt.wantReason, got)
				}
				prefill, _ := p.Pools()
				if healthy := prefill.Endpoints()[0].Healthy(); healthy == tt.ejected {
					t.Errorf("prefill endpoint healthy = %v after three such requests, want %v", healthy, !tt.ejected)
				}
				if tt.wantReason == metrics.FailureNotSent && len(engine.Requests()) != 0 {
					t.Errorf("the engine received %d legs net/http was to refuse", len(engine.Requests()))
				}
			})
		}
	}
}

// TestAFailedLegKeepsTheQueryOutOfTheLog: a prefill leg that fails at the
// transport, or that net/http cannot make (a control character in the
// query), is logged, and its error kept for the request's log line,
// without the client's query: it may carry a credential (?api_key=), and
// Go's errors quote the whole URL.
func TestAFailedLegKeepsTheQueryOutOfTheLog(t *testing.T) {
	for _, tc := range []struct{ name, path string }{
		{"unreachable", "/v1/completions?api_key=sk-s3cret"},
		{"not a URL", "/v1/completions?api_key=sk-s3cret&x=\x7f"},
	} {
		for _, onFailure := range []string{config.OnFailureDecodeOnly, config.OnFailureFail} {
			t.Run(tc.name+"/"+onFailure, func(t *testing.T) {
				p, _, lines := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: ["127.0.0.1:1"]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {on_failure: %s}`, onFailure))
				d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: tc.path, RequestID: "r1",
					Body: []byte(`{"model":"m","prompt":"hi"}`)})
				detail := ""
				if err == nil {
					d.Release()
				} else {
					detail = pipeline.AsError(err, "r1").Detail // what the request's log line will say
				}
				if lines.count("127.0.0.1:1") == 0 && !strings.Contains(detail, "127.0.0.1:1") {
					t.Fatalf("the failed leg is neither logged nor kept for the log (%q): the test shows nothing", detail)
				}
				if n := lines.count("sk-s3cret"); n != 0 || strings.Contains(detail, "sk-s3cret") {
					t.Errorf("the query's credential is in %d log lines, or in the error kept for the log: %q", n, detail)
				}
			})
		}
	}
}

type panicking struct{}

func (panicking) RoundTrip(*http.Request) (*http.Response, error) {
	panic("a bug under the prefill leg")
}

// TestAPanicUnderThePrefillLegFreesItsSlots: a bug that panics while the
// prefill leg runs (recovered by the handler, which fails the stream)
// leaves no endpoint holding the request: a prefill slot stayed taken for
// good, skewing least-load, and a half-open endpoint's probe with it.
func TestAPanicUnderThePrefillLegFreesItsSlots(t *testing.T) {
	p, _, _ := newPipeline(t, `connector: kv-nixl
pools: {prefill: {endpoints: ["10.0.0.1:8000"]}, decode: {endpoints: ["10.1.1.1:8000"]}}`)
	pipeline.WrapTransport(p, func(http.RoundTripper) http.RoundTripper { return panicking{} })
	func() {
		defer func() {
			if recover() == nil {
				t.Error("no panic: the test shows nothing")
			}
		}()
		_, _ = p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: "r", Body: []byte(`{"model":"m","prompt":"hi"}`)})
	}()
	prefill, decode := p.Pools()
	for _, e := range append(prefill.Endpoints(), decode.Endpoints()...) {
		if n := e.InFlight(); n != 0 {
			t.Errorf("%s holds %d requests after the panic, want 0", e.Addr, n)
		}
	}
}

// TestSGLangBatchAnswersAreNoFailures: SGLang answers a batch /generate (text
// or input_ids a list) with a JSON array, one answer per prompt. Under
// kv-sglang, whose legs hand nothing back, that is a served leg, not a
// malformed one: counting it would eject healthy prefill engines, and
// kv-sglang has no decode-only to fall back on. What is not JSON stays a
// failure; under kv-nixl, whose params must be read, so does an array.
func TestSGLangBatchAnswersAreNoFailures(t *testing.T) {
	const batch = `[{"text":"a","meta_info":{}},{"text":"b","meta_info":{}}]`
	tests := []struct {
		name, connector, path, body, answer string
		failed                              bool
	}{
		{"a batch of texts", "kv-sglang", "/generate", `{"text":["hello","world"],"sampling_params":{"max_new_tokens":8}}`, batch, false},
		{"a batch of token ids", "kv-sglang", "/generate", `{"input_ids":[[1,2],[3,4]]}`, batch, false},
		{"a proxy's page", "kv-sglang", "/generate", `{"text":"hello"}`, `<html>upstream connect error</html>`, true},
		{"an array to kv-nixl", "kv-nixl", "/v1/completions", `{"model":"m","prompt":"hi"}`, batch, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			engine := enginetest.Start(t, enginetest.JSON(200, tt.answer))
			p, m, _ := newPipeline(t, fmt.Sprintf(`connector: %s
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {attempts: 1}`, tt.connector, engine.Addr()))
			for range 3 {
				d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: tt.path, RequestID: "r",
					Body: []byte(tt.body)})
				if err != nil {
					if !tt.failed {
						t.Fatalf("Route: %v", err)
					}
					continue
				}
				d.Release()
				p.Wait()
			}
			got := counter(t, m, "pd_extproc_prefill_failures_total", "reason", metrics.FailureMalformed.String())
			if want := map[bool]float64{true: 3}[tt.failed]; got != want {
				t.Errorf("prefill_failures_total{reason=malformed} = %v, want %v", got, want)
			}
			prefill, _ := p.Pools()
			if healthy := prefill.Endpoints()[0].Healthy(); healthy == tt.failed {
				t.Errorf("prefill endpoint healthy = %v after three such answers, want %v", healthy, !tt.failed)
			}
		})
	}
}

// TestFailClosedRefusesWhenNoPrefillEndpointIsReady: once its failures have
// ejected the only prefill endpoint, prefill.on_failure fail answers 503
// with Retry-After, as it answered the failures themselves, rather than
// having the decode engine compute the prompt (no_prefill) until the
// ejection ends; decode-only goes decode-only.
func TestFailClosedRefusesWhenNoPrefillEndpointIsReady(t *testing.T) {
	for _, onFailure := range []string{config.OnFailureFail, config.OnFailureDecodeOnly} {
		t.Run(onFailure, func(t *testing.T) {
			engine := enginetest.Start(t, enginetest.JSON(503, `{}`))
			p, _, _ := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {on_failure: %s, attempts: 1}`, engine.Addr(), onFailure))
			var r *pipeline.Request
			route := func() error {
				r = &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: "r", Body: []byte(`{"model":"m","prompt":"hi"}`)}
				d, err := p.Route(context.Background(), r)
				if err == nil {
					d.Release()
				}
				return err
			}
			for range 3 { // consecutive_failures: the endpoint is ejected
				route()
			}
			err := route()
			if onFailure == config.OnFailureDecodeOnly {
				if err != nil || r.Report.Reason != metrics.ReasonNoPrefill {
					t.Fatalf("Route: %v; want decode-only, reason no_prefill", err)
				}
				return
			}
			e := pipeline.AsError(err, "r")
			if err == nil || e.Status != http.StatusServiceUnavailable || e.RetryAfter == 0 || !strings.Contains(e.Message, "prefill.on_failure is fail") {
				t.Fatalf("Route: %v (%+v); want 503 with Retry-After naming prefill.on_failure", err, e)
			}
		})
	}
}

// TestBusyPrefillEnginesSayWhenToRetry: under prefill.on_failure fail, an
// engine's 429 is a 503 that says the engines are busy (they answered), with
// the engine's Retry-After, in seconds or as a date, when it gave one.
func TestBusyPrefillEnginesSayWhenToRetry(t *testing.T) {
	tests := []struct {
		name, header string
		want         time.Duration
	}{
		{"seconds", "7", 7 * time.Second},
		{"a date", time.Now().Add(90 * time.Second).UTC().Format(http.TimeFormat), 90 * time.Second},
		{"none", "", 0},
		{"not a duration", "soon", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			engine := enginetest.Start(t, func(w http.ResponseWriter, _ *http.Request) {
				if tt.header != "" {
					w.Header().Set("Retry-After", tt.header)
				}
				w.WriteHeader(http.StatusTooManyRequests)
			})
			p, _, _ := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {on_failure: fail, attempts: 1}`, engine.Addr()))
			_, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: "r",
				Body: []byte(`{"model":"m","prompt":"hi"}`)})
			e := pipeline.AsError(err, "r")
			if err == nil || e.Status != http.StatusServiceUnavailable || !strings.Contains(e.Message, "busy") {
				t.Fatalf("Route: %v (%+v); want 503 saying the engines are busy", err, e)
			}
			if d := e.RetryAfter - tt.want; d < -2*time.Second || d > 2*time.Second || (tt.want == 0) != (e.RetryAfter == 0) {
				t.Errorf("Retry-After %v, want %v", e.RetryAfter, tt.want)
			}
		})
	}
}

// unservedModel is vLLM's answer for a model or LoRA adapter it does not
// serve (OpenAIServing._check_model, vllm/entrypoints/openai/engine/serving.py).
const unservedModel = `{"error":{"message":"The model ` + "`sql-lora`" + ` does not exist.","type":"NotFoundError","param":"model","code":404}}`

// TestAnAdapterMissingOnOnePrefillEngineIsTakenElsewhere: a LoRA adapter
// loaded at run time on some prefill engines, or lost by one in a restart.
// The engine without it answers 404; another prefill endpoint takes the leg,
// and none is ejected. Where no engine has it, the decode engine is asked
// alone (it answers for itself) or, under on_failure fail, the client gets
// the engine's 404.
func TestAnAdapterMissingOnOnePrefillEngineIsTakenElsewhere(t *testing.T) {
	lacking := enginetest.Start(t, enginetest.JSON(404, unservedModel))
	serving := enginetest.Start(t, enginetest.JSON(200, `{"choices":[{"text":"x"}],"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[1],"remote_host":"10.0.0.9","remote_port":5600}}`))
	p, m, _ := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q, %q], policy: round-robin}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {attempts: 2}
pd: {mode: always}`, lacking.Addr(), serving.Addr()))
	for i := range 4 {
		r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: fmt.Sprint("r", i),
			Body: []byte(`{"model":"sql-lora","prompt":"hi"}`)}
		d, err := p.Route(context.Background(), r)
		if err != nil {
			t.Fatalf("request %d: %v, want it prefilled on the engine that serves the adapter", i, err)
		}
		if r.Report.Mode != metrics.ModePD || r.Report.Prefill != serving.Addr() {
			t.Errorf("request %d: mode %v, prefill %s; want P/D on %s", i, r.Report.Mode, r.Report.Prefill, serving.Addr())
		}
		d.Release()
	}
	if got := counter(t, m, "pd_extproc_prefill_failures_total", "reason", "not_found"); got == 0 {
		t.Error("no attempt failed not_found: the test showed nothing")
	}
	prefill, _ := p.Pools()
	for _, e := range prefill.Endpoints() {
		if !e.Healthy() {
			t.Errorf("%s was ejected for an adapter it does not serve", e.Addr)
		}
	}
}

// TestAModelNoEngineServesIsNoPrefillFailure: a name no prefill engine
// serves (a client's typo) goes to the decode engine alone, which answers
// for itself, as reason unserved_model: not a prefill failure that would
// raise the fallback alert, nor a log line per request at the default
// verbosity.
func TestAModelNoEngineServesIsNoPrefillFailure(t *testing.T) {
	a, b := enginetest.Start(t, enginetest.JSON(404, unservedModel)), enginetest.Start(t, enginetest.JSON(404, unservedModel))
	p, _, lines := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q, %q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
pd: {mode: always}`, a.Addr(), b.Addr()))
	for i := range 4 {
		r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: fmt.Sprint("r", i), Body: []byte(`{"model":"gpt-4","prompt":"hi"}`)}
		d, err := p.Route(context.Background(), r)
		if err != nil || r.Report.Mode != metrics.ModeDecodeOnly || r.Report.Reason != metrics.ReasonUnservedModel {
			t.Fatalf("request %d: %v, mode %v, reason %v; want decode-only, unserved_model", i, err, r.Report.Mode, r.Report.Reason)
		}
		d.Release()
	}
	if n := lines.count("prefill failed"); n != 0 {
		t.Errorf("%d log lines say the prefill failed", n)
	}
}

// TestALegThatWaitedForAConnectionBlamesNoEngine: with every connection
// prefill.max_conns_per_endpoint allows to an engine busy, a leg waits for
// one; a leg whose time runs out while it waits never reached the engine,
// which is busy serving, not broken. It fails as a timeout, but does not
// eject the engine: that would send its load to the others, or decode-only.
func TestALegThatWaitedForAConnectionBlamesNoEngine(t *testing.T) {
	tests := []struct{ connector, path, body string }{
		{"kv-nixl", "/v1/completions", `{"model":"m","prompt":"hi"}`},
		{"kv-sglang", "/generate", `{"text":"hi"}`},
	}
	for _, tt := range tests {
		t.Run(tt.connector, func(t *testing.T) {
			release := make(chan struct{})
			engine := enginetest.Start(t, func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/hold" {
					<-release
				}
				enginetest.JSON(200, `{}`)(w, r)
			})
			p, m, _ := newPipeline(t, fmt.Sprintf(`connector: %s
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000"]}}
prefill: {attempts: 1, timeout: 100ms, max_conns_per_endpoint: 1}`, tt.connector, engine.Addr()))
			var transport http.RoundTripper
			pipeline.WrapTransport(p, func(rt http.RoundTripper) http.RoundTripper { transport = rt; return rt })
			held := make(chan error, 1)
			go func() { // takes the one connection, until released
				req, _ := http.NewRequest(http.MethodGet, engine.URL+"/hold", nil)
				resp, err := transport.RoundTrip(req)
				if err == nil {
					resp.Body.Close()
				}
				held <- err
			}()
			engine.Await(t)
			for range 3 {
				d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: tt.path, RequestID: "r",
					Body: []byte(tt.body)})
				if err == nil {
					d.Release()
				}
				p.Wait()
			}
			close(release)
			if err := enginetest.Receive(t, held, "the held request never ended"); err != nil {
				t.Fatal(err)
			}
			if got := counter(t, m, "pd_extproc_prefill_failures_total", "reason", metrics.FailureTimeout.String()); got != 3 {
				t.Errorf("prefill_failures_total{reason=timeout} = %v, want 3", got)
			}
			if got := len(engine.Requests()); got != 1 {
				t.Errorf("the engine received %d requests, want only the one that held its connection", got)
			}
			prefill, _ := p.Pools()
			if e := prefill.Endpoints()[0]; !e.Healthy() || e.Ejections() != 0 {
				t.Errorf("prefill endpoint healthy = %v, ejections %d, after three legs that never reached it; want healthy, none",
					e.Healthy(), e.Ejections())
			}
		})
	}
}
