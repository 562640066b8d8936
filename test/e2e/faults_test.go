package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// ---------------------------------------------------------------- prefill leg faults

// TestFaultPrefillLegFails breaks the prefill leg every way an engine can and
// checks both sides: what the client gets, and what the engines saw. With the
// default on_failure: decode-only the request completes on the decode engine,
// which recomputes the prompt (no kv_transfer_params, KV "none"); with
// on_failure: fail the client gets the 5xx and no decode leg is sent.
func TestFaultPrefillLegFails(t *testing.T) {
	type fault struct {
		name    string
		opts    rigOptions
		break_  func(r *rig)
		attempt func(t *testing.T, recs []pdsim.Record) // what each prefill attempt looked like
		tries   int                                     // prefill attempts: prefill.attempts (2) unless the timeout ends the phase
		failed  int                                     // status with on_failure: fail
		// cancelled: the router cancels its attempts, which the engine
		// records once its handler sees the cancellation, after the client
		// may have its answer.
		cancelled bool
	}
	slow := func(r *rig) {
		for _, p := range r.prefill {
			p.SetFaults(pdsim.Faults{Delay: time.Minute})
		}
	}
	faults := []fault{
		{
			// prefill.timeout bounds the whole prefill phase, retries included: one attempt.
			name: "times out", opts: rigOptions{extra: "prefill: {timeout: 250ms, on_failure: %s}"}, break_: slow, tries: 1, failed: 503, cancelled: true,
			attempt: func(t *testing.T, recs []pdsim.Record) {
				for _, rec := range recs {
					if !rec.Canceled {
						t.Errorf("a timed-out prefill attempt was not cancelled: %+v", rec)
					}
				}
			},
		},
		{
			name: "answers 5xx", opts: rigOptions{extra: "prefill: {on_failure: %s}"}, tries: 2, failed: 502,
			break_: func(r *rig) {
				for _, p := range r.prefill {
					p.SetFaults(pdsim.Faults{FailStatus: http.StatusInternalServerError})
				}
			},
			attempt: func(t *testing.T, recs []pdsim.Record) {
				for _, rec := range recs {
					if rec.Status != http.StatusInternalServerError {
						t.Errorf("prefill attempt status %d, want the injected 500", rec.Status)
					}
				}
			},
		},
		{
			name: "drops the connection", opts: rigOptions{extra: "prefill: {on_failure: %s}"}, tries: 2, failed: 503,
			break_: func(r *rig) {
				for _, p := range r.prefill {
					p.SetFaults(pdsim.Faults{DropConnections: true})
				}
			},
			attempt: func(t *testing.T, recs []pdsim.Record) {
				for _, rec := range recs {
					if rec.Status != 0 {
						t.Errorf("prefill attempt status %d, want a dropped connection", rec.Status)
					}
				}
			},
		},
		{
			name: "refuses the connection", failed: 503,
			opts: rigOptions{extra: "prefill: {on_failure: %s}", prefills: -1, prefillAddrs: func([]*pdsim.Server) []string {
				return []string{"127.0.0.1:1", "127.0.0.2:1"}
			}},
		},
	}
	for _, mode := range []string{"full_duplex", "buffered"} {
		for _, f := range faults {
			for _, policy := range []string{"decode-only", "fail"} {
				t.Run(fmt.Sprintf("%s/%s/%s", mode, f.name, policy), func(t *testing.T) {
					o := f.opts
					o.mode, o.extra = mode, fmt.Sprintf(o.extra, policy)
					r := startRig(t, o)
					if f.break_ != nil {
						f.break_(r)
					}
					marker := fmt.Sprintf("prefill %s %s %s", mode, f.name, policy)
					path, body := request("chat", false, marker)
					resp, got := r.must(t, path, body, nil)

					attempts := recordsWith(r.prefill, marker)
					if f.cancelled {
						waitFor(t, 5*time.Second, "the engines to see the prefill attempts cancelled", func() bool {
							attempts = recordsWith(r.prefill, marker)
							return !slices.ContainsFunc(attempts, func(rec pdsim.Record) bool { return !rec.Canceled })
						})
					}
					if r.prefill != nil && len(attempts) != f.tries {
						t.Errorf("%d prefill attempts, want %d", len(attempts), f.tries)
					}
					if f.attempt != nil {
						f.attempt(t, attempts)
					}
					decoded := recordsWith(r.decode, marker)
					if policy == "fail" {
						if resp.StatusCode != f.failed || !strings.Contains(got, "prefill leg failed") {
							t.Errorf("status %d (%.300s), want %d \"prefill leg failed\"", resp.StatusCode, got, f.failed)
						}
						if len(decoded) != 0 {
							t.Errorf("a failed request still reached the decode engine: %s", decoded[0].Body)
						}
					} else {
						if resp.StatusCode != http.StatusOK {
							t.Fatalf("status %d (%.300s), want 200 from the decode engine alone", resp.StatusCode, got)
						}
						checkCompletion(t, false, got)
						if len(decoded) != 1 || decoded[0].KV != "none" || strings.Contains(string(decoded[0].Body), "kv_transfer_params") {
							t.Errorf("decode legs %+v, want one plain request the engine recomputes", decoded)
						}
					}
					if f.break_ == nil {
						// Nothing to heal: extproc answers the same again, and stays alive.
						if again, _ := r.must(t, path, body, nil); again.StatusCode != resp.StatusCode {
							t.Errorf("the same request again: status %d, then %d", resp.StatusCode, again.StatusCode)
						}
						r.alive(t)
						return
					}
					r.clearPrefillFaults()
					r.healthy(t, marker+" after")
				})
			}
		}
	}
}

