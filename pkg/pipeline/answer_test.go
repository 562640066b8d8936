package pipeline_test

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/server/assemble"

	"github.com/go-logr/logr/funcr"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// newPipeline builds a pipeline from yaml with its own metrics and a logger
// that keeps its lines; its idle connections close with the test.
func newPipeline(t *testing.T, yaml string) (*pipeline.Pipeline, *metrics.Metrics, *logLines) {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	m := metrics.New(cfg.Connector)
	lines := &logLines{}
	p, err := assemble.Pipeline(cfg, funcr.New(lines.add, funcr.Options{}), pipeline.WithMetrics(m))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pipeline.CloseIdle(p) })
	return p, m, lines
}

type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) add(prefix, args string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, prefix+" "+args)
}

func (l *logLines) count(substr string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, s := range l.lines {
		if strings.Contains(s, substr) {
			n++
		}
	}
	return n
}

// counter reads one series of a counter, labelled label=value (none when label is "").
func counter(t *testing.T, m *metrics.Metrics, name, label, value string) float64 {
	t.Helper()
	labels := map[string]string{}
	if label != "" {
		labels[label] = value
	}
	v, ok := m.Sample(name, labels)
	if !ok {
		t.Fatalf("no series %s{%s=%q}", name, label, value)
	}
	return v
}

// vLLM's answers with --enable-prompt-tokens-details: the prefill engine
// found 8 of the prompt's 12 tokens in its prefix cache; the decode engine
// counts the 12 it pulled.
const (
	decodeAnswer = `{"id":"x","choices":[{"index":0,"text":" a b"}],"usage":{"prompt_tokens":12,"total_tokens":14,"completion_tokens":2,` +
		`"prompt_tokens_details":{"cached_tokens":12}},"kv_transfer_params":null}`
	prefillParams = `"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1]],"remote_engine_id":"e","remote_request_id":"r",` +
		`"remote_host":"10.0.0.9","remote_port":5600}`
)

func prefillAnswerWith(usage string) string {
	return `{"id":"p","choices":[{"index":0,"text":" a"}],"usage":` + usage + `,` + prefillParams + `}`
}

// messagesAnswerWith is an Anthropic Messages answer with this usage, and
// the prefill engine's params.
func messagesAnswerWith(usage string) string {
	return `{"id":"p","type":"message","content":[{"type":"text","text":"a"}],"usage":` + usage + `,` + prefillParams + `}`
}

