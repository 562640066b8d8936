package pipeline

import (
	"strings"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// admit says what the API table makes of a request before scheduling: why it
// must go to a decode endpoint alone (a metrics reason), 0 when it may be
// disaggregated, or the client's error when the connector's engines cannot
// serve it as asked. Under a paired connector (kv-sglang), which cannot send
// anything to a decode engine alone, every such request but a pass-through
// one is refused.
func (p *Pipeline) admit(a *api.API, obj *body.Object) (alone metrics.Reason, err error) {
	family := p.connector.Family()
	switch {
	case a.IsPassthrough():
		return metrics.ReasonPassthrough, nil
	case !a.Serves.Has(family):
		return 0, notServed(a, p.opts.Connector, family)
	case !a.Pairs.Has(family) && p.connector.Paired():
		return 0, cannotPair(a, p.opts.Connector, a.Unpaired)
	case !a.Pairs.Has(family):
		return metrics.ReasonUnpairedAPI, nil
	}
	reads := a.Alone
	if p.connector.Paired() && a.PairedAlone != nil {
		reads = a.PairedAlone
	}
	switch reads(obj) {
	case api.PromptLogprobs:
		if p.connector.Paired() {
			return 0, cannotPair(a, p.opts.Connector, "the request asks for prompt logprobs, which only the prefill engine "+
				"computes; SGLang's own gateway merges the prefill answer's input_token_logprobs into the decode answer, "+
				"pd-extproc does not: its prefill leg runs beside the decode leg and that answer never reaches the client, "+
				"and a decode engine in PD mode serves nothing alone")
		}
		return metrics.ReasonPromptLogprobs, nil
	case api.StoredResponse:
		return metrics.ReasonStoredResponse, nil // never paired: no paired family disaggregates the Responses API
	case api.BuiltinTools:
		if !p.opts.PairBuiltinTools {
			return metrics.ReasonBuiltinTools, nil // as StoredResponse: never under a paired connector
		}
	case api.BeamSearch:
		return metrics.ReasonBeamSearch, nil // vLLM's only: SGLang reads its chat and completions with PairedAlone
	case api.Truncation:
		return metrics.ReasonTruncation, nil // as BeamSearch
	case api.InvalidLimits:
		if !p.connector.Paired() { // a paired prefill leg is the client's body, which its engine refuses too
			return metrics.ReasonInvalidLimits, nil
		}
	}
	return 0, nil
}

// parallelSamples refuses a kv-sglang request with several samples: its
// samples would share one bootstrap room, on which SGLang is reported to
// hang or fail, and the engine reads no room per sample (docs/engines.md).
func (p *Pipeline) parallelSamples(sreq *scheduling.Request) error {
	if p.connector.Paired() && sreq.N > 1 {
		return parallelSamplesRefused(sreq.N)
	}
	return nil
}

// fitsContext keeps a vLLM P/D split from a prefill leg (its limit 1) whose
// request the decode engine refuses for its model's context, as it listed
// it at GET /v1/models (max_model_len): the prompt's tokens and the output
// limit together past it (api.ContextLimit). An output limit alone that
// fills it is refused here, with our message (vLLM's names the prompt's
// length) and vLLM's status and type (VLLMValidationError); a prompt known
// to pass what the limit leaves (its token ids, kv_events) goes to the
// decode engine alone (invalid_limits), whose 400 is vLLM's own: the ids of
// /tokenize may differ from the engine's. So does a Responses request whose
// limit fills it: some releases clamp it for Harmony models (docs/engines.md,
// API by API, item 10). A model of unknown length passes.
func (p *Pipeline) fitsContext(a *api.API, obj *body.Object, sreq *scheduling.Request, decode *scheduling.Endpoint, split scheduling.Split) (scheduling.Split, error) {
	if !split.PD || p.connector.Family() != api.VLLM {
		return split, nil
	}
	key, n, ok := a.ContextLimit(obj)
	if !ok {
		return split, nil
	}
	model, _ := obj.String("model")
	limit, known := decode.MaxModelLen(model)
	switch prompt := int64(len(sreq.Tokens())); {
	case !known || n < limit && prompt <= limit-n:
		return split, nil
	case n < limit || a.Name == api.NameResponses:
		return scheduling.Split{Reason: metrics.ReasonInvalidLimits}, nil
	}
	return split, contextFilled(key, n, limit)
}

// checkModel: a "model" string where the engine needs one, and never one
// longer than any real name (it would only cost a prefill leg to be refused).
func checkModel(a *api.API, obj *body.Object) error {
	model, ok := obj.String("model")
	switch {
	case a.Model && (!ok || model == ""):
		return badRequest("the request has no \"model\" string")
	case len(model) > maxModelBytes:
		return badRequest("\"model\" is %d bytes long; model names are at most %d", len(model), maxModelBytes)
	}
	return nil
}

// checkMediaType refuses a body not sent as JSON to a built-in API whose
// engines refuse it so: vLLM's routers for all of them, and SGLang's OpenAI
// ones, depend on validate_json_request, which reads the Content-Type's
// media type, lowercased, before any ';'. SGLang's /generate does not, but
// FastAPI reads its body as JSON only without a Content-Type or under
// application/json or application/*+json, and hands its model the bytes
// otherwise, which it refuses (get_request_handler, fastapi/routing.py).
// The prefill leg, sent as JSON, would run before the decode engine refused it.
func checkMediaType(a *api.API, contentType string) error {
	switch media, _, _ := strings.Cut(strings.ToLower(contentType), ";"); {
	case a.IsPassthrough(), media == "application/json":
		return nil
	case a.Name == api.NameSGLangGenerate:
		// Python's email parsing: stripped, one '/' or text/plain.
		main, sub, _ := strings.Cut(strings.TrimSpace(media), "/")
		if contentType == "" || main == "application" && !strings.Contains(sub, "/") && (sub == "json" || strings.HasSuffix(sub, "+json")) {
			return nil
		}
	}
	return notJSON(contentType)
}