// TestFaultPrefillReturnsNoTransferParams: a prefill engine without a KV
// connector (here a simulator in the decode role) answers 200 with
// kv_transfer_params null. That is a failed prefill, counted as one: the
// decode leg goes decode-only (prefill.on_failure's default), without
// params, and the engine recomputes the prompt.
func TestFaultPrefillReturnsNoTransferParams(t *testing.T) {
	for _, mode := range []string{"full_duplex", "buffered"} {
		t.Run(mode, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: mode, prefillRole: pdsim.RoleDecode})
			marker := "no params " + mode
			path, body := request("completions", true, marker)
			resp, got := r.must(t, path, body, nil)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %.300s", resp.StatusCode, got)
			}
			checkCompletion(t, true, got)
			p, d := recordsWith(r.prefill, marker), recordsWith(r.decode, marker)
			if len(p) != 1 || !strings.Contains(string(p[0].Body), `"do_remote_decode":true`) {
				t.Errorf("prefill legs %+v, want one asking for remote decode", p)
			}
			if len(d) != 1 || d[0].KV != "none" || strings.Contains(string(d[0].Body), "kv_transfer_params") {
				t.Errorf("decode legs %+v, want one without kv_transfer_params, recomputed", d)
			}
			for _, series := range []string{"pd_extproc_kv_params_missing_total", `pd_extproc_prefill_failures_total{reason="no_kv_params"}`,
				`pd_extproc_pd_decisions_total{reason="prefill_failed"}`} {
				if n := r.metric(t, series); n != 1 {
					t.Errorf("%s = %v, want 1", series, n)
				}
			}
		})
	}
}

// A prefill engine answers 200 with kv_transfer_params for KV the decode
// engine cannot pull (its lease ran out, its side channel unreachable): under
// vLLM's default kv_load_failure_policy the decode engine fails the request,
// with a 500, or on a stream that answered 200 already with an error event.
// That engine must leave the pool after its consecutive failures, as one
// answering 500 itself does, and not fail its share of requests for good. On
// a Messages stream vLLM's error event is the Anthropic API's, after its
// message_start.
func TestAPrefillEngineWhoseKVCannotBePulledIsEjected(t *testing.T) {
	for _, tc := range []struct {
		api, streamError string
		stream           bool
	}{{"chat", `data: {"error"`, true}, {"chat", "", false}, {"messages", "event: error\ndata: {\"type\":\"error\"", true}, {"messages", "", false}} {
		stream := tc.stream
		t.Run(fmt.Sprintf("%s stream %v", tc.api, stream), func(t *testing.T) {
			r := startRig(t, rigOptions{prefillPool: "policy: round-robin, health: {consecutive_failures: 2, base_ejection: 1m}"})
			r.prefill[0].SetFaults(pdsim.Faults{LoseKV: true})
			const requests = 20
			var failed []int
			for i := range requests {
				path, body := request(tc.api, stream, fmt.Sprintf("lost KV %d", i))
				resp, got := r.must(t, path, body, nil)
				switch {
				case !stream && resp.StatusCode == http.StatusInternalServerError,
					stream && resp.StatusCode == http.StatusOK && strings.Contains(got, tc.streamError):
					failed = append(failed, i)
				case resp.StatusCode != http.StatusOK:
					t.Fatalf("request %d: status %d: %s", i, resp.StatusCode, got)
				}
			}
			// Round robin sends every other request to the engine that loses
			// its KV, until two in a row have failed.
			lost, served := legsOn(r.prefill, "lost KV")[0], legsOn(r.prefill, "lost KV")[1]
			if len(failed) != 2 || lost != 2 || served != requests-2 {
				t.Errorf("failed requests %v; prefill legs %d on the engine losing its KV, %d on the other; want 2 failed, 2 and %d legs",
					failed, lost, served, requests-2)
			}
			wantStreamErrors := 0.0
			if stream {
				wantStreamErrors = 2
			}
			if n := r.metric(t, `pd_extproc_stream_errors_total{mode="pd"}`); n != wantStreamErrors {
				t.Errorf(`pd_extproc_stream_errors_total{mode="pd"} = %v, want %v`, n, wantStreamErrors)
			}
			if n := r.metric(t, fmt.Sprintf(`pd_extproc_endpoint_ejections_total{endpoint=%q,pool="prefill"}`, r.prefill[0].Addr())); n != 1 {
				t.Errorf("the engine losing its KV was ejected %v times, want 1", n)
			}
		})
	}
}

// TestPrefillRedirectIsNotFollowed: the prefill leg goes only to
// configured endpoints (docs/architecture.md, Security rules). An engine (or whatever answers on its
// port) that redirects must not send the prompt, the client's Authorization
// and the KV handoff somewhere else.
func TestPrefillRedirectIsNotFollowed(t *testing.T) {
	for _, code := range []int{http.StatusFound, http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		t.Run(fmt.Sprint(code), func(t *testing.T) {
			elsewhere := newRecorder(t, "")
			redirector := httptest.NewServer(http.RedirectHandler(elsewhere.URL+"/v1/chat/completions", code))
			t.Cleanup(redirector.Close)
			r := startRig(t, rigOptions{prefills: -1, prefillAddrs: func([]*pdsim.Server) []string { return []string{redirector.Listener.Addr().String()} }})
			path, body := request("chat", false, fmt.Sprintf("redirect %d", code))
			resp, got := r.must(t, path, body, http.Header{"Authorization": {"Bearer sk-client"}})
			if _, paths := elsewhere.seen(); len(paths) != 0 {
				t.Errorf("the prefill leg followed a %d redirect to an unconfigured host: %v", code, paths)
			}
			// The redirect is a failed attempt: decode-only by default.
			if resp.StatusCode != http.StatusOK {
				t.Errorf("status %d (%.300s), want 200 decode-only after a redirecting prefill", resp.StatusCode, got)
			}
		})
	}
}

