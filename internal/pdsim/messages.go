package pdsim

import (
	"context"
	"encoding/json"
	"net/http"
)

// vLLM's Anthropic Messages API (vllm/entrypoints/anthropic/serving.py and
// api_router.py, since vllm-project/vllm#37535): the request runs as a chat
// completion with the request's kv_transfer_params, and the answer is
// converted. A whole answer is printed without its null fields
// (model_dump(exclude_none=True)), so kv_transfer_params is there only when
// the engine issued some; a stream is Anthropic's named events, made from
// the chat stream, and never carries them. Errors are Anthropic's too.

// messagesAnswer is an AnthropicMessagesResponse as a whole answer prints it.
type messagesAnswer struct {
	ID               string          `json:"id"`
	Type             string          `json:"type"`
	Role             string          `json:"role"`
	Content          []contentBlock  `json:"content"`
	Model            string          `json:"model"`
	StopReason       string          `json:"stop_reason"`
	Usage            messagesUsage   `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params,omitempty"`
}

// messageStart is the message of a stream's first event, which prints the
// fields its converter set (exclude_unset): no type or role, null stops.
type messageStart struct {
	ID           string         `json:"id"`
	Content      []contentBlock `json:"content"`
	Model        string         `json:"model"`
	StopReason   *string        `json:"stop_reason"`
	StopSequence *string        `json:"stop_sequence"`
	Usage        messagesUsage  `json:"usage"`
}

type contentBlock struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// messagesUsage is an AnthropicUsage. Since vllm-project/vllm#40912 (2026),
// where the chat answer it is made from states the cached tokens
// (prompt_tokens_details), input_tokens leaves them out,
// cache_read_input_tokens gives them and cache_creation_input_tokens is 0,
// as Anthropic's contract has it (input + read + creation = the prompt);
// where it does not, both are left out and input_tokens is the whole prompt.
type messagesUsage struct {
	InputTokens  int  `json:"input_tokens"`
	OutputTokens int  `json:"output_tokens"`
	Creation     *int `json:"cache_creation_input_tokens,omitempty"`
	Read         *int `json:"cache_read_input_tokens,omitempty"`
}

// anthropicUsage is the usage of a Messages answer with n tokens to req,
// converted from the chat answer's.
func (s *Server) anthropicUsage(req *request, n int) messagesUsage {
	u := s.usage(req, n)
	if u.PromptTokensDetails == nil {
		return messagesUsage{InputTokens: u.PromptTokens, OutputTokens: n}
	}
	read, creation := u.PromptTokensDetails.CachedTokens, 0
	return messagesUsage{InputTokens: u.PromptTokens - read, OutputTokens: n, Creation: &creation, Read: &read}
}

// messagesEvent is one AnthropicStreamEvent, fields in vLLM's order.
type messagesEvent struct {
	Type         string         `json:"type"`
	Message      *messageStart  `json:"message,omitempty"`
	Delta        *messagesDelta `json:"delta,omitempty"`
	ContentBlock *contentBlock  `json:"content_block,omitempty"`
	Index        *int           `json:"index,omitempty"`
	Usage        *messagesUsage `json:"usage,omitempty"`
}

type messagesDelta struct {
	Type       string `json:"type,omitempty"`
	Text       string `json:"text,omitempty"`
	StopReason string `json:"stop_reason,omitempty"`
}

// stopReason is the Anthropic name of a chat finish_reason.
func stopReason(finish string) string {
	if finish == "length" {
		return "max_tokens"
	}
	return "end_turn"
}

// answerMessages answers a Messages request with n tokens.
func (s *Server) answerMessages(ctx context.Context, w http.ResponseWriter, req *request, res kvResult, n int, finish string) error {
	used := s.anthropicUsage(req, n)
	if !req.stream {
		text := ""
		if err := s.tokens(ctx, n, func(i int) error { text += token(i); return nil }); err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, messagesAnswer{ID: req.internalID, Type: "message", Role: "assistant",
			Content: []contentBlock{{Type: "text", Text: text}}, Model: s.cfg.Model, StopReason: stopReason(finish),
			Usage: used, KVTransferParams: res.params})
		return nil
	}
	out := newSSE(w)
	zero := 0
	// The stream's first chunk states no cached tokens yet: its usage has none.
	start := &messageStart{ID: req.internalID, Content: []contentBlock{}, Model: s.cfg.Model, Usage: messagesUsage{InputTokens: req.promptTokens}}
	if err := out.event("message_start", messagesEvent{Type: "message_start", Message: start}); err != nil {
		return err
	}
	err := s.tokens(ctx, n, func(i int) error {
		if i == 0 {
			block := messagesEvent{Type: "content_block_start", ContentBlock: &contentBlock{Type: "text"}, Index: &zero}
			if err := out.event(block.Type, block); err != nil {
				return err
			}
		}
		return out.event("content_block_delta", messagesEvent{Type: "content_block_delta", Delta: &messagesDelta{Type: "text_delta", Text: token(i)}, Index: &zero})
	})
	if err != nil {
		return err
	}
	for _, e := range []messagesEvent{
		{Type: "content_block_stop", Index: &zero},
		{Type: "message_delta", Delta: &messagesDelta{StopReason: stopReason(finish)}, Usage: &used},
		{Type: "message_stop"},
	} {
		if err := out.event(e.Type, e); err != nil {
			return err
		}
	}
	return nil
}

// anthropicError is how vLLM's Anthropic router prints an error.
type anthropicError struct {
	Type  string `json:"type"`
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
}
