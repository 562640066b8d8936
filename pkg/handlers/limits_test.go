package handlers_test

// What a slow or greedy client can hold of the server: a stream slot for at
// most limits.body_timeout, and request bodies within limits.max_buffered_bytes.

import (
	"context"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/response"
)

// A request whose body is not complete limits.body_timeout after its first
// message gets 408 and gives its slot back at once, even while the client
// keeps the stream open; a body complete in time is routed, and its deadline
// never fires afterwards. The bubble's clock moves only when every goroutine
// in it is blocked, so the timings are exact.
func TestSlowBodyGets408AndGivesItsSlotBack(t *testing.T) {
	const timeout = 60 * time.Second
	chat := []byte(clientChat)
	headers := func(mode filterv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
		return envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(chat))...), mode, fullDuplex)
	}
	tests := []struct {
		name   string
		msgs   []*extprocv3.ProcessingRequest // what the slow client sends at once
		finish *extprocv3.ProcessingRequest   // what it sends at 59 s; nil: nothing more
	}{
		{name: "FULL_DUPLEX, half a body", msgs: []*extprocv3.ProcessingRequest{headers(fullDuplex), envoymsg.Body(envoymsg.Request, chat[:10], false)}},
		{name: "BUFFERED, Envoy still buffering", msgs: []*extprocv3.ProcessingRequest{headers(buffered)}},
		{name: "complete at 59 s: routed", msgs: []*extprocv3.ProcessingRequest{headers(fullDuplex), envoymsg.Body(envoymsg.Request, chat[:10], false)},
			finish: envoymsg.Body(envoymsg.Request, chat[10:], true)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				m := metrics.New("kv-nixl")
				s := handlers.NewServer(&fakeRouter{}, handlers.Options{MaxStreams: 1, RetryAfter: time.Second, BodyTimeout: timeout, Metrics: m}, logr.Discard())
				rec := newRecorder()
				slow := s.Open(t.Context(), rec)
				defer slow.Close()
				for _, msg := range tt.msgs {
					if done, err := slow.Handle(msg); done || err != nil {
						t.Fatalf("the slow request ended early: %v", err)
					}
				}
				before := len(rec.all())

				time.Sleep(timeout - time.Second)
				synctest.Wait()
				if got := rec.all()[before:]; len(got) != 0 {
					t.Fatalf("replies before the deadline: %v", got)
				}
				other := drive(t, s, headers(fullDuplex), envoymsg.Body(envoymsg.Request, chat, true))
				checkOpenAIError(t, other, 429, "limits.max_concurrent_streams")

				if tt.finish != nil {
					if _, err := slow.Handle(tt.finish); err != nil {
						t.Fatal(err)
					}
					time.Sleep(time.Hour)
					synctest.Wait()
					replies := rec.all()
					if len(replies) < 2 || replies[0].GetRequestHeaders() == nil || replies[len(replies)-1].GetImmediateResponse() != nil {
						t.Fatalf("replies %v, want the request routed and nothing after", replies)
					}
					return
				}

				time.Sleep(time.Second)
				synctest.Wait()
				replies := rec.all()
				checkOpenAIError(t, replies, 408, "limits.body_timeout")
				if retry, ok := headerValue(replies[len(replies)-1].GetImmediateResponse().GetHeaders(), "retry-after"); ok {
					t.Errorf("retry-after %q on a 408: the client's own body was late", retry)
				}
				// The client keeps the stream open: its slot is free all the same.
				if replies := drive(t, s, headers(fullDuplex), envoymsg.Body(envoymsg.Request, chat, true)); len(replies) < 2 || replies[0].GetRequestHeaders() == nil {
					t.Errorf("after the 408 another request got %v, want it routed", replies)
				}
				// What the slow client sends next ends its stream, unanswered.
				if done, err := slow.Handle(envoymsg.Body(envoymsg.Request, chat, true)); !done || err != nil || len(rec.all()) != len(replies) {
					t.Errorf("a message after the 408: done %v, %v, %d replies; want the stream ended unanswered", done, err, len(rec.all())-len(replies))
				}
				if got, _ := m.Sample("pd_extproc_limit_refusals_total", map[string]string{"limit": metrics.LimitBodyTime}); got != 1 {
					t.Errorf("limit_refusals_total{limit=body_timeout} = %v, want 1", got)
				}
			})
		})
	}
}