// TestFaultSlowPrefillPastEnvoysMessageTimer: in BUFFERED mode Envoy times
// each message (envoy-buffered.yaml: message_timeout 1s). A 1.5 s prefill
// leg outlives it; extproc sends override_message_timeout after
// envoy.override_after (150 ms), which Envoy honours up to
// max_message_timeout (120 s there). With max_message_timeout 0 Envoy ignores
// the override and answers 504: the override is what saves the request.
func TestFaultSlowPrefillPastEnvoysMessageTimer(t *testing.T) {
	for _, tt := range []struct {
		name              string
		maxMessageTimeout *time.Duration // nil: as in envoy-buffered.yaml
		want              int
	}{
		{"override honoured", nil, http.StatusOK},
		{"override disabled", new(time.Duration), http.StatusGatewayTimeout},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: "buffered", envoy: func(c *envoyemu.Config) {
				if c.Failure.MessageTimeout != time.Second {
					t.Fatalf("envoy-buffered.yaml message_timeout is %v; this test assumes 1s", c.Failure.MessageTimeout)
				}
				if tt.maxMessageTimeout != nil {
					c.Failure.MaxMessageTimeout = *tt.maxMessageTimeout
				}
			}})
			for _, p := range r.prefill {
				p.SetFaults(pdsim.Faults{Delay: 1500 * time.Millisecond})
			}
			marker := "slow prefill " + tt.name
			path, body := request("chat", true, marker)
			resp, got := r.must(t, path, body, nil)
			if resp.StatusCode != tt.want {
				t.Fatalf("status %d (%.300s, %s), want %d", resp.StatusCode, got, resp.Header.Get(envoyemu.DetailsHeader), tt.want)
			}
			decoded := recordsWith(r.decode, marker)
			if tt.want == http.StatusOK {
				checkCompletion(t, true, got)
				if len(decoded) != 1 || decoded[0].KV != "hit" {
					t.Errorf("decode legs %+v, want one KV hit from the slow prefill", decoded)
				}
				return
			}
			if d := resp.Header.Get(envoyemu.DetailsHeader); d != "ext_proc_error_per-message_timeout_exceeded" {
				t.Errorf("details %q, want Envoy's message timeout", d)
			}
			checkEnvoyError(t, resp, got, http.StatusGatewayTimeout, "server_error",
				"request processing failed: ext_proc_error_per-message_timeout_exceeded")
			if len(decoded) != 0 {
				t.Errorf("the timed-out request still reached the decode engine")
			}
			// Envoy reset the ext_proc stream: the prefill leg is cancelled with it.
			waitFor(t, 10*time.Second, "the prefill leg to be cancelled", func() bool {
				recs := recordsWith(r.prefill, marker)
				return len(recs) == 1 && recs[0].Canceled
			})
			r.clearPrefillFaults()
			r.healthy(t, marker+" after")
		})
	}
}

// ---------------------------------------------------------------- decode and client faults

// TestFaultDecodeDiesMidStream: the decode engine goes away while tokens
// stream. The client sees the stream cut (Envoy resets it: the response had
// started), extproc stays healthy, a request while the engine is down gets
// Envoy's 503 in OpenAI's error JSON, and once the engine is back requests complete again.
func TestFaultDecodeDiesMidStream(t *testing.T) {
	for _, mode := range []string{"full_duplex", "buffered"} {
		t.Run(mode, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: mode, decodes: 1, outputTokens: 1_000_000, maxModelLen: 2_000_000})
			marker := "decode dies " + mode
			path, body := request("chat", true, marker)
			body = strings.Replace(body, `"max_tokens":4`, `"max_tokens":1000000`, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			resp := r.stream(t, ctx, path, body) // a token before the kill
			addr := r.decode[0].Addr()
			r.decode[0].Close()
			rest, err := io.ReadAll(resp.Body)
			// Cut: a reset (a read error) or, when the engine still closed its
			// chunked answer properly, a stream without its final [DONE].
			if err == nil && strings.Contains(string(rest), "[DONE]") {
				t.Errorf("the client saw a complete stream: the cut must be visible")
			}
			t.Logf("after the kill the client read %d more bytes, then %v", len(rest), err)
			if recs := recordsWith(r.decode, marker); len(recs) != 1 || !recs[0].Canceled {
				t.Errorf("decode records %+v, want the one stream, cancelled", recs)
			}

			// Envoy's connect failure, in OpenAI's error JSON (local_reply_config).
			down, got := r.must(t, path, strings.Replace(body, marker, marker+" while down", 1), nil)
			checkEnvoyError(t, down, got, http.StatusServiceUnavailable, "upstream_error", "upstream connect error")
			r.restartDecode(t, 0, addr)
			r.healthy(t, marker+" after")
			waitFor(t, 10*time.Second, "extproc to close every stream", func() bool {
				return r.metric(t, "pd_extproc_streams_in_flight") == 0
			})
		})
	}
}

