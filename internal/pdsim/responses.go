package pdsim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// vLLM's Responses API: the answer is a response object, kept in the
// engine's store unless the request says store:false; a request that
// continues one (previous_response_id) needs the engine that stored it.
// Its kv_transfer_params is top level both ways.

// responseObject is a ResponsesResponse, fields in vLLM's order.
type responseObject struct {
	ID                 string           `json:"id"`
	Object             string           `json:"object"`
	CreatedAt          int64            `json:"created_at"`
	IncompleteDetails  *incomplete      `json:"incomplete_details"`
	Model              string           `json:"model"`
	Output             []responseOutput `json:"output"`
	Background         bool             `json:"background"`
	MaxOutputTokens    int64            `json:"max_output_tokens"`
	PreviousResponseID *string          `json:"previous_response_id"`
	Status             string           `json:"status"`
	Usage              *responsesUsage  `json:"usage"`
	KVTransferParams   json.RawMessage  `json:"kv_transfer_params"`
}

type incomplete struct {
	Reason string `json:"reason"`
}

type responseOutput struct {
	Type    string       `json:"type"`
	ID      string       `json:"id"`
	Role    string       `json:"role"`
	Status  string       `json:"status"`
	Content []outputText `json:"content"`
}

type outputText struct {
	Type        string `json:"type"`
	Text        string `json:"text"`
	Annotations []any  `json:"annotations"`
}

type responsesUsage struct {
	InputTokens         int            `json:"input_tokens"`
	InputTokensDetails  inputDetails   `json:"input_tokens_details"`
	OutputTokens        int            `json:"output_tokens"`
	OutputTokensDetails map[string]int `json:"output_tokens_details"`
	TotalTokens         int            `json:"total_tokens"`
}

// inputDetails is vLLM's InputTokensDetails: the cached tokens, and each
// turn's input and cached tokens, one turn without built-in tools
// (responses_full_generator, vllm/entrypoints/openai/responses/serving.py @
// 4d89a999).
type inputDetails struct {
	CachedTokens        int   `json:"cached_tokens"`
	InputTokensPerTurn  []int `json:"input_tokens_per_turn"`
	CachedTokensPerTurn []int `json:"cached_tokens_per_turn"`
}

// responseEvent is one event of a streamed response.
type responseEvent struct {
	Type           string          `json:"type"`
	SequenceNumber int             `json:"sequence_number"`
	Response       *responseObject `json:"response,omitempty"`
	ItemID         string          `json:"item_id,omitempty"`
	OutputIndex    *int            `json:"output_index,omitempty"`
	ContentIndex   *int            `json:"content_index,omitempty"`
	Delta          string          `json:"delta,omitempty"`
}

// checkStored refuses a Responses request that continues a response this
// engine does not have, as vLLM's store does.
func (s *Server) checkStored(req *request) *apiError {
	raw, ok := present(req.fields, "previous_response_id")
	if req.api != apiResponses || !ok {
		return nil
	}
	var id string
	json.Unmarshal(raw, &id)
	s.mu.Lock()
	_, found := s.responses[id]
	s.mu.Unlock()
	if !found {
		return &apiError{http.StatusNotFound, fmt.Sprintf("Response with id '%s' not found.", id)}
	}
	return nil
}

// answerResponses emits n tokens as a response object, streamed as events
// or whole, and stores it unless store is false.
func (s *Server) answerResponses(ctx context.Context, w http.ResponseWriter, req *request, res kvResult, n int, finish string) error {
	msgID := "msg_" + randomHex(8)
	id := req.internalID
	if raw, ok := present(req.fields, "request_id"); ok {
		json.Unmarshal(raw, &id) // vLLM's response id is the request_id as given (ResponsesResponse.from_request)
	}
	resp := &responseObject{ID: id, Object: "response", CreatedAt: time.Now().Unix(), Model: s.cfg.Model,
		Output: []responseOutput{}, MaxOutputTokens: req.maxTokens, Status: "in_progress", KVTransferParams: orNull(res.params)}
	resp.Background, _ = boolField(req.fields, "background")
	if raw, ok := present(req.fields, "previous_response_id"); ok {
		var id string
		json.Unmarshal(raw, &id)
		resp.PreviousResponseID = &id
	}
	var out *sse
	seq := 0
	event := func(e responseEvent) error {
		e.SequenceNumber, seq = seq, seq+1
		return out.event(e.Type, e)
	}
	if req.stream {
		stream := newSSE(w)
		out = &stream
		// vLLM sends both before the engine has anything (responses_stream_generator).
		for _, t := range []string{"response.created", "response.in_progress"} {
			if err := event(responseEvent{Type: t, Response: resp}); err != nil {
				return err
			}
		}
	}
	zero := 0
	text := ""
	err := s.tokens(ctx, n, func(i int) error {
		text += token(i)
		if out == nil {
			return nil
		}
		return event(responseEvent{Type: "response.output_text.delta", ItemID: msgID, OutputIndex: &zero, ContentIndex: &zero, Delta: token(i)})
	})
	if err != nil {
		return err
	}
	resp.Status = "completed"
	if finish == "length" {
		resp.Status, resp.IncompleteDetails = "incomplete", &incomplete{Reason: "max_output_tokens"}
	}
	resp.Output = []responseOutput{{Type: "message", ID: msgID, Role: "assistant", Status: "completed",
		Content: []outputText{{Type: "output_text", Text: text, Annotations: []any{}}}}}
	resp.Usage = &responsesUsage{InputTokens: req.promptTokens, OutputTokens: n, TotalTokens: req.promptTokens + n,
		InputTokensDetails: inputDetails{CachedTokens: req.cached, InputTokensPerTurn: []int{req.promptTokens},
			CachedTokensPerTurn: []int{req.cached}}, OutputTokensDetails: map[string]int{"reasoning_tokens": 0}}
	stored, _ := json.Marshal(resp)
	if stores(req.fields) {
		s.mu.Lock()
		s.responses[resp.ID] = stored
		s.mu.Unlock()
	}
	if out != nil {
		return event(responseEvent{Type: "response.completed", Response: resp})
	}
	writeJSON(w, http.StatusOK, json.RawMessage(stored))
	return nil
}

// stores reads store, which defaults to true (a null is pydantic's None: false).
func stores(fields map[string]json.RawMessage) bool {
	raw, ok := fields["store"]
	return !ok || string(raw) == "true"
}

// storedResponse answers GET of /v1/responses/{id} and POST of its cancel,
// from the store.
func (s *Server) storedResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	s.mu.Lock()
	stored, ok := s.responses[id]
	s.mu.Unlock()
	if !ok {
		s.writeError(w, &apiError{http.StatusNotFound, fmt.Sprintf("Response with id '%s' not found.", id)})
		return
	}
	writeJSON(w, http.StatusOK, stored)
}
