package pdsim

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
)

// outputID is the token id of output token i, so tests can assert content.
func outputID(i int) int { return 1000 + i }

// generateAnswer is vLLM's GenerateResponse (token ids out); a stream sends
// one per token, with that token's id.
type generateAnswer struct {
	RequestID        string           `json:"request_id"`
	Choices          []generateChoice `json:"choices"`
	PromptLogprobs   any              `json:"prompt_logprobs"`
	KVTransferParams json.RawMessage  `json:"kv_transfer_params,omitempty"`
	Usage            any              `json:"usage,omitempty"` // *usage, or a stream's *runningGenerateUsage
}

// runningGenerateUsage is a generate stream's usage in every chunk with
// continuous_usage_stats, printed with its null details (model_dump_json(),
// vllm/entrypoints/serve/disagg/serving.py @ 0001948b).
type runningGenerateUsage struct {
	usage
	PromptTokensDetails *tokensDetails `json:"prompt_tokens_details"`
}

// generateUsage is a stream's last event with stream_options.include_usage,
// printed without its null fields.
type generateUsage struct {
	RequestID string           `json:"request_id"`
	Choices   []generateChoice `json:"choices"`
	Usage     *usage           `json:"usage"`
}

type generateChoice struct {
	Index        int     `json:"index"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
	TokenIDs     []int   `json:"token_ids"`
}

// answerGenerate answers vLLM's token-in API, whose kv_transfer_params comes
// back at the top level.
func (s *Server) answerGenerate(ctx context.Context, w http.ResponseWriter, req *request, res kvResult, n int, finish string) error {
	var out *sse
	if req.stream {
		stream := newSSE(w)
		out = &stream
	}
	ids := []int{}
	err := s.tokens(ctx, n, func(i int) error {
		ids = append(ids, outputID(i))
		if out == nil {
			return nil
		}
		var fr *string
		if i == n-1 {
			fr = &finish
		}
		a := generateAnswer{RequestID: req.internalID, Choices: []generateChoice{{FinishReason: fr, TokenIDs: []int{outputID(i)}}}}
		if u := req.runningUsage(i + 1); u != nil {
			a.Usage = &runningGenerateUsage{usage: *u}
		}
		return out.send(a)
	})
	if err != nil {
		return err
	}
	if out != nil && req.usageIn.last { // newer vLLM streams generate, its usage last, as chat
		if err := out.send(generateUsage{RequestID: req.internalID, Choices: []generateChoice{}, Usage: s.usage(req, n)}); err != nil {
			return err
		}
	}
	if out != nil {
		return out.raw([]byte("[DONE]"))
	}
	a := generateAnswer{RequestID: req.internalID, Choices: []generateChoice{{FinishReason: &finish, TokenIDs: ids}}, KVTransferParams: orNull(res.params),
		Usage: s.usage(req, n)}
	writeJSON(w, http.StatusOK, a)
	return nil
}

// sglangAnswer is SGLang's native generate answer; a stream sends the text
// and ids so far with each token.
type sglangAnswer struct {
	Text      string     `json:"text"`
	OutputIDs []int      `json:"output_ids"`
	MetaInfo  sglangMeta `json:"meta_info"`
}

type sglangMeta struct {
	ID               string         `json:"id"`
	FinishReason     map[string]any `json:"finish_reason"`
	PromptTokens     int            `json:"prompt_tokens"`
	CompletionTokens int            `json:"completion_tokens"`
	CachedTokens     int            `json:"cached_tokens"` // SGLang reports it whatever its flags
}

// answerSGLang answers SGLang's /generate.
func (s *Server) answerSGLang(ctx context.Context, w http.ResponseWriter, req *request, n int, finish string) error {
	var out *sse
	if req.stream {
		stream := newSSE(w)
		out = &stream
	}
	a := sglangAnswer{OutputIDs: []int{}, MetaInfo: sglangMeta{ID: req.id, PromptTokens: req.promptTokens, CachedTokens: req.cached}}
	err := s.tokens(ctx, n, func(i int) error {
		a.Text += token(i)
		a.OutputIDs = append(a.OutputIDs, outputID(i))
		a.MetaInfo.CompletionTokens = i + 1
		if i == n-1 {
			a.MetaInfo.FinishReason = map[string]any{"type": finish}
		}
		if out == nil {
			return nil
		}
		return out.send(a)
	})
	switch {
	case err != nil:
		return err
	case out != nil:
		return out.raw([]byte("[DONE]"))
	}
	if prompts, isBatch := req.batch(); isBatch {
		// A batch is answered with an array, an answer per prompt and
		// sample (TokenizerManager._handle_batch_request); pdsim's are alike.
		writeJSON(w, http.StatusOK, slices.Repeat([]sglangAnswer{a}, prompts*max(1, req.samples)))
		return nil
	}
	writeJSON(w, http.StatusOK, a)
	return nil
}
