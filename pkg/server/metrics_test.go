package server

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
)

// series names one labelled series as scrape keys it.
func series(name string, labels ...string) string {
	if len(labels) == 0 {
		return name
	}
	pairs := make([]string, 0, len(labels)/2)
	for i := 0; i < len(labels); i += 2 {
		pairs = append(pairs, fmt.Sprintf("%s=%q", labels[i], labels[i+1]))
	}
	return name + "{" + strings.Join(pairs, ",") + "}" // callers pass labels sorted
}

func requests(api, mode, outcome string) string {
	return series("pd_extproc_requests_total", "api", api, "connector", "kv-nixl", "mode", mode, "outcome", outcome)
}

func TestMetricsMoveWithEachKindOfRequest(t *testing.T) {
	const chat = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	const prefillLatency = 250 * time.Millisecond
	slowOK := func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(prefillLatency) // the engine's time, which request_processing_seconds must leave out
		prefillOK(w, r)
	}
	tests := []struct {
		name    string
		config  string           // extra config keys
		prefill http.HandlerFunc // nil: the prefill endpoint refuses connections
		msgs    []*extprocv3.ProcessingRequest
		want    map[string]float64
		// processing_sum below this, prefill_sum at least it: the prefill leg is
		// not counted as the service's own time.
		prefillAtLeast time.Duration
	}{
		{
			name: "P/D request", prefill: slowOK, msgs: post(chatPath, chat), prefillAtLeast: prefillLatency,
			want: map[string]float64{
				requests("chat", "pd", "routed"):                                                                                       1,
				series("pd_extproc_pd_decisions_total", "reason", "long_prompt"):                                                       1,
				series("pd_extproc_prefill_duration_seconds_count", "outcome", "ok"):                                                   1,
				series("pd_extproc_prefill_failures_total", "reason", "status_5xx"):                                                    0,
				series("pd_extproc_request_processing_seconds_count", "mode", "pd"):                                                    1,
				"pd_extproc_request_body_bytes_count":                                                                                  1,
				"pd_extproc_request_body_bytes_sum":                                                                                    float64(len(chat)),
				"pd_extproc_kv_params_missing_total":                                                                                   0,
				"pd_extproc_streams_in_flight":                                                                                         0,
				series("pd_extproc_endpoint_inflight", "endpoint", decodeEP, "pool", "decode"):                                         0,
				series("pd_extproc_endpoint_healthy", "endpoint", decodeEP, "pool", "decode"):                                          1,
				series("pd_extproc_requests_total", "api", "chat", "connector", "kv-nixl", "mode", "decode_only", "outcome", "routed"): 0,
			},
		},
		{
			name: "decode-only request (n > 1)", prefill: prefillOK,
			msgs: post("/v1/completions", `{"model":"m","prompt":"hi","n":2}`),
			want: map[string]float64{
				requests("completions", "decode_only", "routed"):                             1,
				series("pd_extproc_pd_decisions_total", "reason", "n_gt_1"):                  1,
				series("pd_extproc_pd_decisions_total", "reason", "long_prompt"):             0,
				series("pd_extproc_prefill_duration_seconds_count", "outcome", "ok"):         0,
				series("pd_extproc_request_processing_seconds_count", "mode", "decode_only"): 1,
			},
		},
		{
			name: "prefill 5xx falls back to decode-only", prefill: enginetest.JSON(503, `{}`), msgs: post(chatPath, chat),
			want: map[string]float64{
				requests("chat", "decode_only", "routed"):                                1,
				series("pd_extproc_pd_decisions_total", "reason", "prefill_failed"):      1,
				series("pd_extproc_prefill_failures_total", "reason", "status_5xx"):      1,
				series("pd_extproc_prefill_duration_seconds_count", "outcome", "failed"): 1,
				series("pd_extproc_prefill_duration_seconds_count", "outcome", "ok"):     0,
			},
		},
		{
			name: "prefill unreachable under on_failure fail is a 5xx", config: "prefill: {on_failure: fail}\n",
			msgs: post(chatPath, chat),
			want: map[string]float64{
				requests("chat", "pd", "5xx"):                                       1,
				requests("chat", "pd", "routed"):                                    0,
				series("pd_extproc_prefill_failures_total", "reason", "connect"):    1,
				series("pd_extproc_pd_decisions_total", "reason", "prefill_failed"): 0, // not routed
				series("pd_extproc_request_processing_seconds_count", "mode", "pd"): 0,
			},
		},
		{
			name: "rejected request (invalid JSON)", prefill: prefillOK, msgs: post(chatPath, `{"model":`),
			want: map[string]float64{
				requests("chat", "none", "4xx"):                                      1,
				series("pd_extproc_pd_decisions_total", "reason", "long_prompt"):     0,
				series("pd_extproc_prefill_duration_seconds_count", "outcome", "ok"): 0,
				"pd_extproc_request_body_bytes_count":                                1,
			},
		},
		{
			name: "prefill without kv_transfer_params", prefill: enginetest.JSON(200, `{"choices":[{"text":"a"}],"kv_transfer_params":null}`),
			msgs: post(chatPath, chat),
			want: map[string]float64{
				requests("chat", "decode_only", "routed"):                             1,
				series("pd_extproc_pd_decisions_total", "reason", "prefill_failed"):   1,
				series("pd_extproc_prefill_failures_total", "reason", "no_kv_params"): 1,
				series("pd_extproc_prefill_duration_seconds_count", "outcome", "ok"):  0,
				"pd_extproc_kv_params_missing_total":                                  1,
			},
		},
		{
			name: "prompt logprobs go decode-only", prefill: prefillOK,
			msgs: post("/v1/completions", `{"model":"m","prompt":"hi","echo":true,"logprobs":1}`),
			want: map[string]float64{
				requests("completions", "decode_only", "routed"):                         1,
				series("pd_extproc_pd_decisions_total", "reason", "prompt_logprobs"):     1,
				series("pd_extproc_prefill_duration_seconds_count", "outcome", "ok"):     0,
				requests("responses", "none", "4xx"):                                     0, // every API's series exists from the start
				requests("sglang_generate", "decode_only", "routed"):                     0,
				series("pd_extproc_pd_decisions_total", "reason", "stored_response"):     0,
				series("pd_extproc_pd_decisions_total", "reason", "unpaired_api"):        0,
				series("pd_extproc_pd_decisions_total", "reason", "passthrough"):         0,
				series("pd_extproc_prefill_duration_seconds_count", "outcome", "failed"): 0,
			},
		},
		{
			name: "pass-through request", prefill: prefillOK, msgs: post("/v1/embeddings", `{"model":"m","input":"hi"}`),
			want: map[string]float64{
				requests("passthrough", "decode_only", "routed"):                     1,
				series("pd_extproc_pd_decisions_total", "reason", "passthrough"):     1,
				series("pd_extproc_prefill_duration_seconds_count", "outcome", "ok"): 0,
			},
		},
		{
			name: "an engine admin path is an unknown one", prefill: prefillOK, msgs: post("/flush_cache", `{}`),
			want: map[string]float64{
				requests("other", "none", "4xx"):       1,
				requests("passthrough", "none", "4xx"): 0,
				"pd_extproc_request_body_bytes_count":  1,
			},
		},
		{
			name: "bodiless request", msgs: []*extprocv3.ProcessingRequest{headersMsg(true, hdr{":method", "GET"}, hdr{":path", "/v1/models"})},
			want: map[string]float64{
				requests("passthrough", "decode_only", "routed"):             1,
				series("pd_extproc_pd_decisions_total", "reason", "no_body"): 1,
				"pd_extproc_request_body_bytes_count":                        0,
			},
		},
		{
			// A body of no bytes (a chunked request of its terminator alone) is no
			// body: routed as one without, and no size of 0 among the bodies'.
			name: "empty body", msgs: []*extprocv3.ProcessingRequest{postHeaders("/v1/embeddings", ""), bodyMsg("")},
			want: map[string]float64{
				requests("passthrough", "decode_only", "routed"):             1,
				series("pd_extproc_pd_decisions_total", "reason", "no_body"): 1,
				"pd_extproc_request_body_bytes_count":                        0,
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefillAddr := "127.0.0.1:1" // nothing listens there
			if tt.prefill != nil {
				prefillAddr = enginetest.Start(t, tt.prefill).Addr()
			}
			r := start(t, tt.config+fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
				prefillAddr, decodeEP), Options{}, logr.Discard())
			r.exchange(t, tt.msgs...)

			got := r.scrape(t)
			for key, want := range tt.want {
				v, ok := got[key]
				switch {
				case !ok:
					t.Errorf("%s is missing from /metrics", key)
				case v != want:
					t.Errorf("%s = %v, want %v", key, v, want)
				}
			}
			if tt.prefillAtLeast > 0 {
				processing := got[series("pd_extproc_request_processing_seconds_sum", "mode", "pd")]
				prefill := got[series("pd_extproc_prefill_duration_seconds_sum", "outcome", "ok")]
				if prefill < tt.prefillAtLeast.Seconds() || processing >= tt.prefillAtLeast.Seconds() {
					t.Errorf("processing %.3fs, prefill %.3fs: want the %v prefill leg counted as prefill only", processing, prefill, tt.prefillAtLeast)
				}
			}
			for _, key := range []string{"go_goroutines", "process_start_time_seconds"} {
				if _, ok := got[key]; !ok {
					t.Errorf("%s is missing: Go runtime and process collectors must be on the registry", key)
				}
			}
		})
	}
}