func TestUsageRewriteTakesThePrefillEnginesCachedTokens(t *testing.T) {
	withCached := prefillAnswerWith(`{"prompt_tokens":12,"total_tokens":13,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":8}}`)
	tests := []struct {
		name      string
		connector string
		path      string
		settings  string // more top-level config
		prefill   string // the prefill engine's answer
		status    int    // its status; 0: 200
		decode    string // the decode engine's answer; "": decodeAnswer
		want      string // the decode answer as the client gets it; "" when it is not rewritten
		missing   bool   // the prefill engine's answer stated no cached tokens (Report.UsageMissing)
	}{
		{name: "kv-nixl completions", connector: "kv-nixl", path: "/v1/completions", prefill: withCached,
			want: strings.Replace(decodeAnswer, `"cached_tokens":12`, `"cached_tokens":8`, 1)},
		{name: "kv-nixl chat", connector: "kv-nixl", path: "/v1/chat/completions", prefill: withCached,
			want: strings.Replace(decodeAnswer, `"cached_tokens":12`, `"cached_tokens":8`, 1)},
		{name: "kv-shared-storage, none cached", connector: "kv-shared-storage", path: "/v1/completions",
			prefill: `{"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":0}}}`,
			want:    strings.Replace(decodeAnswer, `"cached_tokens":12`, `"cached_tokens":0`, 1)},
		{name: "no details: vLLM's cold prompt", connector: "kv-nixl", path: "/v1/completions",
			prefill: prefillAnswerWith(`{"prompt_tokens":12,"total_tokens":13,"completion_tokens":1}`),
			want:    strings.Replace(decodeAnswer, `"cached_tokens":12`, `"cached_tokens":0`, 1)},
		{name: "null details", connector: "kv-nixl", path: "/v1/chat/completions",
			prefill: prefillAnswerWith(`{"prompt_tokens":12,"prompt_tokens_details":null}`),
			want:    strings.Replace(decodeAnswer, `"cached_tokens":12`, `"cached_tokens":0`, 1)},
		{name: "no usage", connector: "kv-nixl", path: "/v1/completions",
			prefill: `{"id":"p","choices":[{"index":0,"text":" a"}],` + prefillParams + `}`, missing: true},
		{name: "null usage", connector: "kv-nixl", path: "/v1/completions",
			prefill: `{"id":"p","usage":null,` + prefillParams + `}`, missing: true},
		{name: "details without a count", connector: "kv-nixl", path: "/v1/completions",
			prefill: prefillAnswerWith(`{"prompt_tokens":12,"prompt_tokens_details":{}}`), missing: true},
		{name: "a placeholder is not a count", connector: "kv-nixl", path: "/v1/completions",
			prefill: prefillAnswerWith(`{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":-1}}`), missing: true},
		// Anthropic's usage leaves the cached tokens out of input_tokens: the
		// two are rewritten together (vllm-project/vllm#40912).
		{name: "messages", connector: "kv-nixl", path: "/v1/messages",
			prefill: messagesAnswerWith(`{"input_tokens":4,"output_tokens":1,"cache_creation_input_tokens":0,"cache_read_input_tokens":8}`),
			decode:  messagesAnswerWith(`{"input_tokens":0,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":12}`),
			want:    messagesAnswerWith(`{"input_tokens":4,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":8}`)},
		{name: "messages, none cached: no cache fields", connector: "kv-nixl", path: "/v1/messages",
			prefill: messagesAnswerWith(`{"input_tokens":12,"output_tokens":1}`),
			decode:  messagesAnswerWith(`{"input_tokens":0,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":12}`),
			want:    messagesAnswerWith(`{"input_tokens":12,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":0}`)},
		{name: "messages, the cached count alone", connector: "kv-nixl", path: "/v1/messages",
			prefill: messagesAnswerWith(`{"output_tokens":1,"cache_read_input_tokens":8}`), missing: true},
		{name: "rewrite_usage off", connector: "kv-nixl", path: "/v1/completions", settings: "response: {rewrite_usage: false}", prefill: withCached},
		{name: "decode-only after a failed prefill", connector: "kv-nixl", path: "/v1/completions", prefill: withCached, status: 503},
		{name: "decode-only by pd.mode", connector: "kv-nixl", path: "/v1/completions", settings: "pd: {mode: never}", prefill: withCached},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			engine := enginetest.Start(t, enginetest.JSON(max(tt.status, 200), tt.prefill))
			settings := cmp.Or(tt.settings, "response: {rewrite_usage: true}")
			p, _, _ := newPipeline(t, fmt.Sprintf("connector: %s\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [\"10.1.1.1:8000\"]}}\nprefill: {attempts: 1}\n%s\n",
				tt.connector, engine.Addr(), settings))
			r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: tt.path, RequestID: "r1",
				Body: []byte(`{"model":"m","prompt":"hi","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`)}
			d, err := p.Route(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Release()
			if (d.Rewrite != nil) != (tt.want != "") {
				t.Fatalf("Rewrite = %v, want one: %v", d.Rewrite, tt.want != "")
			}
			if d.Rewrite != nil {
				d.Rewrite.Start(200, "application/json", "")
				if got := string(d.Rewrite.Body([]byte(cmp.Or(tt.decode, decodeAnswer)), true).Bytes()); got != tt.want {
					t.Errorf("the client gets\n  %s\nwant\n  %s", got, tt.want)
				}
			}
			if r.Report.UsageMissing != tt.missing {
				t.Errorf("Report.UsageMissing = %v, want %v", r.Report.UsageMissing, tt.missing)
			}
		})
	}
}