// TestFaultClientDisconnectsDuringPrefill: a client that leaves while the
// sequential prefill leg runs makes Envoy reset the ext_proc stream; extproc
// cancels the leg (nobody will use the KV), and the engine sees it cancelled.
// (kv-sglang's concurrent leg is deliberately not cancelled: the decode engine
// may already be waiting to pair with it; see pkg/handlers.)
func TestFaultClientDisconnectsDuringPrefill(t *testing.T) {
	for _, mode := range []string{"full_duplex", "buffered"} {
		for _, connector := range []string{"kv-nixl", "kv-shared-storage"} {
			t.Run(mode+"/"+connector, func(t *testing.T) {
				r := startRig(t, rigOptions{mode: mode, connector: connector})
				for _, p := range r.prefill {
					p.SetFaults(pdsim.Faults{Delay: time.Minute})
				}
				marker := "client leaves " + mode + connector
				path, body := request("chat", false, marker)
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error, 1)
				go func() {
					_, _, err := r.send(ctx, path, body, nil)
					done <- err
				}()
				waitFor(t, 10*time.Second, "the prefill leg to start", func() bool { return len(recordsWith(r.prefill, marker)) == 1 })
				cancel()
				if err := <-done; err == nil {
					t.Fatal("the request completed although the client left")
				}
				waitFor(t, 10*time.Second, "the prefill engine to see the leg cancelled", func() bool {
					recs := recordsWith(r.prefill, marker)
					return len(recs) == 1 && recs[0].Canceled
				})
				if n := len(recordsWith(r.prefill, marker)); n != 1 {
					t.Errorf("%d prefill attempts: a cancelled leg must not be retried", n)
				}
				if d := recordsWith(r.decode, marker); len(d) != 0 {
					t.Errorf("the abandoned request reached the decode engine")
				}
				r.clearPrefillFaults()
				r.healthy(t, marker+" after")
			})
		}
	}
}

// TestFaultAConcurrentLegOfAnUnservedDecodeIsCut: a kv-mooncake or
// kv-sglang prefill leg still running when the decode engine's answer ends
// the decode request unserved (a 400; under kv-mooncake a 500 too) has
// nothing to pair with: extproc cuts it, and the prefill engine sees it
// cancelled (vLLM aborts it and frees the prompt's blocks, which a Mooncake
// prefill engine would otherwise compute and keep for a pull that never
// comes, up to VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT). Before, it ran on until
// prefill.timeout (30 s here).
func TestFaultAConcurrentLegOfAnUnservedDecodeIsCut(t *testing.T) {
	for _, tt := range []struct {
		name, connector string
		fault           pdsim.Faults // the decode engine's
		status          int          // the client's
	}{
		{"kv-mooncake, the decode engine fails", "kv-mooncake", pdsim.Faults{FailStatus: http.StatusInternalServerError}, http.StatusInternalServerError},
		{"kv-mooncake, the decode engine refuses", "kv-mooncake", pdsim.Faults{FailStatus: http.StatusBadRequest}, http.StatusBadRequest},
		{"kv-sglang, the decode engine refuses", "kv-sglang", pdsim.Faults{FailStatus: http.StatusBadRequest}, http.StatusBadRequest},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{connector: tt.connector, prefills: 1, decodes: 1, handshake: time.Minute})
			r.healthy(t, "before "+tt.name) // kv-mooncake: the engine ids are read
			r.prefill[0].SetFaults(pdsim.Faults{Delay: time.Minute})
			r.decode[0].SetFaults(tt.fault)
			marker := "an unserved decode, " + tt.name
			path, body := request("chat", false, marker)
			if resp, got := r.must(t, path, body, nil); resp.StatusCode != tt.status {
				t.Errorf("status %d (%.200s), want %d", resp.StatusCode, got, tt.status)
			}
			waitFor(t, 10*time.Second, "the prefill engine to see its leg cancelled", func() bool {
				recs := recordsWith(r.prefill, marker)
				return len(recs) == 1 && recs[0].Canceled
			})
			r.prefill[0].SetFaults(pdsim.Faults{})
			r.decode[0].SetFaults(pdsim.Faults{})
			r.healthy(t, "after "+tt.name)
		})
	}
}

// TestFaultAPrefillAttemptTimedOutIsCancelledAtItsEngine: a sequential leg
// past prefill.attempt_timeout is cancelled before the next endpoint is
// tried, so its engine aborts it and keeps no blocks for it (a NIXL prefill
// engine keeps a finished prefill's for its lease, kv_lease_duration).
func TestFaultAPrefillAttemptTimedOutIsCancelledAtItsEngine(t *testing.T) {
	r := startRig(t, rigOptions{prefillPool: "policy: round-robin", extra: "prefill: {timeout: 10s, attempt_timeout: 300ms}"})
	r.prefill[0].SetFaults(pdsim.Faults{Delay: time.Minute})
	const marker = "an attempt that timed out"
	for i := range 2 { // round robin: one of them tries the slow engine first
		path, body := request("chat", false, fmt.Sprintf("%s %d", marker, i))
		if resp, got := r.must(t, path, body, nil); resp.StatusCode != http.StatusOK || resp.Header.Get("x-pdsim-kv") != "hit" {
			t.Errorf("request %d: status %d, KV %q (%.200s), want 200 with the KV of the other engine", i, resp.StatusCode, resp.Header.Get("x-pdsim-kv"), got)
		}
	}
	waitFor(t, 10*time.Second, "the slow engine to see its leg cancelled", func() bool {
		recs := recordsWith(r.prefill[:1], marker)
		return len(recs) >= 1 && !slices.ContainsFunc(recs, func(rec pdsim.Record) bool { return !rec.Canceled })
	})
}

// ---------------------------------------------------------------- extproc faults

