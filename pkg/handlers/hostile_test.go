package handlers_test

import (
	"fmt"
	"strings"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// Bodies a sloppy or hostile client sends are read as vLLM reads them
// (FastAPI's request.json(), Python's json.loads of the bytes, then
// pydantic v2), or refused with a 400 of our own where vLLM refuses them too.
// A limit vLLM refuses (above the context: TokenizeParams in
// vllm/renderers/params.py) goes to the decode engine alone, which answers
// its own 400; a seed past int64 (ChatCompletionRequest's le) is refused by
// the prefill leg, whose 4xx the client gets as it is.
func TestHostileBodiesAreReadAsTheEngineReadsThem(t *testing.T) {
	const bom = "\xef\xbb\xbf"
	deep := strings.Repeat("[", 10000) + strings.Repeat("]", 10000)
	tests := []struct {
		name, body  string
		wantStatus  int    // 0: routed
		wantMessage string // of our 400
		wantPrefill int    // prefill legs run (0: decode alone)
	}{
		{name: "max_tokens above int64", body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":99999999999999999999}`, wantPrefill: 0},
		{name: "max_tokens above int64, as a string", body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":"99999999999999999999"}`, wantPrefill: 0},
		{name: "max_tokens below int64", body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":-99999999999999999999}`, wantPrefill: 0},
		{name: "max_tokens 1e20 (pydantic refuses a float that large)", body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1e20}`, wantPrefill: 0},
		{name: "seed 2^70", body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"seed":1180591620717411303424}`, wantPrefill: 1},
		{name: "a leading BOM", body: bom + `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, wantPrefill: 1},
		{name: "a BOM twice", body: bom + bom + `{"model":"m","messages":[]}`, wantStatus: 400, wantMessage: "not valid JSON"},
		{name: "a lone surrogate", body: `{"model":"m","messages":[{"role":"user","content":"\ud800"}]}`, wantPrefill: 1},
		{name: "10,000 nested arrays in a message", body: `{"model":"m","messages":[{"role":"user","content":` + deep + `}]}`, wantStatus: 400, wantMessage: "nested too deeply"},
		{name: "9,990 nested arrays in a message", body: `{"model":"m","messages":[{"role":"user","content":` + deep[10:len(deep)-10] + `}]}`, wantPrefill: 1},
		{name: "duplicate stream: the last wins", body: `{"model":"m","stream":"maybe","messages":[],"stream":true}`, wantPrefill: 1},
		{name: "duplicate stream: the last wins (refused)", body: `{"model":"m","stream":true,"messages":[],"stream":"maybe"}`, wantPrefill: 0},
		{name: "duplicate max_tokens: the last wins", body: `{"model":"m","max_tokens":0,"messages":[],"max_tokens":5}`, wantPrefill: 1},
		{name: "duplicate max_tokens: the last wins (refused)", body: `{"model":"m","max_tokens":5,"messages":[],"max_tokens":0}`, wantPrefill: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefill := enginetest.Start(t, prefillOK)
			s := newServer(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}`, prefill.Addr(), fakeEndpoint), handlers.Options{})
			replies := drive(t, s, envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(tt.body))...), fullDuplex, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(tt.body), true))
			if tt.wantStatus != 0 {
				checkOpenAIError(t, replies, tt.wantStatus, tt.wantMessage)
				return
			}
			checkRouting(t, replies[0], fakeEndpoint, "")
			if got := len(prefill.Requests()); got != tt.wantPrefill {
				t.Errorf("%d prefill legs, want %d", got, tt.wantPrefill)
			}
		})
	}
}

// Envoy sends a request's body or trailers before its headers only under
// request_header_mode SKIP, where it forwards the request the service never
// routed. The service answers at once with an OpenAI-style 500 naming the
// setting: Envoy would otherwise wait for the reply until its message timer
// fired (504, no body), or pass the request on unrouted.
func TestARequestWithoutItsHeadersGetsAJSONError(t *testing.T) {
	chat := []byte(clientChat)
	tests := []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
	}{
		{"BUFFERED, the whole body", []*extprocv3.ProcessingRequest{envoymsg.WithModes(envoymsg.Body(envoymsg.Request, chat, true), buffered, fullDuplex)}},
		{"FULL_DUPLEX, a first chunk", []*extprocv3.ProcessingRequest{envoymsg.WithModes(envoymsg.Body(envoymsg.Request, chat[:10], false), fullDuplex, fullDuplex)}},
		{"trailers", []*extprocv3.ProcessingRequest{envoymsg.WithModes(envoymsg.Trailers(envoymsg.Request), filterv3.ProcessingMode_NONE, fullDuplex)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeRouter{}
			replies := drive(t, handlers.NewServer(f, handlers.Options{}, logr.Discard()), tt.msgs...)
			checkOpenAIError(t, replies, 500, "request_header_mode")
			if len(f.calls) != 0 {
				t.Errorf("routed without its headers: %v", f.calls)
			}
		})
	}
}
