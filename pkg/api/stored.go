package api

import (
	"strings"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// responsesItems is the path below which vLLM's Responses router serves a
// stored response: GET and DELETE of /v1/responses/{id}, POST of
// /v1/responses/{id}/cancel.
const responsesItems = "/v1/responses/"

// StoredResponseID is the id of the stored response a request names, "" for
// none: the first segment of a path below /v1/responses/, or a Responses
// request's previous_response_id (o may be nil).
func StoredResponseID(a *API, urlPath string, o *body.Object) string {
	if rest, ok := strings.CutPrefix(urlPath, responsesItems); ok {
		id, _, _ := strings.Cut(rest, "/")
		return id
	}
	if a != Responses || o == nil {
		return ""
	}
	id, _ := o.String("previous_response_id")
	return id
}

// ChoosesResponseID reports whether a Responses request lets the router
// choose its response's id: it may be stored (store is not false: vLLM's
// default is true) and sets no request_id of its own, which vLLM takes as
// the response's id as it is (ResponsesResponse.from_request,
// vllm/frontend/entrypoints/openai/responses/protocol.py @ 055e47c2).
func ChoosesResponseID(a *API, o *body.Object) bool {
	if a != Responses || o.Has("request_id") {
		return false
	}
	store, ok := o.LaxBool("store")
	return store || !ok
}