func TestEndpointGaugesAreReadAtScrapeTime(t *testing.T) {
	release := make(chan struct{})
	prefill := enginetest.Start(t, blocked(release, prefillOK))
	r := start(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}",
		prefill.Addr(), decodeEP), Options{}, logr.Discard())

	done := make(chan []*extprocv3.ProcessingResponse)
	go func() {
		replies, _ := r.tryExchange(post(chatPath, `{"model":"m","prompt":"hi"}`)...)
		done <- replies
	}()
	prefill.Await(t)

	tests := []struct {
		stage string
		want  map[string]float64
	}{
		{"while the prefill leg runs", map[string]float64{
			"pd_extproc_streams_in_flight": 1,
			series("pd_extproc_endpoint_inflight", "endpoint", prefill.Addr(), "pool", "prefill"): 1,
			series("pd_extproc_endpoint_inflight", "endpoint", decodeEP, "pool", "decode"):        1,
		}},
		{"after the stream ended", map[string]float64{
			"pd_extproc_streams_in_flight": 0,
			series("pd_extproc_endpoint_inflight", "endpoint", prefill.Addr(), "pool", "prefill"): 0,
			series("pd_extproc_endpoint_inflight", "endpoint", decodeEP, "pool", "decode"):        0,
		}},
	}
	for i, tt := range tests {
		if i == 1 {
			close(release)
			if replies := <-done; len(replies) == 0 || destination(replies[0]) != decodeEP {
				t.Fatalf("the held request was not routed: %v", replies)
			}
		}
		got := r.scrape(t)
		for key, want := range tt.want {
			if got[key] != want {
				t.Errorf("%s: %s = %v, want %v", tt.stage, key, got[key], want)
			}
		}
	}
}