// TestFaultExtprocRestartsUnderLoad kills extproc (SIGKILL: no graceful
// drain) with requests inside it and more arriving, then starts a new one on
// the same gRPC port. The requests it held fail with Envoy's 500 (the ext_proc
// stream broke, failure_mode_allow is false), requests while it is down fail
// fast the same way, nothing hangs, and once it is back requests complete.
func TestFaultExtprocRestartsUnderLoad(t *testing.T) {
	r := startRig(t, rigOptions{})
	for _, p := range r.prefill {
		p.SetFaults(pdsim.Faults{Delay: time.Minute})
	}
	const held = 4
	type outcome struct {
		status  int
		details string
		err     error
	}
	heldOut := make(chan outcome, held)
	for i := range held {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			path, body := request("chat", i%2 == 0, fmt.Sprintf("held %d", i))
			resp, _, err := r.send(ctx, path, body, nil)
			if err != nil {
				heldOut <- outcome{err: err}
				return
			}
			heldOut <- outcome{status: resp.StatusCode, details: resp.Header.Get(envoyemu.DetailsHeader)}
		}()
	}
	waitFor(t, 10*time.Second, "every held request to reach a prefill engine", func() bool { return len(recordsWith(r.prefill, "held")) == held })

	// Background load across the restart: bounded concurrency, every outcome classified.
	var (
		mu       sync.Mutex
		statuses = map[int]int{}
		errs     []error
	)
	stop := make(chan struct{})
	var load sync.WaitGroup
	for w := range 3 {
		load.Go(func() {
			pace := time.NewTicker(20 * time.Millisecond) // a steady rate, not synchronisation
			defer pace.Stop()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-pace.C:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				path, body := request("completions", i%2 == 0, fmt.Sprintf("load %d-%d", w, i))
				resp, _, err := r.send(ctx, path, body, nil)
				cancel()
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					statuses[resp.StatusCode]++
				}
				mu.Unlock()
			}
		})
	}

	r.extproc.Kill()
	for range held {
		o := <-heldOut
		if o.err != nil || (o.status != http.StatusInternalServerError && o.status != http.StatusServiceUnavailable) {
			t.Errorf("a request inside the killed extproc ended with %d %q (%v), want Envoy's 500/503", o.status, o.details, o.err)
		}
	}
	r.clearPrefillFaults()
	down, _ := r.must(t, "/v1/completions", `{"model":"pdsim","prompt":"while down"}`, nil)
	if down.StatusCode != http.StatusInternalServerError {
		t.Errorf("while extproc is down: status %d, want Envoy's 500 (status_on_error)", down.StatusCode)
	}

	r.restartExtproc(t)
	// Envoy's gRPC client reconnects with backoff (1 s, then longer): poll, bounded.
	waitFor(t, 15*time.Second, "a request to complete through the new extproc", func() bool {
		resp, _, err := r.send(context.Background(), "/v1/completions", `{"model":"pdsim","prompt":"back?","max_tokens":2}`, nil)
		return err == nil && resp.StatusCode == http.StatusOK
	})
	close(stop)
	load.Wait()
	for range 5 {
		r.healthy(t, "after the restart")
	}
	for status, n := range statuses {
		if status != http.StatusOK && status != http.StatusInternalServerError && status != http.StatusServiceUnavailable {
			t.Errorf("%d load requests ended with %d: only 200, or Envoy's 500/503 while extproc was away, are expected", n, status)
		}
	}
	if len(errs) > 0 {
		t.Errorf("%d load requests broke at the transport (%v): Envoy must answer every request", len(errs), errs[0])
	}
	t.Logf("load across the restart: %v", statuses)
}

// TestFaultOverloadIs429 caps the requests extproc works on at once
// (limits.max_concurrent_streams). Past the cap a request is shed with 429 and
// Retry-After before any prefill work, the held ones complete, and the cap
// frees up as they end. Shedding has to be an ImmediateResponse: a gRPC-level
// limit (grpc.MaxConcurrentStreams) would make Envoy queue or answer 500.
func TestFaultOverloadIs429(t *testing.T) {
	r := startRig(t, rigOptions{extra: "limits: {max_concurrent_streams: 2}"})
	for _, p := range r.prefill {
		p.SetFaults(pdsim.Faults{Delay: time.Second})
	}
	held := make(chan int, 2)
	for i := range 2 {
		go func() {
			path, body := request("chat", false, fmt.Sprintf("capped %d", i))
			resp, _, err := r.send(context.Background(), path, body, nil)
			if err != nil {
				held <- -1
				return
			}
			held <- resp.StatusCode
		}()
	}
	waitFor(t, 10*time.Second, "both requests to hold a stream", func() bool { return len(recordsWith(r.prefill, "capped")) == 2 })
	path, body := request("chat", false, "one too many")
	resp, got := r.must(t, path, body, nil)
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "1" || !strings.Contains(got, "max_concurrent_streams") {
		t.Errorf("over the cap: status %d, Retry-After %q, body %.200s; want 429 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"), got)
	}
	if n := len(recordsWith(r.prefill, "one too many")); n != 0 {
		t.Errorf("a shed request still ran its prefill leg")
	}
	for range 2 {
		if s := <-held; s != http.StatusOK {
			t.Errorf("a request under the cap ended with %d", s)
		}
	}
	r.clearPrefillFaults()
	r.healthy(t, "after the overload")
}

// ---------------------------------------------------------------- kv-sglang pairs

