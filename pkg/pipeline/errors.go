package pipeline

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// Error is a request failure the client must see, with its HTTP status. Every
// status the pipeline produces is decided here, in one place.
type Error struct {
	Status  int
	Type    string // OpenAI error type
	Message string
	// Raw, when set, is an engine's own error body, returned as is.
	Raw         []byte
	ContentType string
	// RetryAfter, when set, tells the client when to try again (429, 503).
	RetryAfter time.Duration
	// Detail is for the log only: the cause behind Message, which may name
	// internal addresses or carry a transport error the client must not see
	// (docs/architecture.md §Security rules, rule 5).
	Detail string
}

func (e *Error) Error() string { return fmt.Sprintf("%d %s: %s", e.Status, e.Type, e.Message) }

// Body returns the response body: the engine's own, or JSON in the API's
// words for errors: with anthropic (api.AnthropicErrorsAt), Anthropic's
// {"type":"error","error":{"type","message"}} with Anthropic's type for the
// status, as vLLM's Messages handler words the errors it raises
// (AnthropicErrorResponse); else OpenAI's
// {"error":{"message","type","param","code"}} with param null and the status
// as the code, as vLLM prints its ErrorInfo.
func (e *Error) Body(anthropic bool) (body []byte, contentType string) {
	if e.Raw != nil {
		return e.Raw, e.ContentType
	}
	if anthropic {
		type detail struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		}
		b, _ := json.Marshal(struct {
			Type  string `json:"type"`
			Error detail `json:"error"`
		}{"error", detail{anthropicType(e.Status), e.Message}})
		return b, "application/json"
	}
	type detail struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    int     `json:"code"`
	}
	b, _ := json.Marshal(struct {
		Error detail `json:"error"`
	}{detail{e.Message, e.Type, nil, e.Status}})
	return b, "application/json"
}

// anthropicType is the error type Anthropic's API gives a status
// (docs.anthropic.com, "Errors"); a 503 is its overloaded_error.
func anthropicType(status int) string {
	switch status {
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusForbidden:
		return "permission_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestTimeout, http.StatusGatewayTimeout:
		return "timeout_error"
	case http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusServiceUnavailable, 529:
		return "overloaded_error"
	}
	if status < 500 {
		return "invalid_request_error"
	}
	return "api_error"
}

// Overloaded refuses a request over limits.max_concurrent_streams: shed at once
// rather than queued, as the endpoint-picker protocol's 429.
func Overloaded(limit int, retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusTooManyRequests, Type: "rate_limit_exceeded", RetryAfter: retryAfter,
		Message: fmt.Sprintf("too many requests in progress (limits.max_concurrent_streams is %d); retry later", limit)}
}

// saturated refuses a request of a sheddable objective while pool is
// saturated (admission.objectives), as the Inference Extension's endpoint
// picker refuses it.
func saturated(objective, pool string, retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusTooManyRequests, Type: "rate_limit_exceeded", RetryAfter: retryAfter,
		Message: fmt.Sprintf("the %s engines are saturated and objective %q may be shed (its priority is negative); retry later", pool, objective)}
}

// shuttingDown answers a request held for room (admission.hold) at
// shutdown, when no room will come in time for it: another replica may have
// some.
func shuttingDown(retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: "service_unavailable", RetryAfter: retryAfter,
		Message: "this router is shutting down and no longer holds requests for room; retry"}
}

// BodyTimeout refuses a request whose body did not arrive within
// limits.body_timeout: a slow client must not hold a stream slot and a
// buffer for as long as it likes.
func BodyTimeout(limit time.Duration) *Error {
	return &Error{Status: http.StatusRequestTimeout, Type: "invalid_request_error",
		Message: fmt.Sprintf("the request body did not arrive within %s (limits.body_timeout)", limit)}
}

// BuffersFull refuses a request whose body would take the bodies held at once
// past limits.max_buffered_bytes: shed, like a stream over the limit, rather
// than held until memory runs out.
func BuffersFull(limit int64, retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: "service_unavailable", RetryAfter: retryAfter,
		Message: fmt.Sprintf("too many request bodies held at once (limits.max_buffered_bytes is %d); retry later", limit)}
}