// A prefill engine left with VLLM_NIXL_SIDE_CHANNEL_HOST at its default hands
// out remote_host localhost: a decode engine on another host cannot pull, and
// under vLLM's default kv_load_failure_policy fails the request with a 500.
// That 500 is the prefill engine's doing: it must not eject the decode
// endpoint, which serves every other request.
func TestUnreachableRemoteHostIsCountedAndLoggedOncePerEndpoint(t *testing.T) {
	tests := []struct {
		remoteHost string
		decode     string // the decode endpoint
		suspect    bool
	}{
		{"localhost", "10.1.1.1:8000", true},
		{"LocalHost", "10.1.1.1:8000", true},
		{"127.0.0.1", "10.1.1.1:8000", true},
		{"127.0.1.1", "10.1.1.1:8000", true},
		{"0.0.0.0", "10.1.1.1:8000", true},
		{"::1", "[fd00::2]:8000", true},
		{"[::]", "10.1.1.1:8000", true},
		{"::ffff:127.0.0.1", "10.1.1.1:8000", true},
		{"10.0.0.9", "10.1.1.1:8000", false},
		{"prefill-0.engines.svc", "10.1.1.1:8000", false},
		// The decode engine runs on the prefill engine's host (loopback here):
		// localhost is the same machine for both.
		{"localhost", "127.0.0.1:9", false},
	}
	for _, tt := range tests {
		t.Run(tt.remoteHost+" to "+tt.decode, func(t *testing.T) {
			engine := enginetest.Start(t, enginetest.JSON(200, `{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1]],`+
				`"remote_engine_id":"e","remote_request_id":"r","remote_host":"`+tt.remoteHost+`","remote_port":5600}}`))
			p, m, lines := newPipeline(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q], health: {consecutive_failures: 3}}}\n",
				engine.Addr(), tt.decode))
			for i := range 3 {
				d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: fmt.Sprint("r", i), Body: []byte(`{"model":"m","prompt":"hi"}`)})
				if err != nil {
					t.Fatal(err)
				}
				d.Observe(http.StatusInternalServerError, false) // the decode engine's failed pull
				d.Release()
			}
			prefill, decode := p.Pools()
			if healthy := decode.Endpoints()[0].Healthy(); healthy != tt.suspect {
				t.Errorf("decode endpoint healthy = %v after three 500s, want %v (ejected only for its own failures)", healthy, tt.suspect)
			}
			if prefill.Endpoints()[0].Healthy() {
				t.Error("the prefill endpoint whose KV failed three pulls in a row is still healthy")
			}
			wantCount, wantLogs := 0.0, 0
			if tt.suspect {
				wantCount, wantLogs = 3, 1
			}
			if got := counter(t, m, "pd_extproc_kv_params_suspect_total", "", ""); got != wantCount {
				t.Errorf("kv_params_suspect_total = %v, want %v", got, wantCount)
			}
			if got := lines.count("VLLM_NIXL_SIDE_CHANNEL_HOST"); got != wantLogs {
				t.Errorf("%d warnings logged, want %d: %v", got, wantLogs, lines.lines)
			}
		})
	}
}

// A kv-shared-storage decode engine finds the prompt's KV in the store, and
// reads nothing a prefill answer names. Should that answer carry
// kv_transfer_params all the same, the prefill endpoint's health is still
// its own answer's, and the decode engine's 500s are its own: no remote
// host is checked, none counted or logged.
func TestASharedStoragePrefillIsJudgedByItsOwnAnswer(t *testing.T) {
	for _, remoteHost := range []string{"localhost", "10.0.0.9"} {
		t.Run(remoteHost, func(t *testing.T) {
			engine := enginetest.Start(t, enginetest.JSON(200, `{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1]],`+
				`"remote_engine_id":"e","remote_request_id":"r","remote_host":"`+remoteHost+`","remote_port":5600}}`))
			p, m, lines := newPipeline(t, fmt.Sprintf("connector: kv-shared-storage\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [\"10.1.1.1:8000\"]}}\n", engine.Addr()))
			for i := range 3 {
				r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: fmt.Sprint("r", i), Body: []byte(`{"model":"m","prompt":"hi"}`)}
				d, err := p.Route(context.Background(), r)
				if err != nil {
					t.Fatal(err)
				}
				if r.Report.Mode != metrics.ModePD {
					t.Fatalf("mode %v, want P/D", r.Report.Mode)
				}
				d.Observe(http.StatusInternalServerError, false)
				d.Release()
			}
			prefill, decode := p.Pools()
			if !prefill.Endpoints()[0].Healthy() {
				t.Error("the prefill endpoint, which answered 200 three times, was ejected for the decode engine's 500s")
			}
			if decode.Endpoints()[0].Healthy() {
				t.Error("the decode endpoint is still healthy after three 500s of its own")
			}
			if got := counter(t, m, "pd_extproc_kv_params_suspect_total", "", ""); got != 0 {
				t.Errorf("kv_params_suspect_total = %v, want 0", got)
			}
			if got := lines.count("VLLM_NIXL_SIDE_CHANNEL_HOST"); got != 0 {
				t.Errorf("%d warnings about the NIXL side channel logged, want none: %v", got, lines.lines)
			}
		})
	}
}

