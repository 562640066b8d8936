package pipeline

import (
	"encoding/json"
	"net/http"
	"net/url"
	"strings"

	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// The OpenAI model list and its retrieval, where the decode pool holds
// engines of several models (scheduling's ModelList): one engine's
// GET /v1/models names its own models only, so the list is answered here,
// from what every engine listed; GET /v1/models/{model} goes to an engine
// that lists that model.
const modelsPath = "/v1/models"

// modelsAnswer is the list to answer r with, nil when an engine answers it.
// For a retrieval it names the model in sreq.
func (p *Pipeline) modelsAnswer(r *Request, sreq *scheduling.Request) []byte {
	if r.Method != http.MethodGet {
		return nil
	}
	path := r.URLPath()
	if name, ok := strings.CutPrefix(path, modelsPath+"/"); ok {
		sreq.Model, _ = url.PathUnescape(name)
		return nil
	}
	if path != modelsPath {
		return nil
	}
	cards, ok := p.pools.Decode.ModelList()
	if !ok {
		return nil
	}
	// Each card is JSON as an engine's list held it, read whole.
	list, _ := json.Marshal(struct {
		Object string            `json:"object"`
		Data   []json.RawMessage `json:"data"`
	}{"list", cards})
	return list
}