// TestSGLangNeverGoesDecodeOnly: an SGLang decode server in PD mode
// cannot serve a request without bootstrap fields (pdsim: 400 "bootstrap_room
// is required"; SGLang with DP attention asserts "send to the router instead").
// So under kv-sglang extproc never routes decode-only: a batch goes P/D with
// one room (SGLang adds the prompt's index), n>1 is refused by default (its
// samples would share a room, on which SGLang is reported to hang), and with
// no prefill endpoint ready the answer is 503. Any client can send either.
func TestSGLangNeverGoesDecodeOnly(t *testing.T) {
	r := startRig(t, rigOptions{connector: "kv-sglang"})
	resp, got := r.must(t, "/v1/completions", `{"model":"pdsim","prompt":["two prompts","in a batch"],"max_tokens":4}`, nil)
	if resp.StatusCode != http.StatusOK || resp.Header.Get("x-pdsim-kv") != "hit" {
		t.Errorf("a batch under kv-sglang: status %d, KV %q (%.200s), want 200 through P/D", resp.StatusCode, resp.Header.Get("x-pdsim-kv"), got)
	}
	resp, got = r.must(t, "/v1/completions", `{"model":"pdsim","prompt":"two samples","n":2,"max_tokens":4}`, nil)
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("n:2 under kv-sglang: status %d (%.200s), want 400", resp.StatusCode, got)
	}
	if recs := append(recordsWith(r.decode, "two samples"), recordsWith(r.prefill, "two samples")...); len(recs) != 0 {
		t.Errorf("a refused request reached an engine: %+v", recs)
	}
}

// TestConcurrentLegsPassOverAPrefillEngineThatIsGone: a kv-sglang or
// kv-mooncake prefill leg whose engine refuses the connection was never
// sent, and its decode leg not yet either: the leg goes to the next prefill
// endpoint and the request is served. Every request of a round-robin over a
// prefill engine that has gone and a live one comes back 200 with the KV;
// none waits for a KV that never comes.
func TestConcurrentLegsPassOverAPrefillEngineThatIsGone(t *testing.T) {
	for _, connector := range []string{"kv-sglang", "kv-mooncake"} {
		t.Run(connector, func(t *testing.T) {
			r := startRig(t, rigOptions{connector: connector, prefillPool: "policy: round-robin"})
			r.prefill[1].Close() // after its engine ids were read (kv-mooncake): it is pairable, and gone
			marker := "a prefill engine is gone " + connector
			for i := range 4 {
				path, body := request("chat", false, fmt.Sprintf("%s %d", marker, i))
				resp, got := r.must(t, path, body, nil)
				if resp.StatusCode != http.StatusOK || resp.Header.Get("x-pdsim-kv") != "hit" {
					t.Errorf("request %d: status %d, KV %q (%.200s), want 200 and the KV from the live prefill engine", i, resp.StatusCode, resp.Header.Get("x-pdsim-kv"), got)
				}
			}
			if n := len(recordsWith(r.prefill[:1], marker)); n != 4 {
				t.Errorf("the live prefill engine took %d legs, want all 4", n)
			}
		})
	}
}

