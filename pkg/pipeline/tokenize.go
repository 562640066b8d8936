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
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// maxTokenizeAnswer bounds an engine's answer with a request's token ids: a
// 128k-token prompt is about a megabyte of ids.
const maxTokenizeAnswer = 16 << 20

// tokenize gives sreq its prompt's token ids when a pool follows its
// engines' KV events (pools.<pool>.kv_events): the body's own ids, or those
// an engine answers for it. Its API's render endpoint is asked first, as it
// renders the request as generation does; an engine without one (404) is
// asked /tokenize, and the render endpoints again after stale_after.
// Without ids (no pool follows events, the API has no way to ask, the
// engine did not answer in time, the round trips are paused after three
// failures in a row) the pools go by their estimates; the request is never
// refused for it. read (the API's Tokenize) runs only when a pool follows
// events: a chat request's /tokenize body copies its messages.
func (p *Pipeline) tokenize(ctx context.Context, r *Request, sreq *scheduling.Request, read func(*body.Object) api.Tokens, obj *body.Object) {
	e, tk, ok := p.pools.Tokenizer()
	if !ok || read == nil {
		return
	}
	t := read(obj)
	switch {
	case t.IDs != nil:
		sreq.SetTokens(t.IDs)
		return
	case t.RenderPath == "" && t.Ask == nil:
		return
	}
	base := p.scheme + "://" + e.Addr
	start := time.Now()
	var ids []int64
	err := errUnrendered
	rendered := tk.Render && t.RenderPath != ""
	if rendered {
		ids, err = p.askTokens(ctx, base+t.RenderPath, tk.Timeout, obj.Bytes(), r.Forward)
		if errors.Is(err, errUnrendered) {
			p.pools.Unrendered()
		}
	}
	if errors.Is(err, errUnrendered) && t.Ask != nil {
		rendered = false
		ids, err = p.askTokens(ctx, base+tk.Path, tk.Timeout, t.Ask, r.Forward)
	}
	p.metrics.Tokenize(time.Since(start), err == nil)
	// A client gone says nothing of the tokenizer, nor does a request the
	// render endpoint refuses, as the request's own endpoint would refuse
	// it. /tokenize refusing one (SGLang's takes no chat messages) does.
	if ctx.Err() == nil && !(rendered && errors.Is(err, errRefused)) {
		p.pools.Tokenized(err == nil)
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
)

// askTokens posts ask to an engine and reads the ids it answers: vLLM's
// render endpoints' {"token_ids": [...]} (a list of one for completions),
// or /tokenize's {"count", "max_model_len", "tokens": [...]}. The client's
// forwarded headers go along (vLLM's --api-key guards /v1 paths, the render
// endpoints among them).
func (p *Pipeline) askTokens(ctx context.Context, url string, timeout time.Duration, ask []byte, forward http.Header) ([]int64, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(ask))
	if err != nil {
		return nil, err
	}
	for k, v := range forward {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound, http.StatusMethodNotAllowed, http.StatusNotImplemented:
		return nil, fmt.Errorf("%w: status %d", errUnrendered, resp.StatusCode)
	case http.StatusBadRequest, http.StatusUnprocessableEntity:
		return nil, fmt.Errorf("%w: status %d", errRefused, resp.StatusCode)
	default:
		return nil, fmt.Errorf("status %d", resp.StatusCode)
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
