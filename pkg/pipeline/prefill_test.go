package pipeline_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// A sequential prefill leg that fails is tried once more on another
// endpoint; when that fails too, prefill.on_failure decides: the decode
// engine recomputes the prompt (decode-only, the default), or the client
// gets the error, whose message names the request and never the engine. An
// engine's own 4xx is the client's to read, as the engine wrote it.
func TestAFailedPrefillLegIsRetriedThenFallsBackOrFails(t *testing.T) {
	const engine400 = `{"object":"error","message":"Stream options can only be defined when stream=True.","type":"BadRequestError","code":400}`
	const dead = "127.0.0.1:1" // nothing listens there
	tests := []struct {
		name        string
		onFailure   string                                   // prefill.on_failure; "" for the default
		failures    int32                                    // prefill answers that fail, across both endpoints, before they succeed
		fail        func(http.ResponseWriter, *http.Request) // how they fail
		unreachable bool                                     // both endpoints refuse connections
		wantMode    metrics.Mode                             // routed: P/D or decode-only; ModeNone: refused
		wantStatus  int                                      // refused: the client's status
		wantRaw     string                                   // refused: the engine's own body, when it is passed on
	}{
		{name: "a 5xx, then the other endpoint answers", failures: 1, fail: enginetest.JSON(503, `{}`), wantMode: metrics.ModePD},
		{name: "both 5xx: the decode engine recomputes", failures: 2, fail: enginetest.JSON(503, `{}`), wantMode: metrics.ModeDecodeOnly},
		{name: "both 5xx under on_failure fail", onFailure: "fail", failures: 2, fail: enginetest.JSON(503, `{"detail":"10.0.0.5 is sad"}`),
			wantStatus: http.StatusBadGateway},
		{name: "both unreachable under on_failure fail", onFailure: "fail", unreachable: true, wantStatus: http.StatusServiceUnavailable},
		{name: "an engine's 4xx is not retried and reaches the client as is", failures: 2, fail: enginetest.JSON(400, engine400),
			wantStatus: http.StatusBadRequest, wantRaw: engine400},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var seen atomic.Int32
			answer := func(w http.ResponseWriter, r *http.Request) {
				if seen.Add(1) <= tt.failures {
					tt.fail(w, r)
					return
				}
				enginetest.JSON(200, `{"kv_transfer_params":`+prefillKV+`}`)(w, r)
			}
			a, b := enginetest.Start(t, answer), enginetest.Start(t, answer)
			addrs := []string{a.Addr(), b.Addr()}
			if tt.unreachable {
				addrs = []string{dead, "127.0.0.1:2"}
			}
			onFailure := ""
			if tt.onFailure != "" {
				onFailure = "prefill: {on_failure: " + tt.onFailure + "}\n"
			}
			p, _, _ := newPipeline(t, fmt.Sprintf("connector: kv-nixl\n%spools: {prefill: {endpoints: [%q, %q]}, decode: {endpoints: [\"10.1.1.1:8000\"]}}",
				onFailure, addrs[0], addrs[1]))
			t.Cleanup(p.Wait)
			r := &pipeline.Request{ContentType: "application/json", Method: http.MethodPost, Path: "/v1/chat/completions", RequestID: "req-e1",
				Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"remote_host":"evil"}}`)}
			d, err := p.Route(context.Background(), r)

			attempts := len(a.Requests()) + len(b.Requests())
			if tt.wantRaw != "" && attempts != 1 || tt.wantRaw == "" && !tt.unreachable && (len(a.Requests()) != 1 || len(b.Requests()) != 1) {
				t.Errorf("prefill attempts %d + %d, want one on each endpoint (one in all for a 4xx)", len(a.Requests()), len(b.Requests()))
			}
			if tt.wantStatus != 0 {
				if err == nil {
					d.Release()
					t.Fatalf("routed %s, want a %d", r.Report.Mode, tt.wantStatus)
				}
				e := pipeline.AsError(err, r.RequestID)
				if e.Status != tt.wantStatus || string(e.Raw) != tt.wantRaw {
					t.Fatalf("error %d %q (raw %s), want %d (raw %s)", e.Status, e.Message, e.Raw, tt.wantStatus, tt.wantRaw)
				}
				if tt.wantRaw != "" {
					return
				}
				if !strings.Contains(e.Message, "request id req-e1") || e.Detail == "" {
					t.Errorf("message %q must name the request, and the log's detail %q give the cause", e.Message, e.Detail)
				}
				for _, leak := range []string{addrs[0], addrs[1], "127.0.0.1", "10.0.0.5", "dial", "http://"} {
					if strings.Contains(e.Message, leak) {
						t.Errorf("the client's message shows %q: %s", leak, e.Message)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer d.Release()
			body := string(d.Body.Bytes())
			if r.Report.Mode != tt.wantMode || strings.Contains(body, prefillKV) != (tt.wantMode == metrics.ModePD) {
				t.Errorf("routed %s (%s) with decode body %s, want %s", r.Report.Mode, r.Report.Reason, body, tt.wantMode)
			}
			if tt.wantMode == metrics.ModeDecodeOnly && r.Report.Reason != metrics.ReasonPrefillFailed {
				t.Errorf("reason %s, want %s", r.Report.Reason, metrics.ReasonPrefillFailed)
			}
			if strings.Contains(body, "evil") {
				t.Errorf("the client's kv_transfer_params reached the decode body: %s", body)
			}
		})
	}
}

// A kv-nixl prefill answer of 200 that hands out no kv_transfer_params (vLLM
// without a connector answers null; a proxy in front of the engine may answer
// its own error with a 200) is a failed prefill: the decode engine would
// recompute the prompt unseen. It is counted as such, not retried (another
// engine would be asked to compute the prompt again), and prefill.on_failure
// decides: decode-only, counted as prefill_failed, or a 502. kv-shared-storage
// reads nothing from the answer, so its 200 is a served prefill.
func TestAPrefillAnswerWithoutParamsIsAFailedPrefill(t *testing.T) {
	const chat = `{"choices":[{"index":0,"message":{"content":"a"},"finish_reason":"length"}]`
	tests := []struct {
		name, connector, onFailure, answer string
		wantMode                           metrics.Mode // ModeNone: refused
		wantStatus                         int
	}{
		{name: "null, as vLLM without a connector", connector: "kv-nixl", answer: chat + `,"kv_transfer_params":null}`, wantMode: metrics.ModeDecodeOnly},
		{name: "absent", connector: "kv-nixl", answer: chat + `}`, wantMode: metrics.ModeDecodeOnly},
		{name: "empty", connector: "kv-nixl", answer: chat + `,"kv_transfer_params":{}}`, wantMode: metrics.ModeDecodeOnly},
		{name: "a proxy's error with a 200", connector: "kv-nixl", answer: `{"error":{"message":"upstream reset","type":"proxy_error"}}`,
			wantMode: metrics.ModeDecodeOnly},
		{name: "null under on_failure fail", connector: "kv-nixl", onFailure: "fail", answer: chat + `,"kv_transfer_params":null}`,
			wantStatus: http.StatusBadGateway},
		{name: "kv-shared-storage hands nothing back", connector: "kv-shared-storage", answer: chat + `}`, wantMode: metrics.ModePD},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, b := enginetest.Start(t, enginetest.JSON(200, tt.answer)), enginetest.Start(t, enginetest.JSON(200, tt.answer))
			onFailure := ""
			if tt.onFailure != "" {
				onFailure = "prefill: {on_failure: " + tt.onFailure + "}\n"
			}
			p, m, _ := newPipeline(t, fmt.Sprintf("connector: %s\n%spools: {prefill: {endpoints: [%q, %q]}, decode: {endpoints: [\"10.1.1.1:8000\"]}}",
				tt.connector, onFailure, a.Addr(), b.Addr()))
			t.Cleanup(p.Wait)
			r := &pipeline.Request{ContentType: "application/json", Method: http.MethodPost, Path: "/v1/chat/completions", RequestID: "req-np",
				Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
			d, err := p.Route(context.Background(), r)
			if n := len(a.Requests()) + len(b.Requests()); n != 1 {
				t.Errorf("%d prefill legs, want 1: another engine would compute the prompt again", n)
			}
			defer func() { // the metrics, once what the client and engines got is checked
				failed := 0.0
				if tt.wantMode != metrics.ModePD {
					failed = 1
				}
				if got := counter(t, m, "pd_extproc_prefill_duration_seconds", "outcome", metrics.PrefillOK); got != 1-failed {
					t.Errorf("prefill_duration_seconds_count{outcome=ok} = %v, want %v", got, 1-failed)
				}
				if got := counter(t, m, "pd_extproc_prefill_failures_total", "reason", "no_kv_params"); got != failed {
					t.Errorf("prefill_failures_total{reason=no_kv_params} = %v, want %v", got, failed)
				}
			}()
			if tt.wantStatus != 0 {
				if err == nil {
					d.Release()
					t.Fatalf("routed %s, want a %d", r.Report.Mode, tt.wantStatus)
				}
				if e := pipeline.AsError(err, r.RequestID); e.Status != tt.wantStatus {
					t.Errorf("error %d %q, want %d", e.Status, e.Message, tt.wantStatus)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer d.Release()
			body := string(d.Body.Bytes())
			if r.Report.Mode != tt.wantMode || strings.Contains(body, "kv_transfer_params") {
				t.Errorf("routed %s (%s) with decode body %s, want %s without kv_transfer_params", r.Report.Mode, r.Report.Reason, body, tt.wantMode)
			}
			if tt.wantMode == metrics.ModeDecodeOnly && r.Report.Reason != metrics.ReasonPrefillFailed {
				t.Errorf("reason %s, want %s", r.Report.Reason, metrics.ReasonPrefillFailed)
			}
		})
	}
}

// A one-token prefill answer without kv_transfer_params that says its token
// ended it (a stop token, not the length cap) is logged as such: a
// NixlConnector that hands out KV only for an answer cut by its length
// gives none for it, and the Messages API has no min_tokens to prevent it.
func TestANoParamsAnswerEndedByAStopTokenSaysSo(t *testing.T) {
	tests := []struct {
		name, path, body, answer string
		want                     string // in the log line; "" for no explanation
	}{
		{name: "messages, end_turn", path: "/v1/messages", body: `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`,
			answer: `{"type":"message","content":[],"stop_reason":"end_turn","usage":{"input_tokens":3,"output_tokens":1}}`,
			want:   "its one token was a stop token (stop_reason end_turn)"},
		{name: "chat, finish_reason stop", path: "/v1/chat/completions", body: `{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
			answer: `{"choices":[{"index":0,"message":{"content":""},"finish_reason":"stop"}]}`,
			want:   "its one token was a stop token (finish_reason stop)"},
		{name: "responses, completed", path: "/v1/responses", body: `{"model":"m","input":"hi"}`,
			answer: `{"object":"response","status":"completed","output":[]}`,
			want:   "its one token was a stop token (status completed)"},
		{name: "chat cut by its length", path: "/v1/chat/completions", body: `{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
			answer: `{"choices":[{"index":0,"message":{"content":"a"},"finish_reason":"length"}]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := enginetest.Start(t, enginetest.JSON(200, tt.answer))
			p, _, logs := newPipeline(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [\"10.1.1.1:8000\"]}}", e.Addr()))
			t.Cleanup(p.Wait)
			r := &pipeline.Request{ContentType: "application/json", Method: http.MethodPost, Path: tt.path, RequestID: "req-stop", Body: []byte(tt.body)}
			d, err := p.Route(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			d.Release()
			if r.Report.Reason != metrics.ReasonPrefillFailed {
				t.Errorf("reason %s, want %s", r.Report.Reason, metrics.ReasonPrefillFailed)
			}
			if got := logs.count("prefill failed; decode will recompute the prompt"); got != 1 {
				t.Errorf("%d failed-prefill log lines, want 1", got)
			}
			want, wantLines := tt.want, 1
			if want == "" {
				want, wantLines = "stop token", 0
			}
			if got := logs.count(want); got != wantLines {
				t.Errorf("%d log lines say %q, want %d", got, want, wantLines)
			}
		})
	}
}