// backgroundFull refuses a kv-sglang request while prefill.max_background
// prefill legs run already: they outlive their streams, and each holds a
// body and a connection to a prefill engine.
func backgroundFull(limit int, retryAfter time.Duration) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: "service_unavailable", RetryAfter: retryAfter,
		Message: fmt.Sprintf("too many prefill legs in progress (prefill.max_background is %d); retry later", limit)}
}

// TrailersWithoutBody refuses a BUFFERED request whose trailers came before
// any body: Envoy would pass its headers on unrouted once the trailers are
// answered.
func TrailersWithoutBody() *Error {
	return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error",
		Message: "the request has trailers and no body; send the body before any trailers"}
}

// Misconfigured is a 500 for a request the deployment, not the client, cannot
// serve (a proxy set up in a way the service cannot work with); the message
// says what to change.
func Misconfigured(message string) *Error {
	return &Error{Status: http.StatusInternalServerError, Type: "server_error", Message: message}
}

// AsError is err as the client sees it: the *Error it is or wraps, else a 500
// that names the request, its text kept for the log.
func AsError(err error, requestID string) *Error {
	if e := (*Error)(nil); errors.As(err, &e) {
		return e
	}
	return hiding(http.StatusInternalServerError, "server_error", "internal error", requestID, err)
}

// hiding is an error whose message names the request, not the cause, which
// goes to the log (Detail).
func hiding(status int, typ, what, requestID string, cause error) *Error {
	return &Error{Status: status, Type: typ, Detail: cause.Error(),
		Message: what + "; request id " + requestID + " (the service's log has the cause)"}
}

func badRequest(format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: fmt.Sprintf(format, args...)}
}

// notFound refuses a request the API table does not admit: an unknown path,
// a method the path does not take, or an unsafe path. All are 404, so that a
// path the gateway must keep from the engines (their admin and debug
// endpoints) looks the same as one that does not exist.
// contextFilled: an output limit that leaves the prompt no room in the
// model's context, refused as vLLM refuses it (VLLMValidationError, a 400).
func contextFilled(key string, n, limit int64) *Error {
	return &Error{Status: http.StatusBadRequest, Type: "BadRequestError", Message: fmt.Sprintf(
		"%s=%d leaves no room for the prompt: this model's maximum context length is %d tokens. "+
			"Please request fewer output tokens.", key, n, limit)}
}

func notFound(cause error) *Error {
	return &Error{Status: http.StatusNotFound, Type: "invalid_request_error",
		Message: cause.Error() + "; see the README's API table and routes.passthrough"}
}

// notServed is a 404 for a built-in API the connector's engines do not serve.
func notServed(a *api.API, connector string, family api.Family) *Error {
	return &Error{Status: http.StatusNotFound, Type: "invalid_request_error",
		Message: fmt.Sprintf("%s %s is an API of %s engines; connector %s drives %s engines", a.Method, a.Path, a.Serves, connector, family)}
}

// cannotPair is a 400 for a request the connector can neither disaggregate
// nor send to a decode engine alone.
func cannotPair(a *api.API, connector, why string) *Error {
	return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error",
		Message: fmt.Sprintf("%s cannot serve %s %s: %s", connector, a.Method, a.Path, why)}
}

// notJSON refuses a body sent as contentType ("" for none) where the engines
// take application/json only (checkMediaType).
func notJSON(contentType string) *Error {
	if contentType == "" {
		return badRequest("the request has no Content-Type; the engines take this API's body as application/json only")
	}
	return badRequest("Content-Type is %q; the engines take this API's body as application/json only", contentType)
}

// noBody refuses a bodiless request to an API that reads its body.
func noBody(a *api.API) *Error {
	return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error",
		Message: fmt.Sprintf("%s %s needs a JSON body", a.Method, a.Path)}
}