// What the dashboard and the alerts read beside the request counters: each engine's own queue
// and KV use as last scraped, how often an endpoint was taken out of rotation, and the limits
// in force.
func TestEngineLoadEjectionsAndLimitsAreExported(t *testing.T) {
	metricsText := "vllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.25\n"
	engine := enginetest.Start(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			fmt.Fprint(w, metricsText)
			return
		}
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	r := start(t, fmt.Sprintf(`connector: kv-nixl
pools:
  decode: {endpoints: [%q], metrics: {interval: 20ms}, health: {check_interval: 20ms, check_timeout: 1s}}
limits: {max_concurrent_streams: 77, max_buffered_bytes: 123456789}
prefill: {max_background: 9}
`, engine.Addr()), Options{}, logr.Discard())
	ep := func(name string) string { return series(name, "endpoint", engine.Addr(), "pool", "decode") }
	want := map[string]float64{
		ep("pd_extproc_endpoint_engine_waiting"):                                 3,
		ep("pd_extproc_endpoint_engine_kv_usage"):                                0.25,
		ep("pd_extproc_endpoint_ejections_total"):                                1, // /health answers 503: out once, however long
		ep("pd_extproc_endpoint_healthy"):                                        0,
		series("pd_extproc_limit_configured", "limit", "max_concurrent_streams"): 77,
		series("pd_extproc_limit_configured", "limit", "max_buffered_bytes"):     123456789,
		series("pd_extproc_limit_configured", "limit", "max_background"):         9,
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := r.scrape(t)
		var off []string
		for k, v := range want {
			if g, ok := got[k]; !ok || g != v {
				off = append(off, fmt.Sprintf("%s = %v (%v), want %v", k, g, ok, v))
			}
		}
		if len(off) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 10 s:\n%s", strings.Join(off, "\n"))
		}
		time.Sleep(20 * time.Millisecond) // the scrapes and checks run on their own clock: poll, bounded
	}
}