// A prefill engine answers 200 with kv_transfer_params, and the request
// fails only when the decode engine pulls them: a 5xx, or, on a stream that
// answered 200 already, an error event (vLLM's kv_load_failure_policy
// "fail"), here after a chat stream's role event. The prefill endpoint's health goes by that outcome, so an engine
// whose KV cannot be pulled is ejected instead of serving every third
// request to its death.
func TestThePairsOutcomeIsThePrefillEndpointsHealth(t *testing.T) {
	const (
		role  = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"
		tok   = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok0\"}}]}\n\n"
		fail  = enginetest.StreamError
		done  = "data: [DONE]\n\n"
		never = -1 // Envoy's response path is off: no status comes
	)
	tests := []struct {
		name   string
		status int
		stream []string // the answer's chunks, when it is an event stream Envoy sends
		// What the three requests told each endpoint's health: served (a
		// success), failed, or nothing.
		prefill, decode string
		// fallbacks: pools.decode.fallbacks is 1.
		fallbacks bool
		// served is the endpoint the gateway reports serving each request
		// (Decision.ServedBy): "pick", "mapped" (the pick, its IPv4 address
		// spelt in IPv6), or "" for none.
		served string
	}{
		{"the decode engine answers 200", 200, nil, "served", "served", false, ""},
		{"it answers 500", 500, nil, "failed", "failed", false, ""},
		{"a stream that ends whole", 200, []string{role, tok, done}, "served", "served", false, ""},
		{"a stream that ends in an error event, cut across chunks", 200, []string{role + fail[:20], fail[20:] + done}, "failed", "failed", false, ""},
		{"a stream whose client left after its first token", 200, []string{role, tok}, "served", "served", false, ""},
		{"a stream whose client left before", 200, []string{role}, "served", "served", false, ""},
		{"a 4xx: the request's fault", 400, nil, "served", "served", false, ""},
		{"no response path: the prefill engine answered", never, nil, "served", "nothing", false, ""},
		// A pull of blocks handed out is offered its pick alone, whose answer it is.
		{"a 500 with a fallback configured", 500, nil, "failed", "failed", true, ""},
		{"a 200 with a fallback configured", 200, nil, "served", "served", true, ""},
		{"a 500 with a fallback configured, from the pick", 500, nil, "failed", "failed", true, "pick"},
		{"a 500 with a fallback configured, from the pick spelt in IPv6", 500, nil, "failed", "failed", true, "mapped"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			engine := enginetest.Start(t, enginetest.JSON(200, `{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1]],`+
				`"remote_engine_id":"e","remote_request_id":"r","remote_host":"10.0.0.9","remote_port":5600}}`))
			decodePool := `{endpoints: ["10.1.1.1:8000"]}`
			if tt.fallbacks {
				decodePool = `{endpoints: ["10.1.1.1:8000", "10.1.1.2:8000"], fallbacks: 1}`
			}
			p, _, _ := newPipeline(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: %s}\n", engine.Addr(), decodePool))
			prefill, decode := p.Pools()
			pe := prefill.Endpoints()[0]
			for _, e := range append([]*scheduling.Endpoint{pe, pe}, slices.Concat(decode.Endpoints(), decode.Endpoints())...) { // two of the three failures that eject
				e.ReportFailure()
			}
			picked := map[string]bool{}
			for i := range 3 {
				d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/chat/completions", RequestID: fmt.Sprint("r", i), Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)})
				if err != nil {
					t.Fatal(err)
				}
				picked[d.Endpoints[0]] = true
				served := map[string]string{"pick": d.Endpoints[0],
					"mapped": "[::ffff:" + strings.TrimSuffix(d.Endpoints[0], ":8000") + "]:8000"}[tt.served]
				if !d.ServedBy(served) {
					t.Errorf("ServedBy(%q) says it was not offered: %q", served, d.Endpoints)
				}
				if tt.status != never {
					d.Observe(tt.status, tt.stream != nil)
				}
				for _, chunk := range tt.stream {
					d.Watch([]byte(chunk))
				}
				d.Release()
			}
			told := func(e *scheduling.Endpoint) string {
				if !e.Healthy() {
					return "failed"
				}
				if e.ReportFailure(); !e.Healthy() { // the third failure in a row
					return "nothing"
				}
				return "served"
			}
			if got := told(pe); got != tt.prefill {
				t.Errorf("the prefill endpoint was told %s, want %s", got, tt.prefill)
			}
			for _, de := range decode.Endpoints() {
				want := tt.decode
				if !picked[de.Addr] {
					want = "nothing"
				}
				if got := told(de); got != want {
					t.Errorf("decode endpoint %s was told %s, want %s", de.Addr, got, want)
				}
			}
		})
	}
}