// The request bodies held at once stay within limits.max_buffered_bytes: a
// body that would pass it gets 503 with Retry-After, and is served once the
// bodies held before it are given back, by their streams or by the
// background prefill legs still reading them.
func TestBufferedBodiesStayWithinTheirBudget(t *testing.T) {
	const mib = 1 << 20
	post := func(mode filterv3.ProcessingMode_BodySendMode, n int) *extprocv3.ProcessingRequest {
		return envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, n)...), mode, fullDuplex)
	}
	// A chunked body whose first chunk is 1 MiB takes a 1 MiB buffer.
	chunked := func() []*extprocv3.ProcessingRequest {
		return []*extprocv3.ProcessingRequest{post(fullDuplex, 2*mib), envoymsg.Body(envoymsg.Request, make([]byte, mib), false)}
	}
	whole := func(n int) []*extprocv3.ProcessingRequest {
		return []*extprocv3.ProcessingRequest{post(buffered, n), envoymsg.Body(envoymsg.Request, []byte(prompt(n)), true)}
	}
	tests := []struct {
		name   string
		second []*extprocv3.ProcessingRequest
	}{
		{"a chunked body", chunked()},
		{"a BUFFERED body", whole(mib)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := metrics.New("kv-nixl")
			r := &fakeRouter{limit: 8 * mib}
			s := handlers.NewServer(r, handlers.Options{MaxBufferedBytes: 3 * mib / 2, RetryAfter: 3 * time.Second, Metrics: m}, logr.Discard())
			held := s.Open(t.Context(), newRecorder())
			for _, msg := range chunked() {
				held.Handle(msg)
			}
			if got := gauge(t, m, "pd_extproc_request_body_buffered_bytes"); got != mib {
				t.Errorf("request_body_buffered_bytes = %v with one 1 MiB buffer held, want %d", got, mib)
			}

			replies := drive(t, s, tt.second...)
			checkOpenAIError(t, replies, 503, "limits.max_buffered_bytes")
			if retry, _ := headerValue(replies[len(replies)-1].GetImmediateResponse().GetHeaders(), "retry-after"); retry != "3" {
				t.Errorf("retry-after = %q, want 3", retry)
			}
			if got, _ := m.Sample("pd_extproc_limit_refusals_total", map[string]string{"limit": metrics.LimitBuffered}); got != 1 {
				t.Errorf("limit_refusals_total{limit=max_buffered_bytes} = %v, want 1", got)
			}

			held.Close()
			if replies := drive(t, s, tt.second...); refused(replies) {
				t.Errorf("once the first body was given back: %v, want the body taken", replies)
			}
			if got := gauge(t, m, "pd_extproc_request_body_buffered_bytes"); got != 0 {
				t.Errorf("request_body_buffered_bytes = %v with every stream closed, want 0", got)
			}
		})
	}

	t.Run("held by a background leg after its stream ended", func(t *testing.T) {
		m := metrics.New("kv-sglang")
		r := &holdingRouter{fakeRouter: fakeRouter{limit: 8 * mib}}
		s := handlers.NewServer(r, handlers.Options{MaxBufferedBytes: 3 * mib / 2, RetryAfter: time.Second, Metrics: m}, logr.Discard())
		drive(t, s, whole(mib)...) // routed; its leg keeps reading the body
		checkOpenAIError(t, drive(t, s, whole(mib)...), 503, "limits.max_buffered_bytes")
		r.release()
		if replies := drive(t, s, whole(mib)...); refused(replies) {
			t.Errorf("once the leg ended: %v, want the body taken", replies)
		}
		r.release()
		if got := gauge(t, m, "pd_extproc_request_body_buffered_bytes"); got != 0 {
			t.Errorf("request_body_buffered_bytes = %v with every leg over, want 0", got)
		}
	})
}

// refused reports whether the last reply is a local reply.
func refused(replies []*extprocv3.ProcessingResponse) bool {
	return len(replies) > 0 && replies[len(replies)-1].GetImmediateResponse() != nil
}

// holdingRouter routes like fakeRouter and holds each body as a background
// prefill leg would, until release.
type holdingRouter struct {
	fakeRouter
	holds []func()
}

func (h *holdingRouter) Route(ctx context.Context, r *pipeline.Request) (*pipeline.Decision, error) {
	h.holds = append(h.holds, r.Keep.Hold())
	return h.fakeRouter.Route(ctx, r)
}

// release ends the oldest hold.
func (h *holdingRouter) release() {
	h.holds[0]()
	h.holds = h.holds[1:]
}