// TestSGLangFailuresAreNotBlamedOnThePartner: kv-sglang legs pair up, so
// one side's failure shows on the other: a prefill leg that fails ends its
// decode request (TestFailedConcurrentLegCallsBackItsDecode), and a
// decode that dies leaves its prefill leg waiting (500). Counting each against
// the endpoint that reported it would eject healthy engines of the other pool;
// with one endpoint per pool the next requests would then fail although
// nothing is wrong any more. The next request must succeed.
func TestSGLangFailuresAreNotBlamedOnThePartner(t *testing.T) {
	const health = "health: {consecutive_failures: 1, base_ejection: 1m}"
	for _, tt := range []struct {
		name, spared string                     // the pool of the endpoint that must not be blamed
		blamed       string                     // the pool of the one that must, if any
		extra        string                     // more config
		fault        func(t *testing.T, r *rig) // break one side for one request, then heal it
	}{
		{"a failing prefill's decode, reset for it, is not blamed", "decode", "", "", func(t *testing.T, r *rig) {
			r.prefill[0].SetFaults(pdsim.Faults{FailStatus: http.StatusServiceUnavailable})
			path, body := request("chat", false, "prefill fails")
			r.must(t, path, body, nil) // 502, and the decode request is reset
			r.prefill[0].SetFaults(pdsim.Faults{})
		}},
		{"a failing prefill's streamed decode, reset for it, is not blamed", "decode", "", "", func(t *testing.T, r *rig) {
			r.prefill[0].SetFaults(pdsim.Faults{FailStatus: http.StatusServiceUnavailable})
			path, body := request("chat", true, "prefill fails")
			r.must(t, path, body, nil) // 502, and the decode request is reset
			r.prefill[0].SetFaults(pdsim.Faults{})
		}},
		// A leg silent past prefill.timeout may be waiting for its decode (SGLang's
		// prefill does for up to 300 s): held against neither endpoint.
		{"a prefill that never answers, streamed, ejects neither", "decode", "", "prefill: {timeout: 1s}", func(t *testing.T, r *rig) {
			r.prefill[0].SetFaults(pdsim.Faults{Delay: 3 * time.Second}) // the decode gives up first, at 300 ms; the leg at 1 s
			path, body := request("chat", true, "prefill hangs")
			if _, got := r.must(t, path, body, nil); !strings.Contains(got, `data: {"error"`) {
				t.Errorf("the decode stream %q has no error event", got)
			}
			r.prefill[0].SetFaults(pdsim.Faults{})
			waitFor(t, 10*time.Second, "the prefill leg to be given up", func() bool {
				return r.metric(t, `pd_extproc_prefill_failures_total{reason="timeout"}`) == 1
			})
		}},
		{"a decode that fails at once is blamed, not its waiting prefill", "prefill", "decode", "", func(t *testing.T, r *rig) {
			r.decode[0].SetFaults(pdsim.Faults{FailStatus: http.StatusInternalServerError})
			path, body := request("chat", true, "decode fails")
			r.must(t, path, body, nil) // the prefill leg waits for the handshake, then answers 500
			r.decode[0].SetFaults(pdsim.Faults{})
			waitFor(t, 10*time.Second, "the prefill leg to give up", func() bool {
				recs := recordsWith(r.prefill, "decode fails")
				return len(recs) == 1 && recs[0].Status != 0
			})
		}},
		{"a decode that refuses at once has its waiting prefill leg cut: neither is ejected", "prefill", "", "", func(t *testing.T, r *rig) {
			r.decode[0].SetFaults(pdsim.Faults{FailStatus: http.StatusBadRequest})
			path, body := request("chat", false, "decode refuses")
			r.must(t, path, body, nil) // no handshake will come: the leg is cut, not left to prefill.timeout
			r.decode[0].SetFaults(pdsim.Faults{})
			waitFor(t, 10*time.Second, "the prefill leg to be cut", func() bool {
				return r.metric(t, `pd_extproc_prefill_failures_total{reason="cancelled"}`) == 1
			})
		}},
		{"a dead decode ejects the prefill", "prefill", "", "", func(t *testing.T, r *rig) {
			r.decode[0].SetFaults(pdsim.Faults{DropConnections: true})
			path, body := request("chat", false, "decode dies")
			r.must(t, path, body, nil) // Envoy's 503; the prefill leg waits for a handshake, then fails
			waitFor(t, 10*time.Second, "the prefill leg to give up", func() bool {
				recs := recordsWith(r.prefill, "decode dies")
				return len(recs) == 1 && recs[0].Status != 0
			})
			r.decode[0].SetFaults(pdsim.Faults{})
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			handshake := 300 * time.Millisecond
			if strings.Contains(tt.name, "refuses") {
				handshake = 3 * time.Second // SGLang's is 300 s: the leg waits, unless it is cut
			}
			r := startRig(t, rigOptions{connector: "kv-sglang", prefills: 1, decodes: 1, handshake: handshake,
				prefillPool: health, decodePool: health, extra: tt.extra})
			tt.fault(t, r)
			if tt.blamed != "prefill" { // the only prefill endpoint is out: kv-sglang answers 503 for a while
				r.healthy(t, "after "+tt.name) // the decode pool routes among ejected endpoints, so also:
			}
			sims := map[string]*pdsim.Server{"prefill": r.prefill[0], "decode": r.decode[0]}
			for pool, want := range map[string]float64{tt.spared: 0, tt.blamed: 1} {
				if pool == "" {
					continue
				}
				series := fmt.Sprintf(`pd_extproc_endpoint_ejections_total{endpoint=%q,pool=%q}`, sims[pool].Addr(), pool)
				if n := r.metric(t, series); n != want {
					t.Errorf("%s = %v, want %v", series, n, want)
				}
			}
		})
	}
}

// TestFailedConcurrentLegCallsBackItsDecode: a kv-sglang or kv-mooncake
// prefill leg that fails leaves its decode request waiting for KV that never
// comes, holding the decode engine's slots until the engine's waiting
// timeout (SGLang's; Mooncake's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s;
// here the simulator's handshake bound, 20 s, as long as the client waits).
// While the decode engine has not answered, extproc answers the request with
// the leg's error out of turn: Envoy sends it to the client and resets the
// decode request, which the engine sees cancelled, if it got it at all.
func TestFailedConcurrentLegCallsBackItsDecode(t *testing.T) {
	for _, tt := range []struct{ name, connector, api string }{
		{"chat", "kv-sglang", "chat"},
		{"chat streamed", "kv-sglang", "chat"},
		{"sglang generate streamed", "kv-sglang", "sglang/generate"},
		{"mooncake chat", "kv-mooncake", "chat"},
		{"mooncake chat streamed", "kv-mooncake", "chat"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := startRig(t, rigOptions{connector: tt.connector, prefills: 1, decodes: 1, handshake: 20 * time.Second})
			r.prefill[0].SetFaults(pdsim.Faults{FailStatus: http.StatusServiceUnavailable})
			marker := "a failed leg, " + tt.name
			path, body := request(tt.api, strings.HasSuffix(tt.name, "streamed"), marker)
			resp, got := r.must(t, path, body, nil)
			if resp.StatusCode != http.StatusBadGateway || !strings.Contains(got, "prefill leg failed") {
				t.Errorf("status %d, body %.300s; want 502, prefill leg failed", resp.StatusCode, got)
			}
			waitFor(t, 10*time.Second, "the decode request to end", func() bool {
				return !slices.ContainsFunc(recordsWith(r.decode, marker), func(rec pdsim.Record) bool { return !rec.Canceled && rec.Status == 0 })
			})
			for _, rec := range recordsWith(r.decode, marker) {
				if !rec.Canceled {
					t.Errorf("the decode engine answered its request %d, want it reset", rec.Status)
				}
			}
			r.prefill[0].SetFaults(pdsim.Faults{})
			r.healthy(t, "after "+tt.name)
		})
	}
}

// waitingDecode is an SGLang decode server whose prefill never hands it the
// KV: it sends its stream's 200 at once (uvicorn writes the headers as the
// response starts) and no token, until its request is reset, which closes
// ended. Health checks and scrapes get a 200.
func waitingDecode(t *testing.T, ended chan<- struct{}) *httptest.Server {
	decode := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			w.WriteHeader(http.StatusOK)
			return
		}
		w.Header().Set("content-type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
		close(ended)
	}))
	t.Cleanup(decode.Close)
	return decode
}

