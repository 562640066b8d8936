package handlers_test

import (
	"fmt"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr/funcr"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// A decode engine that cannot pull the KV answers a stream's 200 first, then
// an error event (vLLM's kv_load_failure_policy "fail"). When Envoy sends the
// response body, in any mode, and whether the body ends with its last chunk
// or with trailers, that answer is a failure of both endpoints of the pair,
// and is counted; without the body, the 200 is all there is.
func TestAStreamThatFailsAfterIts200IsAFailure(t *testing.T) {
	const (
		role = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"
		fail = enginetest.StreamError
		done = "data: [DONE]\n\n"
	)
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{fullDuplex, filterv3.ProcessingMode_STREAMED, buffered, filterv3.ProcessingMode_NONE} {
		for _, trailers := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s, trailers %v", mode, trailers), func(t *testing.T) {
				prefill := enginetest.Start(t, prefillOK)
				p := newPipeline(t, fmt.Sprintf(`connector: kv-nixl
pools: {prefill: {endpoints: [%q], health: {consecutive_failures: 1}}, decode: {endpoints: ["10.1.1.1:8000"], health: {consecutive_failures: 1}}}`, prefill.Addr()))
				m := metrics.New("kv-nixl")
				msgs := []*extprocv3.ProcessingRequest{
					envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), fullDuplex, mode),
					envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
					envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, envoymsg.Header{"content-type", "text/event-stream"}),
				}
				if mode != filterv3.ProcessingMode_NONE {
					msgs = append(msgs, envoymsg.Body(envoymsg.Response, []byte(role), false), envoymsg.Body(envoymsg.Response, []byte(fail+done), !trailers))
				}
				if trailers {
					msgs = append(msgs, envoymsg.Trailers(envoymsg.Response))
				}
				var logged []string
				drive(t, handlers.NewServer(p, handlers.Options{Metrics: m}, funcr.New(func(_, args string) { logged = append(logged, args) }, funcr.Options{})), msgs...)

				wantFailed := mode != filterv3.ProcessingMode_NONE
				prefillPool, decodePool := p.Pools()
				for _, e := range append(prefillPool.Endpoints(), decodePool.Endpoints()...) {
					if e.Healthy() == wantFailed {
						t.Errorf("endpoint %s healthy = %v, want %v", e.Addr, e.Healthy(), !wantFailed)
					}
				}
				want := 0.0
				if wantFailed {
					want = 1
				}
				if got := streamErrors(t, m, "pd"); got != want {
					t.Errorf(`pd_extproc_stream_errors_total{mode="pd"} = %v, want %v`, got, want)
				}
				// One line names the pair, for the operator to find the engine.
				lines := 0
				for _, l := range logged {
					if strings.Contains(l, "after its 200") && strings.Contains(l, `"decode"="10.1.1.1:8000"`) && strings.Contains(l, `"prefill"="`+prefill.Addr()+`"`) {
						lines++
					}
				}
				if lines != int(want) {
					t.Errorf("%d log lines name the failed pair, want %v: %q", lines, want, logged)
				}
			})
		}
	}
}

// streamErrors reads pd_extproc_stream_errors_total for a mode.
func streamErrors(t *testing.T, m *metrics.Metrics, mode string) float64 {
	t.Helper()
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "pd_extproc_stream_errors_total" {
			continue
		}
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				if l.GetName() == "mode" && l.GetValue() == mode {
					return s.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no pd_extproc_stream_errors_total{mode=%q}", mode)
	return 0
}

// A gateway that implements the endpoint-picker protocol says, on the
// response path, which endpoint served the request (envoy.lb
// x-gateway-destination-endpoint-served). With fallbacks offered, a 500
// then ejects the pick when the pick served it, and no endpoint when another
// did or the gateway did not say; an endpoint the service never offered is a
// gateway that does not follow its pick, logged once.
func TestTheEndpointTheGatewayReportsServingIsJudged(t *testing.T) {
	const stranger = "10.9.9.9:8000"
	tests := []struct {
		name      string
		fallbacks int
		served    string // "pick", "fallback", stranger, or "" when the gateway reports none
		ejected   string // "pick", or "" for none
		logged    int
	}{
		{"fallbacks offered, the pick served", 1, "pick", "pick", 0},
		{"fallbacks offered, the fallback served", 1, "fallback", "", 0},
		{"fallbacks offered, none reported", 1, "", "", 0},
		{"no fallbacks, none reported", 0, "", "pick", 0},
		{"no fallbacks, the pick served", 0, "pick", "pick", 0},
		{"no fallbacks, an endpoint never offered served", 0, stranger, "", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefill := enginetest.Start(t, prefillOK)
			p := newPipeline(t, fmt.Sprintf(`connector: kv-shared-storage
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: ["10.1.1.1:8000", "10.1.1.2:8000"], fallbacks: %d, health: {consecutive_failures: 1}}}`,
				prefill.Addr(), tt.fallbacks))
			var logged []string
			s := handlers.NewServer(p, handlers.Options{}, funcr.New(func(_, args string) { logged = append(logged, args) }, funcr.Options{}))
			rec := newRecorder()
			x := s.Open(t.Context(), rec)
			for _, m := range []*extprocv3.ProcessingRequest{
				envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), fullDuplex, filterv3.ProcessingMode_NONE),
				envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
			} {
				if _, err := x.Handle(m); err != nil {
					t.Fatal(err)
				}
			}
			dest, _ := headerValue(rec.await(t, 1)[0].GetRequestHeaders().GetResponse().GetHeaderMutation(), handlers.DestinationHeader)
			offered := strings.Split(dest, ",")
			if len(offered) != 1+tt.fallbacks {
				t.Fatalf("offered %q, want the pick and %d fallbacks", dest, tt.fallbacks)
			}
			answer := envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "500"})
			if served := map[string]string{"pick": offered[0], "fallback": offered[len(offered)-1], stranger: stranger}[tt.served]; served != "" {
				lb, err := structpb.NewStruct(map[string]any{handlers.DestinationServedKey: served})
				if err != nil {
					t.Fatal(err)
				}
				answer.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{handlers.DestinationMetadata: lb}}
			}
			if _, err := x.Handle(answer); err != nil {
				t.Fatal(err)
			}
			x.Close()

			_, decodePool := p.Pools()
			for _, e := range decodePool.Endpoints() {
				if want := tt.ejected == "pick" && e.Addr == offered[0]; e.Healthy() == want {
					t.Errorf("decode endpoint %s ejected = %v, want %v (offered %q)", e.Addr, !e.Healthy(), want, dest)
				}
			}
			lines := 0
			for _, l := range logged {
				if strings.Contains(l, "did not pick") && strings.Contains(l, `"served"="`+stranger+`"`) {
					lines++
				}
			}
			if lines != tt.logged {
				t.Errorf("%d log lines name an endpoint never offered, want %d: %q", lines, tt.logged, logged)
			}
		})
	}
}

