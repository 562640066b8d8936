package pipeline

import (
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// withResponseID is obj with a request_id naming the decode endpoint, when
// the request is of the Responses API and the engine may store its
// response: vLLM makes it the response's id, and a request naming that id
// later goes back to the endpoint (scheduling.NewResponseID). Both legs
// carry it, as they carry the same X-Request-Id; the prefill leg is told
// not to store.
func withResponseID(a *api.API, obj *body.Object, decode *scheduling.Endpoint) *body.Object {
	if !api.ChoosesResponseID(a, obj) {
		return obj
	}
	id := body.Quote(scheduling.NewResponseID(decode))
	named, err := body.Parse(obj.Splice(body.Set("request_id", id)).Bytes())
	if err != nil { // cannot be: one string member added to an object that parsed
		return obj
	}
	return named
}
