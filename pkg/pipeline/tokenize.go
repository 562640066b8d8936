package pipeline

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// maxTokenizeAnswer bounds an engine's answer with a request's token ids: a
// 128k-token prompt is about a megabyte of ids.
const maxTokenizeAnswer = 16 << 20

// tokenize gives sreq its prompt's token ids when a pool follows its
// engines' KV events (pools.<pool>.kv_events): the body's own ids, or those
// an engine answers for it. Its API's render endpoint is asked first, as it
// renders the request as generation does; an engine without one is asked
// /tokenize, and that render endpoint again after stale_after. Without ids
// (no pool follows events, the prompt has a media part, the API has no way
// to ask, the engine did not answer in time, the API's round trips are
// paused after three failures in a row) the pools go by their estimates;
// the request is never refused for it. One the render endpoint refuses goes to the decode engine alone, as
// its own endpoint refuses it too.
// The API's TokensOf runs only when a pool follows events: a chat
// request's /tokenize body copies its messages.
func (p *Pipeline) tokenize(ctx context.Context, r *Request, sreq *scheduling.Request, a *api.API, obj *body.Object) {
	e, tk, ok := p.pools.Tokenizer(sreq)
	if !ok {
		return
	}
	t := a.TokensOf(obj)
	if t.IDs != nil {
		sreq.SetTokens(t.IDs)
		return
	}
	renderPath := t.RenderPath
	ask, render := p.pools.Asks(renderPath)
	render = render && renderPath != ""
	if !ask || !render && t.Ask == nil {
		return
	}
	client, base := p.client, p.scheme+"://"+e.Addr
	if tk.Client != nil { // a decode engine
		client, base = tk.Client, tk.Scheme+"://"+e.Addr
	}
	start := time.Now()
	// One deadline for both round trips: a render that fails slowly leaves
	// /tokenize only what remains of it.
	asking, cancel := context.WithTimeout(ctx, tk.Timeout)
	defer cancel()
	var ids []int64
	err := errUnrendered // nothing rendered yet
	if render {
		ids, err = askTokens(asking, client, base+renderPath, obj.Bytes(), r.Forward, true)
		// An answer of 200 came after the engine read the body whole; any
		// other outcome may leave net/http writing it after Route returns.
		r.Report.lent = r.Report.lent || err != nil
		if errors.Is(err, errUnrendered) {
			p.pools.Unrendered(renderPath)
		}
		if errors.Is(err, errRefused) && sreq.Alone == 0 && !p.connector.Paired() {
			// Its endpoint refuses it alike (a prompt and limit past the
			// context among others): the decode engine answers, no prefill.
			sreq.Alone = metrics.ReasonInvalidLimits
		}
	}
	// An engine without the render endpoint, or whose render failed (a
	// 500: a template it could not apply), may still tokenize.
	fellBack := t.Ask != nil && (errors.Is(err, errUnrendered) || errors.Is(err, errRenderFailed))
	if fellBack {
		if errors.Is(err, errRenderFailed) {
			p.log.V(1).Info("render failed: asking /tokenize", "requestID", r.RequestID, "engine", e.Addr, "error", err.Error())
		}
		ids, err = askTokens(asking, client, base+tk.Path, t.Ask, r.Forward, false)
	} else if errors.Is(err, errUnrendered) {
		return // no way to ask this engine: no failure of its tokenizer
	}
	// A client gone says nothing of the tokenizer (neither its latency nor
	// a failure), nor does a request the render endpoint refuses, as the
	// request's own endpoint will (a body it does not take), or fails to
	// render with no /tokenize form to try, nor one for a model (an adapter)
	// the engine does not serve, wherever it is asked. /tokenize refusing
	// one (SGLang's takes no chat messages) does.
	if ctx.Err() == nil {
		p.metrics.Tokenize(time.Since(start), err == nil)
	}
	if ctx.Err() == nil && !errors.Is(err, errDenied) && !errors.Is(err, errNotServed) && (fellBack || !errors.Is(err, errRefused) && !errors.Is(err, errRenderFailed)) {
		p.pools.Tokenized(renderPath, err == nil)
	}
	if err != nil {
		p.log.V(1).Info("tokenize failed: the request goes by the pools' estimates", "requestID", r.RequestID, "engine", e.Addr, "error", err.Error())
		return
	}
	sreq.SetTokens(ids)
}