// gauge reads a gauge without labels.
func gauge(t *testing.T, m *metrics.Metrics, name string) float64 {
	t.Helper()
	v, ok := m.Sample(name, nil)
	if !ok {
		t.Fatalf("no series %s", name)
	}
	return v
}

// A stream counts against limits.max_concurrent_streams from its first
// message: streams opened and left silent hold no slot.
func TestSilentStreamsHoldNoSlot(t *testing.T) {
	s := handlers.NewServer(&fakeRouter{}, handlers.Options{MaxStreams: 1, RetryAfter: time.Second}, logr.Discard())
	for range 3 {
		silent := s.Open(t.Context(), newRecorder())
		defer silent.Close()
	}
	replies := drive(t, s, envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), fullDuplex, fullDuplex),
		envoymsg.Body(envoymsg.Request, []byte(clientChat), true))
	if len(replies) < 2 || replies[0].GetRequestHeaders() == nil {
		t.Errorf("with three silent streams open: %v, want the request routed", replies)
	}
}

// A message that comes after the body deadline answered 408 ends the stream
// unanswered. The bubble's clock passes 2*timeout only once the deadline's
// goroutine is over, and nothing else orders that goroutine before the message
// (no synctest.Wait, the replies read after it), so under -race this fails
// wherever the stream reads what the deadline writes without the lock.
func TestMessageAfterTheDeadlineEndsTheStream(t *testing.T) {
	const timeout = time.Minute
	chat := []byte(clientChat)
	tests := []struct {
		name string
		next *extprocv3.ProcessingRequest
	}{
		{"a body chunk", envoymsg.Body(envoymsg.Request, chat[:10], false)},
		{"the body's end", envoymsg.Body(envoymsg.Request, chat, true)},
		{"trailers", envoymsg.Trailers(envoymsg.Request)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := handlers.NewServer(&fakeRouter{}, handlers.Options{BodyTimeout: timeout}, logr.Discard())
				rec := newRecorder()
				x := s.Open(t.Context(), rec)
				defer x.Close()
				x.Handle(envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(chat))...), fullDuplex, fullDuplex))
				time.Sleep(2 * timeout) // the deadline fires while the stream is idle
				if done, err := x.Handle(tt.next); !done || err != nil {
					t.Errorf("after the 408: done %v, %v; want the stream ended", done, err)
				}
				replies := rec.all()
				checkOpenAIError(t, replies, 408, "limits.body_timeout")
				if len(replies) != 1 {
					t.Errorf("replies %v, want the 408 alone", replies)
				}
			})
		})
	}
}

// Within the budget, what decides is the body: one of up to
// limits.max_body_bytes is taken by a budget of as much, however it comes in
// chunks, and one over it gets 413 whatever the budget holds, never a 503
// that would have the client retry it in vain.
func TestTheBodyLimitComesBeforeTheBudget(t *testing.T) {
	const mib = 1 << 20
	// post is the headers of a body of n bytes in mode, announced or not.
	post := func(mode filterv3.ProcessingMode_BodySendMode, n int, announced bool) *extprocv3.ProcessingRequest {
		hs := envoymsg.Post(chatPath, n)
		if !announced {
			hs = slices.DeleteFunc(hs, func(h envoymsg.Header) bool { return h[0] == "content-length" })
		}
		return envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, hs...), mode, fullDuplex)
	}
	chunked := func(n int, announced bool) []*extprocv3.ProcessingRequest {
		return append([]*extprocv3.ProcessingRequest{post(fullDuplex, n, announced)},
			envoymsg.Chunks(envoymsg.Request, []byte(prompt(n)), (n+mib/4-1)/(mib/4), true)...)
	}
	tests := []struct {
		name       string
		budget     int64 // limits.max_buffered_bytes; max_body_bytes is 3 MiB
		held       bool  // another stream holds a 1 MiB buffer meanwhile
		msgs       []*extprocv3.ProcessingRequest
		wantStatus int // 0: taken and routed
	}{
		{"2.5 MiB in chunks, announced, budget 3 MiB", 3 * mib, false, chunked(5*mib/2, true), 0},
		{"2.5 MiB in chunks, none announced, budget 3 MiB", 3 * mib, false, chunked(5*mib/2, false), 0},
		{"3 MiB in chunks, none announced, budget 3 MiB", 3 * mib, false, chunked(3*mib, false), 0},
		{"4 MiB in chunks, none announced, a buffer held", 12 * mib, true, chunked(4*mib, false), 413},
		{"4 MiB in chunks, none announced, budget nearly full", 4 * mib, true, chunked(4*mib, false), 413},
		{"4 MiB BUFFERED, none announced, budget nearly full", 4 * mib, true,
			[]*extprocv3.ProcessingRequest{post(buffered, 4*mib, false), envoymsg.Body(envoymsg.Request, []byte(prompt(4*mib)), true)}, 413},
		{"2 MiB in chunks, none announced, budget nearly full", 2 * mib, true, chunked(2*mib, false), 503},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := handlers.NewServer(&fakeRouter{limit: 3 * mib}, handlers.Options{MaxBufferedBytes: tt.budget, RetryAfter: time.Second, Metrics: metrics.New("kv-nixl")}, logr.Discard())
			if tt.held {
				other := s.Open(t.Context(), newRecorder())
				defer other.Close()
				other.Handle(post(fullDuplex, 2*mib, true))
				other.Handle(envoymsg.Body(envoymsg.Request, make([]byte, mib), false))
			}
			replies := drive(t, s, tt.msgs...)
			switch {
			case tt.wantStatus == 0 && refused(replies):
				t.Errorf("refused: %v, want the body taken", replies[len(replies)-1].GetImmediateResponse())
			case tt.wantStatus == 413:
				checkOpenAIError(t, replies, 413, "limits.max_body_bytes")
			case tt.wantStatus == 503:
				checkOpenAIError(t, replies, 503, "limits.max_buffered_bytes")
			}
		})
	}
}