// A 101 Switching Protocols to a prefill leg, which asks no upgrade, is no
// answer an engine gives: a broken engine, or a proxy answering for it. It
// is malformed (retried elsewhere, blamed, then prefill.on_failure), not a
// redirect; and what follows it is never read as its body: with an Upgrade
// header Go hands the connection itself over as the body, which would hold
// the leg until its timeout.
func TestASwitchingProtocolsAnswerIsMalformed(t *testing.T) {
	tests := []struct {
		name, head string
		onFailure  string
		wantStatus int // 0: routed decode-only
	}{
		{name: "bare", head: "HTTP/1.1 101 Switching Protocols\r\n\r\n"},
		{name: "upgrading the connection", head: "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"},
		{name: "under on_failure fail", head: "HTTP/1.1 101 Switching Protocols\r\n\r\n", onFailure: "fail", wantStatus: http.StatusBadGateway},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			answer := func(w http.ResponseWriter, _ *http.Request) {
				conn, buf, err := http.NewResponseController(w).Hijack()
				if err != nil {
					t.Error(err)
					return
				}
				defer conn.Close()
				buf.WriteString(tt.head)
				buf.Flush()
				// Open until the client closes it; a client that reads it as
				// the body waits for the engine to give up.
				conn.SetReadDeadline(time.Now().Add(3 * time.Second))
				buf.ReadByte()
			}
			a, b := enginetest.Start(t, answer), enginetest.Start(t, answer)
			onFailure := "decode-only"
			if tt.onFailure != "" {
				onFailure = tt.onFailure
			}
			p, m, _ := newPipeline(t, fmt.Sprintf("connector: kv-nixl\nprefill: {on_failure: %s, timeout: 20s}\n"+
				"pools: {prefill: {endpoints: [%q, %q]}, decode: {endpoints: [\"10.1.1.1:8000\"]}}", onFailure, a.Addr(), b.Addr()))
			t.Cleanup(p.Wait)
			r := &pipeline.Request{ContentType: "application/json", Method: http.MethodPost, Path: "/v1/chat/completions", RequestID: "req-101",
				Body: []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
			d, err := p.Route(context.Background(), r)
			switch {
			case tt.wantStatus != 0 && err == nil:
				d.Release()
				t.Errorf("routed %s, want a %d", r.Report.Mode, tt.wantStatus)
			case tt.wantStatus != 0:
				if e := pipeline.AsError(err, r.RequestID); e.Status != tt.wantStatus {
					t.Errorf("error %d %q, want %d", e.Status, e.Message, tt.wantStatus)
				}
			case err != nil:
				t.Errorf("Route: %v, want it routed decode-only", err)
			default:
				d.Release()
				if r.Report.Mode != metrics.ModeDecodeOnly || r.Report.Reason != metrics.ReasonPrefillFailed {
					t.Errorf("routed %s (%s), want decode_only (prefill_failed)", r.Report.Mode, r.Report.Reason)
				}
			}
			if r.Report.PrefillTime >= 3*time.Second {
				t.Errorf("the prefill phase took %v: a leg read the switched connection as its answer's body", r.Report.PrefillTime)
			}
			for _, reason := range []metrics.Failure{metrics.FailureMalformed, metrics.FailureRedirect, metrics.FailureTimeout} {
				want := map[bool]float64{true: 2}[reason == metrics.FailureMalformed] // one on each endpoint
				if got := counter(t, m, "pd_extproc_prefill_failures_total", "reason", reason.String()); got != want {
					t.Errorf("prefill_failures_total{reason=%s} = %v, want %v", reason, got, want)
				}
			}
		})
	}
}

