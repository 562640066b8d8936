package pipeline

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// maxTokenizeAnswer bounds an engine's /tokenize answer: a 128k-token prompt
// is about a megabyte of ids.
const maxTokenizeAnswer = 16 << 20

// tokenize gives sreq its prompt's token ids when a pool follows its
// engines' KV events (pools.<pool>.kv_events): the body's own ids, or those
// an engine's /tokenize answers for it. Without them (no pool follows
// events, the API has no /tokenize form, the engine did not answer in time,
// the round trips are paused after three failures in a row) the pools go by
// their estimates; the request is never refused for it.
// read (the API's Tokenize) runs only when a pool follows events: a chat
// request's /tokenize body copies its messages.
func (p *Pipeline) tokenize(ctx context.Context, r *Request, sreq *scheduling.Request, read func(*body.Object) api.Tokens, obj *body.Object) {
	e, path, timeout, ok := p.pools.Tokenizer()
	if !ok || read == nil {
		return
	}
	t := read(obj)
	switch {
	case t.IDs != nil:
		sreq.SetTokens(t.IDs)
		return
	case t.Ask == nil:
		return
	}
	start := time.Now()
	ids, err := p.askTokens(ctx, p.scheme+"://"+e.Addr+path, timeout, t.Ask)
	p.metrics.Tokenize(time.Since(start), err == nil)
	if ctx.Err() == nil { // a client gone says nothing of the tokenizer
		p.pools.Tokenized(err == nil)
	}
	if err != nil {
		p.log.V(1).Info("tokenize failed: the request goes by the pools' estimates", "requestID", r.RequestID, "engine", e.Addr, "error", err.Error())
		return
	}
	sreq.SetTokens(ids)
}

// askTokens posts ask to an engine's /tokenize and reads its ids (vLLM's
// TokenizeResponse: {"count", "max_model_len", "tokens"}).
func (p *Pipeline) askTokens(ctx context.Context, url string, timeout time.Duration, ask []byte) ([]int64, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(ask))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("status %d", resp.StatusCode)
	}
	var answer struct {
		Tokens []int64 `json:"tokens"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxTokenizeAnswer)).Decode(&answer); err != nil {
		return nil, err
	}
	if len(answer.Tokens) == 0 {
		return nil, fmt.Errorf("no tokens")
	}
	return answer.Tokens, nil
}
