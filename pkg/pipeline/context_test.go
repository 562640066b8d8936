package pipeline_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/go-logr/logr/funcr"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/server/assemble"
)

// A request whose output limit alone fills the model's context, as the
// decode engine lists it at GET /v1/models (max_model_len), is refused with
// vLLM's 400 before any prefill leg: vLLM refuses it only at the decode
// engine, after the prefill leg (whose limit is 1) computed the prompt for
// nothing. A model of unknown length, or a limit that leaves room, passes.
func TestAnOutputLimitThatFillsTheContextSendsNoPrefillLeg(t *testing.T) {
	const chat = `"messages":[{"role":"user","content":"hi"}]`
	tests := []struct {
		name, path, body string
		wantStatus       int    // 0: routed
		wantBody         string // in the client's error
		wantAlone        bool   // routed to the decode engine alone (invalid_limits), else P/D
	}{
		{name: "chat max_tokens at the context length", path: "/v1/chat/completions", body: `{"model":"m",` + chat + `,"max_tokens":100}`,
			wantStatus: 400, wantBody: `{"error":{"message":"max_tokens=100 leaves no room for the prompt: this model's maximum context length is 100 tokens. ` +
				`Please request fewer output tokens.","type":"BadRequestError","param":null,"code":400}}`},
		{name: "chat max_completion_tokens over it", path: "/v1/chat/completions", body: `{"model":"m",` + chat + `,"max_tokens":5,"max_completion_tokens":150}`,
			wantStatus: 400, wantBody: `"message":"max_completion_tokens=150 leaves no room`},
		{name: "messages, in Anthropic's words", path: "/v1/messages", body: `{"model":"m",` + chat + `,"max_tokens":100}`,
			wantStatus: 400, wantBody: `{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens=100 leaves no room`},
		{name: "completions one under it", path: "/v1/completions", body: `{"model":"m","prompt":"hi","max_tokens":99}`},
		{name: "responses at it: alone, which refuses it or clamps it", path: "/v1/responses",
			body: `{"model":"m","input":"hi","max_output_tokens":100}`, wantAlone: true},
		{name: "responses one under it", path: "/v1/responses", body: `{"model":"m","input":"hi","max_output_tokens":99}`},
		{name: "generate over it: the engine stops at the context", path: "/inference/v1/generate",
			body: `{"model":"m","token_ids":[1],"sampling_params":{"max_tokens":150}}`},
		{name: "a model the engine does not list", path: "/v1/chat/completions", body: `{"model":"other",` + chat + `,"max_tokens":100}`},
		{name: "no model", path: "/v1/chat/completions", body: `{` + chat + `,"max_tokens":100}`},
	}
	prefill := enginetest.Start(t, enginetest.JSON(200, `{"choices":[{"index":0,"finish_reason":"length"}],"kv_transfer_params":{"remote_host":"10.0.0.1"}}`))
	// vLLM's list, as ModelCard words it: enginetest answers GET /v1/models itself.
	decode := httptest.NewServer(enginetest.JSON(200, `{"object":"list","data":[{"id":"m","object":"model","max_model_len":100}]}`))
	t.Cleanup(decode.Close)
	decodeAddr := strings.TrimPrefix(decode.URL, "http://")
	listed := make(chan struct{})
	var once sync.Once
	log := funcr.New(func(_, args string) {
		if strings.Contains(args, "the models the engine serves") && strings.Contains(args, decodeAddr) {
			once.Do(func() { close(listed) })
		}
	}, funcr.Options{})
	cfg, err := config.Parse([]byte(fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}", prefill.Addr(), decodeAddr)))
	if err != nil {
		t.Fatal(err)
	}
	p, err := assemble.Pipeline(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { p.Run(ctx); close(ran) }()
	t.Cleanup(func() { cancel(); <-ran; p.Wait(); pipeline.CloseIdle(p) })
	<-listed // the decode engine's card is read
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			legs := len(prefill.Requests())
			r := &pipeline.Request{ContentType: "application/json", Method: http.MethodPost, Path: tt.path, RequestID: "req-ctx", Body: []byte(tt.body)}
			d, err := p.Route(context.Background(), r)
			sent := len(prefill.Requests()) - legs
			if tt.wantStatus == 0 {
				if err != nil {
					t.Fatal(err)
				}
				d.Release()
				switch {
				case tt.wantAlone && (r.Report.Mode != metrics.ModeDecodeOnly || r.Report.Reason != metrics.ReasonInvalidLimits || sent != 0):
					t.Errorf("routed %s (%s) with %d prefill legs, want decode-only (invalid_limits) with none", r.Report.Mode, r.Report.Reason, sent)
				case !tt.wantAlone && (r.Report.Mode != metrics.ModePD || sent != 1):
					t.Errorf("routed %s with %d prefill legs, want P/D with 1", r.Report.Mode, sent)
				}
				return
			}
			if err == nil {
				d.Release()
				t.Fatalf("routed %s, want a %d", r.Report.Mode, tt.wantStatus)
			}
			e := pipeline.AsError(err, r.RequestID)
			got, _ := e.Body(strings.HasPrefix(tt.path, "/v1/messages"))
			if e.Status != tt.wantStatus || !strings.Contains(string(got), tt.wantBody) || sent != 0 {
				t.Errorf("%d %s after %d prefill legs, want %d with %s and none", e.Status, got, sent, tt.wantStatus, tt.wantBody)
			}
		})
	}
}