// A prefill endpoint back from an ejection takes one probe. Its leg ends at
// its 200, but its verdict comes with the decode engine's answer: until then
// the endpoint takes no other request, which would otherwise all go to an
// engine whose KV cannot be pulled before the probe's failure is known.
func TestAProbeHoldsThePrefillEndpointUntilThePairsVerdict(t *testing.T) {
	engine := enginetest.Start(t, enginetest.JSON(200, `{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1]],`+
		`"remote_engine_id":"e","remote_request_id":"r","remote_host":"10.0.0.9","remote_port":5600}}`))
	p, _, _ := newPipeline(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q], health: {consecutive_failures: 1, base_ejection: 1ms}}, "+
		"decode: {endpoints: [\"10.1.1.1:8000\", \"10.1.1.2:8000\"]}}\n", engine.Addr()))
	prefill, _ := p.Pools()
	route := func(id string) (*pipeline.Decision, *pipeline.Request) {
		r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: id, Body: []byte(`{"model":"m","prompt":"hi"}`)}
		d, err := p.Route(context.Background(), r)
		if err != nil {
			t.Fatal(err)
		}
		return d, r
	}
	d, _ := route("r0")
	d.Observe(http.StatusInternalServerError, false) // the pull failed: ejected for 1ms
	d.Release()
	deadline := time.Now().Add(10 * time.Second)
	for !prefill.Endpoints()[0].Healthy() { // the ejection runs out: half-open
		if time.Now().After(deadline) {
			t.Fatal("the prefill endpoint never came back from its ejection")
		}
		time.Sleep(5 * time.Millisecond) // polling the condition, not waiting it out
	}
	defer pipeline.SetProbeVerdictWait(time.Second)()
	probe, r := route("r1")
	if r.Report.Mode != metrics.ModePD {
		t.Fatalf("the probe went %s, want P/D", r.Report.Mode)
	}
	if prefill.Endpoints()[0].Healthy() {
		t.Error("the prefill endpoint takes requests while its probe's verdict is pending")
	}
	d, r = route("r2")
	if r.Report.Mode != metrics.ModeDecodeOnly || r.Report.Reason != metrics.ReasonNoPrefill {
		t.Errorf("a request during the probe went %s (%s), want decode-only for want of a prefill endpoint", r.Report.Mode, r.Report.Reason)
	}
	d.Release()
	// A long answer that is not streamed tells its verdict at its end: past
	// the wait, the endpoint takes requests again meanwhile.
	for !prefill.Endpoints()[0].Healthy() {
		if time.Now().After(deadline) {
			t.Fatal("the prefill endpoint still waits for its probe's verdict past the wait")
		}
		time.Sleep(5 * time.Millisecond) // polling the condition, not waiting it out
	}
	probe.Observe(http.StatusOK, false)
	probe.Release()
	if _, r = route("r3"); r.Report.Mode != metrics.ModePD {
		t.Errorf("after its probe's pair was served, a request went %s, want P/D", r.Report.Mode)
	}
}
