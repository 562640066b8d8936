package pipeline

import (
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// responseID sets a request_id naming the decode endpoint, when the request
// is of the Responses API and the engine may store its response: vLLM makes
// it the response's id, and a request naming that id later goes back to the
// endpoint (scheduling.NewResponseID). Both legs carry it (kv.Handoff.Named),
// as they carry the same X-Request-Id; the prefill leg is told not to store.
func responseID(a *api.API, obj *body.Object, decode *scheduling.Endpoint) []body.Edit {
	if !api.ChoosesResponseID(a, obj) {
		return nil
	}
	return []body.Edit{body.Set("request_id", body.Quote(scheduling.NewResponseID(decode)))}
}
