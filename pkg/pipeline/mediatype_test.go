package pipeline_test

import (
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// TestABodyTheDecodeEngineWillNotReadCostsNoLeg: a body whose Content-Type
// has the decode engine refuse it gets pd-extproc's 400 before any leg, and
// one the engine reads as JSON is routed. vLLM's APIs and SGLang's OpenAI
// ones check the media type (validate_json_request: lowercased, cut at ';',
// nothing stripped); SGLang's /generate does not, but FastAPI hands its
// model the bytes of a body declared as anything but application/json or
// application/*+json, which it refuses (get_request_handler,
// fastapi/routing.py), while the concurrent prefill leg would wait for a
// decode engine that never comes. A pass-through request is the engine's.
func TestABodyTheDecodeEngineWillNotReadCostsNoLeg(t *testing.T) {
	const chat, generate = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, `{"text":"hi"}`
	tests := []struct {
		name, connector, path, body, contentType string
		refused                                  bool
		legs                                     int // prefill legs when routed
	}{
		{"vLLM chat without one", "kv-nixl", "/v1/chat/completions", chat, "", true, 0},
		{"vLLM chat, text/plain", "kv-nixl", "/v1/chat/completions", chat, "text/plain", true, 0},
		{"vLLM chat, curl -d's form type", "kv-nixl", "/v1/chat/completions", chat, "application/x-www-form-urlencoded", true, 0},
		{"vLLM chat, a space before the parameter", "kv-nixl", "/v1/chat/completions", chat, "application/json ; charset=utf-8", true, 0},
		{"vLLM chat, a +json type", "kv-nixl", "/v1/chat/completions", chat, "application/vnd.api+json", true, 0},
		{"vLLM chat, a charset, any case", "kv-nixl", "/v1/chat/completions", chat, "Application/JSON;charset=utf-8", false, 1},
		{"SGLang chat, text/plain", "kv-sglang", "/v1/chat/completions", chat, "text/plain", true, 0},
		{"SGLang chat, application/json", "kv-sglang", "/v1/chat/completions", chat, "application/json", false, 1},
		{"SGLang generate without one", "kv-sglang", "/generate", generate, "", false, 1},
		{"SGLang generate, a space before the parameter", "kv-sglang", "/generate", generate, "application/json ; charset=utf-8", false, 1},
		{"SGLang generate, a +json type", "kv-sglang", "/generate", generate, "Application/Vnd.Api+JSON", false, 1},
		{"SGLang generate, text/plain", "kv-sglang", "/generate", generate, "text/plain", true, 0},
		{"SGLang generate, curl -d's form type", "kv-sglang", "/generate", generate, "application/x-www-form-urlencoded", true, 0},
		{"SGLang generate, two types", "kv-sglang", "/generate", generate, "application/json, text/plain", true, 0},
		{"pass-through, text/plain", "kv-nixl", "/v1/tokenize", `{"prompt":"hi"}`, "text/plain", false, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			engine := enginetest.Start(t, enginetest.JSON(200, `{"kv_transfer_params":`+prefillKV+`}`))
			p := newPipelineFor(t, tt.connector, engine.Addr(), "")
			d, err := p.Route(context.Background(), &pipeline.Request{ContentType: tt.contentType, Method: http.MethodPost,
				Path: tt.path, RequestID: "r1", Body: []byte(tt.body)})
			if d != nil {
				d.Release()
			}
			p.Wait()
			var perr *pipeline.Error
			switch {
			case tt.refused && (!errors.As(err, &perr) || perr.Status != http.StatusBadRequest):
				t.Fatalf("Route() = %v, want a 400", err)
			case !tt.refused && err != nil:
				t.Fatalf("Route() = %v, want the request routed", err)
			}
			if got := len(engine.Requests()); got != tt.legs {
				t.Errorf("%d prefill legs, want %d", got, tt.legs)
			}
		})
	}
}