// TestAnAnswerHeldForTheRewriteCountsInTheBudget: with response.rewrite_usage,
// the answer a rewrite holds back (a whole non-streamed answer, up to
// response.max_body_bytes) counts against limits.max_buffered_bytes with the
// request bodies. A body that does not fit beside it gets 503; an answer that
// outgrows the budget is passed on unrewritten, whole; and the budget is
// given back when the stream ends. The answers were counted nowhere.
func TestAnAnswerHeldForTheRewriteCountsInTheBudget(t *testing.T) {
	const mib = 1 << 20
	r := &fakeRouter{limit: 8 * mib, rewrite: func() *response.Rewriter {
		return response.New(response.Paths{JSON: api.Chat.Shape.CachedTokens}, []byte("8"), nil, 4*mib)
	}}
	s := handlers.NewServer(r, handlers.Options{Metrics: metrics.New("kv-nixl"), MaxBufferedBytes: 2 * mib, RetryAfter: time.Second}, logr.Discard())
	request := func(size int) []*extprocv3.ProcessingRequest {
		b := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("y", size) + `"}]}`
		return []*extprocv3.ProcessingRequest{
			envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(b))...), fullDuplex, fullDuplex),
			envoymsg.Body(envoymsg.Request, []byte(b), true),
		}
	}
	status := func(replies []*extprocv3.ProcessingResponse) int {
		return int(replies[len(replies)-1].GetImmediateResponse().GetStatus().GetCode()) // 0: routed
	}

	rec := newRecorder()
	a := s.Open(t.Context(), rec)
	send := func(m *extprocv3.ProcessingRequest) {
		t.Helper()
		if done, err := a.Handle(m); done || err != nil {
			t.Fatalf("stream A ended: %v", err)
		}
	}
	for _, m := range append(request(100), envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, envoymsg.Header{"content-type", "application/json"})) {
		send(m)
	}
	answer := `{"choices":[{"logprobs":"` + strings.Repeat("x", 3*mib) + `"}],"usage":{"prompt_tokens":9}}`
	send(envoymsg.Body(envoymsg.Response, []byte(answer[:mib]), false)) // held: the answer goes on
	if got := status(drive(t, s, request(mib)...)); got != 503 {
		t.Errorf("a 1 MiB body beside 1 MiB of answer held, budget 2 MiB: status %d, want 503", got)
	}
	send(envoymsg.Body(envoymsg.Response, []byte(answer[mib:]), true)) // past the budget: given up
	passed := 0
	for _, reply := range rec.all() {
		passed += len(reply.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody())
	}
	if passed != len(answer) {
		t.Errorf("%d bytes of a %d-byte answer passed on", passed, len(answer))
	}
	a.Close()
	if got := status(drive(t, s, request(3*mib/2)...)); got != 0 {
		t.Errorf("a 1.5 MiB body once the stream ended: status %d, want routed", got)
	}
}