// parallelSamplesRefused refuses kv-sglang's n > 1.
func parallelSamplesRefused(n int) *Error {
	return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error",
		Message: fmt.Sprintf("n is %d: kv-sglang cannot pair several samples of one prompt (SGLang gives them all the prompt's "+
			"bootstrap room, and is reported to hang or fail on it); ask for one sample per request", n)}
}

// mixedSamples refuses SGLang's list of sampling_params whose n values
// differ (each is every entry's n), as SGLang does.
func mixedSamples(each []int) *Error {
	i := 1
	for each[i] == each[0] {
		i++
	}
	return badRequest("sampling_params[%d] has n %d and sampling_params[0] has n %d: SGLang takes n from the first entry "+
		"and refuses a list whose n values differ (\"The parallel_sample_num should be the same for all samples in sample params\"); "+
		"give every entry the same n", i, each[i], each[0])
}

// TooLarge is the error for a body over the configured limit.
func TooLarge(limit int64) *Error {
	return &Error{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error",
		Message: fmt.Sprintf("request body is larger than the limit of %d bytes (limits.max_body_bytes)", limit)}
}

// noDecodeEndpoint is the endpoint-picker protocol's 503: no decode endpoint is
// configured, healthy, or in the proxy's subset hint.
func noDecodeEndpoint(cause error) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: "service_unavailable",
		Message: "no healthy decode endpoint: " + cause.Error()}
}

// noPrefillEndpoint refuses a request that no prefill endpoint can take
// when it may not go decode-only: under a paired connector (kv-sglang),
// whose decode engines serve only paired requests, or under
// prefill.on_failure fail.
func (p *Pipeline) noPrefillEndpoint() *Error {
	why := "prefill.on_failure is fail"
	if p.connector.Paired() {
		why = p.opts.Connector + " decode engines serve only prefill/decode pairs"
	}
	return &Error{Status: http.StatusServiceUnavailable, Type: "service_unavailable", RetryAfter: p.opts.RetryAfter,
		Message: "no healthy prefill endpoint: " + why}
}

// prefillFailed is the client's error when the prefill phase ended in cause
// and the request does not go decode-only. An engine's 4xx is passed on as the
// engine wrote it: it is about the request, which retrying elsewhere cannot
// fix. A leg net/http refused to send is the client's 400: its header values or
// query are not valid HTTP. Another answer of the engine's own (a 5xx, a
// redirect, one too long to read, one that is not JSON) is a 502; no answer at all (unreachable, timed out, no endpoint
// left), or engines too busy to take it (429), a 503.
//
// The message names the request, not the cause: that would tell the client
// the engines' addresses, and Go's transport errors quote the leg's URL with
// its query. The cause goes to the log (Detail).
func prefillFailed(cause error, requestID string) *Error {
	last := lastAttempt(cause)
	switch {
	case last != nil && last.unsendable():
		e := badRequest("the request cannot be forwarded: a header value or its query is not valid HTTP")
		e.Detail = cause.Error()
		return e
	case last != nil && last.reason == metrics.FailureOverloaded:
		e := hiding(http.StatusServiceUnavailable, "upstream_error", "prefill leg failed: the prefill engines are busy", requestID, cause)
		e.RetryAfter = last.answer.retryAfter // the engine's say, when it had one
		return e
	case last == nil || !last.answered():
		return hiding(http.StatusServiceUnavailable, "upstream_error", "prefill leg failed: no prefill engine answered", requestID, cause)
	case last.refused() && last.answer.cut:
		return &Error{Status: last.answer.status, Type: "invalid_request_error", Message: fmt.Sprintf(
			"prefill engine rejected the request with an error over %d bytes, not passed on; it begins: %s",
			maxPrefillResponseBytes, strings.ToValidUTF8(string(last.answer.body), ""))}
	case last.refused():
		return &Error{Status: last.answer.status, Type: "invalid_request_error", Message: "prefill engine rejected the request",
			Raw: last.answer.body, ContentType: last.answer.contentType}
	}
	return hiding(http.StatusBadGateway, "upstream_error", "prefill leg failed: the prefill engine answered with an error", requestID, cause)
}
