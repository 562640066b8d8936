package pipeline

import "encoding/json"

// modelList is the OpenAI model list of a decode pool that holds engines of
// several models (scheduling's ModelList): one engine's GET /v1/models names
// its own models only, so the list is answered here, from what every engine
// listed; nil when an engine answers it (one model in the pool). A retrieval,
// GET /v1/models/{model}, goes to an engine that lists that model
// (RouteHeaders).
func (p *Pipeline) modelList() []byte {
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
