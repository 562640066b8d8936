package pipeline

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/enginehttp"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// statusError is an engine's non-2xx answer.
type statusError struct {
	status      int
	body        []byte
	contentType string
	// streamed: the status came in an error event of a stream whose HTTP
	// status was 200.
	streamed bool
	// retryAfter is the engine's Retry-After (a 429's, a 503's), 0 for none.
	retryAfter time.Duration
	// cut: the body ran past maxPrefillResponseBytes; body is its first
	// maxQuotedBytes.
	cut bool
}

// maxQuotedBytes is how much of an engine's error over the read cap the
// client's error quotes.
const maxQuotedBytes = 512

// retryAfter reads a Retry-After header: seconds, or an HTTP date; 0 for
// none, or one past.
func retryAfter(h string) time.Duration {
	if s, err := strconv.Atoi(h); err == nil && s > 0 {
		return time.Duration(s) * time.Second
	}
	if t, err := http.ParseTime(h); err == nil {
		return max(time.Until(t).Round(time.Second), 0)
	}
	return 0
}

func (e *statusError) Error() string { return fmt.Sprintf("engine answered %d", e.status) }

// attemptError is a failed prefill attempt and what it means, worked out once
// by classify: the metrics label, the endpoint's health, a retry and what the
// client is told are all read from it, so they cannot disagree.
type attemptError struct {
	err    error
	reason metrics.Failure
	answer *statusError // the engine's own non-2xx answer; nil when none came
	ended  bool         // the attempt's parent context ended: the client left or prefill.timeout passed
	// reached: the transport began to connect to the endpoint, or took a
	// pooled connection to it.
	reached bool
}

func (e *attemptError) Error() string { return e.err.Error() }
func (e *attemptError) Unwrap() error { return e.err }

// classify says what err, the failure of an attempt whose parent context is
// ctx, means. An answer is the engine's, whatever the context did meanwhile.
// reached says the transport began to connect to the endpoint or took a
// pooled connection to it: a failure before that (net/http refusing a header
// value or the URL of the leg) is the request's, not the endpoint's.
func classify(ctx context.Context, err error, reached bool) *attemptError {
	e := &attemptError{err: err, ended: ctx.Err() != nil, reached: reached}
	how := enginehttp.HowUnanswered(err)
	switch {
	case errors.As(err, &e.answer) && e.answer.status == http.StatusTooManyRequests:
		e.reason = metrics.FailureOverloaded // busy, not about the request: another endpoint may take it
	case e.answer != nil && e.answer.status == http.StatusNotFound && openAIError(bytes.NewReader(e.answer.body)):
		// vLLM's answer for a model or LoRA adapter this engine does not
		// serve (loaded at run time on some engines, lost in a restart), or a
		// stored response it does not hold: another endpoint may have it.
		e.reason = metrics.FailureNotFound
	case e.answer != nil && e.answer.status >= 400 && e.answer.status < 500:
		e.reason = metrics.FailureStatus4xx
	case e.answer != nil && e.answer.status >= 500:
		e.reason = metrics.FailureStatus5xx
	case e.answer != nil && e.answer.status < 200:
		// A 101 to a leg that asked no upgrade: no engine answers so.
		e.reason = metrics.FailureMalformed
	case e.answer != nil:
		e.reason = metrics.FailureRedirect
	case errors.Is(err, errAnswerTooLarge):
		e.reason = metrics.FailureTooLarge
	case errors.Is(err, errMalformed):
		e.reason = metrics.FailureMalformed
	case errors.Is(err, errNoParams):
		e.reason = metrics.FailureNoParams
	case errors.Is(ctx.Err(), context.Canceled):
		e.reason = metrics.FailureCancelled
	case how == enginehttp.Unreached:
		e.reason = metrics.FailureConnect
	case how == enginehttp.TimedOut:
		e.reason = metrics.FailureTimeout
	case !reached:
		e.reason = metrics.FailureNotSent
	default:
		e.reason = metrics.FailureTransport
	}
	return e
}

// aboutRequest reports whether the engine refused the request itself (4xx),
// which any endpoint would refuse too and decode-only cannot mend.
func (e *attemptError) aboutRequest() bool { return e.reason == metrics.FailureStatus4xx }

// refused reports whether the engine answered for itself that it will not
// take the request: it is fine, the request (or what it names) is not.
func (e *attemptError) refused() bool {
	return e.aboutRequest() || e.reason == metrics.FailureNotFound
}

// unsendable reports whether net/http refused to send the leg: a value of the
// client's request it carries is not valid HTTP, for any endpoint.
func (e *attemptError) unsendable() bool { return e.reason == metrics.FailureNotSent }

// clientLeft reports whether the attempt ended because the client went away.
func (e *attemptError) clientLeft() bool { return e.reason == metrics.FailureCancelled }

// retryable reports whether another prefill endpoint may succeed where this
// one failed: after a transport failure, a timeout, a redirect or a 5xx, as
// long as the prefill phase lasts. An answer over the read cap would come as
// long from any engine: the request asks for it (prompt logprobs, say). One
// without kv_transfer_params had its prompt computed already; another
// engine would compute it again, for an API whose engine release drops
// them (docs/engines.md) in vain.
func (e *attemptError) retryable() bool {
	return !e.aboutRequest() && !e.unsendable() && e.reason != metrics.FailureTooLarge && e.reason != metrics.FailureNoParams && !e.ended
}

// answered reports whether the engine answered the attempt, whatever it said.
func (e *attemptError) answered() bool {
	return e.answer != nil || e.reason == metrics.FailureTooLarge || e.reason == metrics.FailureMalformed || e.reason == metrics.FailureNoParams
}

// counts reports whether the failure says something of the endpoint's
// health: it could not be connected to, it timed out, the connection broke,
// or it answered 5xx. A redirect, an answer too long to read or without
// kv_transfer_params (an engine release may drop them for one API), or a
// leg that never left, says nothing of it; counting them would let a client
// eject endpoints with requests no engine could serve. Nor does a timeout before the transport began to
// connect: the leg waited for a connection, every one that
// prefill.max_conns_per_endpoint allows busy with the engine's other legs.
func (e *attemptError) counts() bool {
	switch e.reason {
	case metrics.FailureConnect, metrics.FailureTransport, metrics.FailureStatus5xx, metrics.FailureMalformed:
		return true
	case metrics.FailureTimeout:
		return e.reached
	}
	return false
}

// blames reports whether the failure of a leg sent as d counts against the
// endpoint's health. A sequential leg's does when another endpoint is worth a
// try, and when it timed out having had the whole prefill phase (whole: the
// first attempt): an engine that never answers must not keep every request
// sent to it for prefill.timeout, with the attempt's timeout left at the
// phase's. One cut short by an earlier attempt's time is not blamed. A
// concurrent leg fails with its partner, so any answer, even a 5xx, may be
// the partner's doing: only no answer at all counts, and not a leg still
// waiting when its time ran out, which SGLang's prefill does for a decode
// that never bootstraps (one that died, was refused, or is still queued)
// for up to SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 s by default. An
// engine that hangs is for the active checks to find (docs/scheduling.md,
// Health).
func (e *attemptError) blames(d kv.Dispatch, whole bool) bool {
	switch {
	case !e.counts():
		return false
	case d == kv.Concurrent:
		return e.answer == nil && e.reason != metrics.FailureTimeout
	}
	return e.retryable() || whole && e.reason == metrics.FailureTimeout
}

// lastAttempt is the failed attempt that ended a prefill phase in err; nil
// when no endpoint could be tried.
func lastAttempt(err error) *attemptError {
	var e *attemptError
	errors.As(err, &e)
	return e
}