var (
	// errUnrendered: the engine has no such render endpoint.
	errUnrendered = errors.New("no render endpoint")
	// errRefused: the engine refused the request (400, 422).
	errRefused = errors.New("refused")
	// errNotServed: the engine does not have what the request names (a 404
	// with an OpenAI error: a model or LoRA adapter it does not serve, a
	// stored response it does not hold), on its render endpoint or on
	// /tokenize: the request's doing, or this engine's, not its tokenizer's.
	errNotServed = errors.New("not served")
	// errRenderFailed: the render endpoint failed (500), or could not
	// render this request (501 with an OpenAI error: a NotImplementedError,
	// as gpt-oss's Responses with a tool_choice other than auto).
	errRenderFailed = errors.New("render failed")
	// errDenied: the engine refused the credentials (401, 403: vLLM's
	// --api-key), the client's or prefill.api_key_file's, which say nothing
	// of its tokenizer.
	errDenied = errors.New("denied")
)

// maxErrorAnswer bounds what is read of an engine's 404 to tell a route it
// lacks from an error of the request's.
const maxErrorAnswer = 4 << 10

// askTokens posts ask to an engine with client and reads the ids it
// answers: vLLM's render endpoints' {"token_ids": [...]} (a list of one for
// completions), or /tokenize's {"count", "max_model_len", "tokens": [...]}.
// The client's forwarded headers go along (vLLM's --api-key guards /v1
// paths, the render endpoints among them), its Authorization replaced by
// the engines' key where prefill.api_key_file or pools.decode.api_key_file
// gives one (the client's transport sets it).
//
// A render endpoint's 404 is the engine lacking it only when the answer is
// not an OpenAI error (FastAPI's {"detail": "Not Found"} for a path it has
// no route for); vLLM answers a model it does not serve, or a stored
// response it does not have, with 404 and {"error": ...}.
func askTokens(ctx context.Context, client *http.Client, url string, ask []byte, forward http.Header, render bool) ([]int64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(ask))
	if err != nil {
		return nil, err
	}
	for k, v := range forward {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	switch code := resp.StatusCode; {
	case code == http.StatusOK:
	case code == http.StatusBadRequest || code == http.StatusUnprocessableEntity:
		return nil, fmt.Errorf("%w: status %d", errRefused, code)
	case code == http.StatusUnauthorized || code == http.StatusForbidden:
		return nil, fmt.Errorf("%w: status %d", errDenied, code)
	case code == http.StatusNotFound && openAIError(resp.Body):
		return nil, fmt.Errorf("%w: status %d", errNotServed, code)
	case render && (code == http.StatusInternalServerError || code == http.StatusNotImplemented && openAIError(resp.Body)):
		return nil, fmt.Errorf("%w: status %d", errRenderFailed, code)
	case render && (code == http.StatusNotFound || code == http.StatusMethodNotAllowed || code == http.StatusNotImplemented):
		return nil, fmt.Errorf("%w: status %d", errUnrendered, code)
	default:
		return nil, fmt.Errorf("status %d", code)
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxTokenizeAnswer))
	if err != nil {
		return nil, err
	}
	var answer struct {
		TokenIDs []int64 `json:"token_ids"`
		Tokens   []int64 `json:"tokens"`
	}
	if raw = bytes.TrimSpace(raw); len(raw) > 0 && raw[0] == '[' { // completions: one per prompt
		var list []json.RawMessage
		if err := json.Unmarshal(raw, &list); err != nil {
			return nil, err
		}
		if len(list) != 1 {
			return nil, fmt.Errorf("%d prompts rendered", len(list))
		}
		raw = list[0]
	}
	if err := json.Unmarshal(raw, &answer); err != nil {
		return nil, err
	}
	ids := append(answer.TokenIDs, answer.Tokens...)
	if len(ids) == 0 {
		return nil, fmt.Errorf("no tokens")
	}
	return ids, nil
}

// openAIError says whether an answer's body is an OpenAI error object.
func openAIError(r io.Reader) bool {
	var answer struct {
		Error json.RawMessage `json:"error"`
	}
	return json.NewDecoder(io.LimitReader(r, maxErrorAnswer)).Decode(&answer) == nil && len(answer.Error) > 0
}