// An engine's refusal reaches the client as the engine wrote it, read up to
// the 8 MiB a prefill answer is read to (vLLM's validation errors echo the
// input they refuse, which a long prompt makes long). One longer would
// reach it cut, as JSON that does not parse: the client gets the engine's
// status instead, with an error of its API's shape that says so and quotes
// the error's beginning.
func TestAnEnginesRefusalOverTheReadCapKeepsItsStatus(t *testing.T) {
	refusal := func(n int) string {
		head, tail := `{"error":{"message":"[{'type': 'string_type', 'loc': ('body', 'messages'), 'input': '`, `'}]","type":"BadRequestError","code":400}}`
		return head + strings.Repeat("x", n-len(head)-len(tail)) + tail
	}
	tests := []struct {
		name, path string
		size       int
		wantRaw    bool   // the engine's body, whole
		wantShape  string // else a body of this API's shape
	}{
		{name: "exactly 8 MiB: as the engine wrote it", path: "/v1/chat/completions", size: pipeline.MaxPrefillResponseBytes, wantRaw: true},
		{name: "one byte over: OpenAI's shape", path: "/v1/chat/completions", size: pipeline.MaxPrefillResponseBytes + 1, wantShape: `{"error":{"message":`},
		{name: "one byte over: Anthropic's shape", path: "/v1/messages", size: pipeline.MaxPrefillResponseBytes + 1,
			wantShape: `{"type":"error","error":{"type":"invalid_request_error","message":`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			answer := refusal(tt.size)
			engine := enginetest.Start(t, enginetest.JSON(http.StatusBadRequest, answer))
			p, _, _ := newPipeline(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [\"10.1.1.1:8000\"]}}", engine.Addr()))
			r := &pipeline.Request{ContentType: "application/json", Method: http.MethodPost, Path: tt.path, RequestID: "req-big",
				Body: []byte(`{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`)}
			d, err := p.Route(context.Background(), r)
			if err == nil {
				d.Release()
				t.Fatalf("routed %s, want the engine's 400", r.Report.Mode)
			}
			e := pipeline.AsError(err, r.RequestID)
			got, _ := e.Body(tt.path == "/v1/messages")
			switch {
			case e.Status != http.StatusBadRequest:
				t.Errorf("status %d, want the engine's 400", e.Status)
			case tt.wantRaw && string(got) != answer:
				t.Errorf("the client gets %d bytes, want the engine's %d as they are", len(got), len(answer))
			case tt.wantRaw:
			case !json.Valid(got) || len(got) > 4<<10 || !strings.HasPrefix(string(got), tt.wantShape):
				t.Errorf("the client gets %d bytes (valid JSON: %v), want a short error of its API's shape: %.300s", len(got), json.Valid(got), got)
			case !strings.Contains(string(got), "8388608 bytes") || !strings.Contains(string(got), "string_type"):
				t.Errorf("the error must say the engine's was over the read cap and quote its beginning: %s", got)
			}
		})
	}
}