// TestSGLangFailedLegResetsAStreamThatBegan: SGLang's decode server sends a
// stream's 200 before it has the KV (uvicorn writes the headers as the
// response starts). A prefill leg that fails after the client has that 200
// still calls the request back, and Envoy, whose response has started,
// resets it: the client's stream is cut, and the decode engine sees its
// request cancelled at once.
func TestSGLangFailedLegResetsAStreamThatBegan(t *testing.T) {
	fail, ended := make(chan struct{}), make(chan struct{})
	decode := waitingDecode(t, ended)
	prefill := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.NotFound(w, r)
			return
		}
		<-fail
		w.Header().Set("content-type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		w.Write([]byte(`{"object":"error","message":"busy","type":"ServiceUnavailable","code":503}`))
	}))
	defer prefill.Close()
	defer close(fail)
	r := startRig(t, rigOptions{connector: "kv-sglang", prefills: -1, decodes: 1,
		prefillAddrs: func([]*pdsim.Server) []string { return []string{prefill.Listener.Addr().String()} },
		decodeAddrs:  func([]*pdsim.Server) []string { return []string{decode.Listener.Addr().String()} }})
	path, body := request("chat", true, "a stream that began")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.proxy.URL()+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := testbed.Client.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("want the stream's 200 first: %v %v", resp, err)
	}
	defer resp.Body.Close()
	select { // the client has its 200: the leg fails now
	case fail <- struct{}{}:
	case <-ctx.Done():
		t.Fatal("the prefill leg never reached its engine")
	}
	got, err := io.ReadAll(resp.Body)
	switch {
	case ctx.Err() != nil:
		t.Fatalf("the stream was not cut: %v", err)
	case err == nil:
		t.Errorf("the stream ended cleanly (%.300s); want it cut", got)
	}
	enginetest.Receive(t, ended, "the decode request was not reset")
}

// TestSGLangGenerateLegAbortedAfterItsHeaders: SGLang's /generate stream
// does not say a failure in an error event: a prefill leg whose bootstrap
// fails (here no decode engine ever joins its room) answers 200, then the
// scheduler's abort as an ordinary chunk, meta_info.finish_reason
// {"type": "abort", "status_code": 500}, then [DONE]
// (_handle_abort_finish_reason in SGLang's tokenizer_manager.py). That leg
// failed, so its decode request, which waits for KV that never comes, is
// called back, and reset as its stream has begun.
func TestSGLangGenerateLegAbortedAfterItsHeaders(t *testing.T) {
	ended := make(chan struct{})
	decode := waitingDecode(t, ended)
	r := startRig(t, rigOptions{connector: "kv-sglang", prefills: 1, decodes: 1, handshake: 200 * time.Millisecond,
		decodeAddrs: func([]*pdsim.Server) []string { return []string{decode.Listener.Addr().String()} }})
	path, body := request("sglang/generate", true, "an aborted generate leg")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.proxy.URL()+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := testbed.Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	go io.Copy(io.Discard, resp.Body)
	enginetest.Receive(t, ended, "the decode request of a prefill leg that SGLang aborted was never called back")
}

// TestFaultSlowBodyIs408: a client that sends part of its body and stalls
// gets 408 once limits.body_timeout has passed, through Envoy, in both body
// modes; the stalled request holds no slot after that (the cap here is one).
func TestFaultSlowBodyIs408(t *testing.T) {
	for _, mode := range []string{"full_duplex", "buffered"} {
		t.Run(mode, func(t *testing.T) {
			r := startRig(t, rigOptions{mode: mode, extra: "limits: {body_timeout: 1s, max_concurrent_streams: 1}"})
			path, body := request("chat", false, "a slow client")
			pr, pw := io.Pipe()
			defer pw.Close() // the rest of the body never comes
			req, err := http.NewRequest(http.MethodPost, r.proxy.URL()+path, pr)
			if err != nil {
				t.Fatal(err)
			}
			req.ContentLength = int64(len(body))
			req.Header.Set("Content-Type", "application/json")
			go pw.Write([]byte(body[:len(body)/2]))
			start := time.Now()
			resp, err := testbed.Client.Do(req)
			if err != nil {
				t.Fatalf("POST: %v", err)
			}
			got, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(got), "limits.body_timeout") {
				t.Errorf("status %d, body %.200s; want 408 naming limits.body_timeout", resp.StatusCode, got)
			}
			if d := time.Since(start); d < time.Second {
				t.Errorf("answered after %v, before limits.body_timeout", d)
			}
			if n := r.metric(t, `pd_extproc_limit_refusals_total{limit="body_timeout"}`); n != 1 {
				t.Errorf("limit_refusals_total{limit=body_timeout} = %v, want 1", n)
			}
			r.healthy(t, "after a slow client")
		})
	}
}

// checkEnvoyError checks one of Envoy's own replies as the shipped
// local_reply_config words it: OpenAI's error JSON, this status and type, a
// message that starts so.
func checkEnvoyError(t *testing.T, resp *http.Response, got string, status int, typ, message string) {
	t.Helper()
	var e struct {
		Error struct {
			Message, Type string
			Code          int
		}
	}
	if resp.StatusCode != status || resp.Header.Get("Content-Type") != "application/json" ||
		json.Unmarshal([]byte(got), &e) != nil || e.Error.Type != typ || e.Error.Code != status ||
		!strings.HasPrefix(e.Error.Message, message) {
		t.Errorf("%d %s %q, want Envoy's %d %s in OpenAI's JSON, message %q",
			resp.StatusCode, resp.Header.Get("Content-Type"), got, status, typ, message)
	}
}