// SGLang's /generate stream says no failure in an error event: a decode
// server whose KV transfer failed aborts the request (prepare_abort,
// disaggregation/decode.py), and its stream, answered 200 already, carries
// the abort in an ordinary chunk, then [DONE] (_handle_abort_finish_reason,
// managers/tokenizer_manager.py). An abort with a 5xx status_code before
// the first token is counted and blamed on the decode endpoint, and logged
// with the pair; one after the first token, or with a 4xx (the request's
// own), is not.
func TestAGenerateStreamAbortedBeforeItsFirstTokenIsAFailure(t *testing.T) {
	const (
		clientGenerate = `{"text":"once upon","sampling_params":{"max_new_tokens":8},"stream":true}`
		meta           = `"prompt_tokens":3,"weight_version":"default","num_retractions":0,"reasoning_tokens":0,"completion_tokens":0,"cached_tokens":0}}`
		token          = `data: {"text":" a","output_ids":[264],"meta_info":{"id":"r1","finish_reason":null,` + meta + "\n\n"
		done           = "data: [DONE]\n\n"
	)
	abort := func(status int) string {
		return `data: {"text":"","output_ids":[],"meta_info":{"id":"r1","finish_reason":{"type":"abort",` +
			`"message":"Decode transfer failed for request rank=0 req.rid='r1' req.bootstrap_room=7 with exception KVTransferError",` +
			fmt.Sprintf(`"status_code":%d,"err_type":null},`, status) + meta + "\n\n"
	}
	for _, tt := range []struct {
		name   string
		chunks []string
		failed bool
	}{
		{"a 500 abort first", []string{abort(500), done}, true},
		{"a 503 abort first, cut across chunks", []string{abort(503)[:40], abort(503)[40:] + done}, true},
		{"a token, then a 500 abort", []string{token, abort(500), done}, false},
		{"a 400 abort: the request's own", []string{abort(400), done}, false},
	} {
		for _, mode := range []filterv3.ProcessingMode_BodySendMode{fullDuplex, filterv3.ProcessingMode_STREAMED} {
			t.Run(fmt.Sprintf("%s, %s", tt.name, mode), func(t *testing.T) {
				prefill := enginetest.Start(t, enginetest.JSON(200, `{"text":"","output_ids":[],"meta_info":{"id":"r1"}}`))
				const decode = "10.1.1.1:8000"
				p := newPipeline(t, fmt.Sprintf(`connector: kv-sglang
pools: {prefill: {endpoints: [%q], health: {consecutive_failures: 1}}, decode: {endpoints: [%q], health: {consecutive_failures: 1}}}`, prefill.Addr(), decode))
				m := metrics.New("kv-sglang")
				msgs := []*extprocv3.ProcessingRequest{
					envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post("/generate", len(clientGenerate))...), fullDuplex, mode),
					envoymsg.Body(envoymsg.Request, []byte(clientGenerate), true),
					envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, envoymsg.Header{"content-type", "text/event-stream"}),
				}
				for i, c := range tt.chunks {
					msgs = append(msgs, envoymsg.Body(envoymsg.Response, []byte(c), i == len(tt.chunks)-1))
				}
				var logged []string
				drive(t, handlers.NewServer(p, handlers.Options{Metrics: m}, funcr.New(func(_, args string) { logged = append(logged, args) }, funcr.Options{})), msgs...)
				p.Wait() // the concurrent prefill leg has ended: a decode failure no longer waits for it

				want := 0.0
				if tt.failed {
					want = 1
				}
				if got := streamErrors(t, m, "pd"); got != want {
					t.Errorf(`pd_extproc_stream_errors_total{mode="pd"} = %v, want %v`, got, want)
				}
				_, decodePool := p.Pools()
				for _, e := range decodePool.Endpoints() {
					if e.Healthy() == tt.failed {
						t.Errorf("decode endpoint %s ejected = %v, want %v", e.Addr, !e.Healthy(), tt.failed)
					}
				}
				lines := 0
				for _, l := range logged {
					if strings.Contains(l, "after its 200") && strings.Contains(l, `"decode"="`+decode+`"`) && strings.Contains(l, `"prefill"="`+prefill.Addr()+`"`) {
						lines++
					}
				}
				if lines != int(want) {
					t.Errorf("%d log lines name the failed pair, want %v: %q", lines, want, logged)
				}
			})
		}
	}
}
