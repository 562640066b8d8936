package pdsim

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// OpenAI response shapes, field order as vLLM prints them.
type completion struct {
	ID               string          `json:"id"`
	Object           string          `json:"object"`
	Created          int64           `json:"created"`
	Model            string          `json:"model"`
	Choices          []choice        `json:"choices"`
	Usage            *usage          `json:"usage,omitempty"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params,omitempty"`
}

type choice struct {
	Index        int      `json:"index"`
	Message      *message `json:"message,omitempty"`
	Delta        *message `json:"delta,omitempty"`
	Text         *string  `json:"text,omitempty"`
	Logprobs     any      `json:"logprobs"`
	FinishReason *string  `json:"finish_reason"`
}

type message struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content"`
}

type usage struct {
	PromptTokens        int            `json:"prompt_tokens"`
	TotalTokens         int            `json:"total_tokens"`
	CompletionTokens    int            `json:"completion_tokens"`
	PromptTokensDetails *tokensDetails `json:"prompt_tokens_details,omitempty"`
}

type tokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// usage is vLLM's UsageInfo of an answer with n tokens to req. Like most vLLM
// releases (`if self.enable_prompt_tokens_details and
// final_res.num_cached_tokens:`), it has prompt_tokens_details only when the
// flag is on and something was cached.
func (s *Server) usage(req *request, n int) *usage {
	u := &usage{PromptTokens: req.promptTokens, CompletionTokens: n, TotalTokens: req.promptTokens + n}
	if s.cfg.PromptTokensDetails && req.cached > 0 {
		u.PromptTokensDetails = &tokensDetails{CachedTokens: req.cached}
	}
	return u
}

// runningUsage is the usage of a stream's chunk after n tokens with
// continuous_usage_stats, else nil: vLLM's chat and completions give it no
// prompt_tokens_details, which only the last chunk has
// (vllm/entrypoints/openai/chat_completion/serving.py @ 006c49d4,
// completion/serving.py @ 030ea52e).
func (r *request) runningUsage(n int) *usage {
	if !r.usageIn.running {
		return nil
	}
	return &usage{PromptTokens: r.promptTokens, CompletionTokens: n, TotalTokens: r.promptTokens + n}
}

// token is the deterministic text of output token i, so tests can assert content.
func token(i int) string {
	if i == 0 {
		return "tok0"
	}
	return " tok" + strconv.Itoa(i)
}

func (r *request) envelope(model string, chunk bool) completion {
	c := completion{ID: r.internalID, Object: "chat.completion", Created: time.Now().Unix(), Model: model, Choices: []choice{}}
	switch {
	case r.api == apiCompletion:
		c.Object = "text_completion"
	case chunk:
		c.Object = "chat.completion.chunk"
	}
	return c
}

func (r *request) choice(text string, finish *string, first bool) choice {
	c := choice{FinishReason: finish}
	switch {
	case r.api == apiCompletion:
		c.Text = &text
	case first:
		c.Delta = &message{Role: "assistant", Content: text}
	default:
		c.Delta = &message{Content: text}
	}
	return c
}

// sse writes server-sent events, flushing each one as vLLM does per token.
type sse struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

func newSSE(w http.ResponseWriter) sse {
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	return sse{w, http.NewResponseController(w)}
}

func (e sse) send(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return e.raw(b)
}

// event sends v as a named event, as vLLM streams the Responses API.
func (e sse) event(name string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(e.w, "event: %s\ndata: %s\n\n", name, b); err != nil {
		return err
	}
	return e.rc.Flush()
}

func (e sse) raw(data []byte) error {
	if _, err := fmt.Fprintf(e.w, "data: %s\n\n", data); err != nil {
		return err
	}
	return e.rc.Flush()
}

// errorBody is vLLM's error object; SGLang prints the same fields flat, after "object".
type errorBody struct {
	Object  string  `json:"object,omitempty"`
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

func (s *Server) writeError(w http.ResponseWriter, e *apiError) {
	s.writeErrorFor(apiChat, w, e)
}

// writeErrorFor prints e as the engine's handler for api does.
func (s *Server) writeErrorFor(api apiKind, w http.ResponseWriter, e *apiError) {
	if e.status == http.StatusOK { // a stream begun, then dropped (sglangMessagesRefusal)
		newSSE(w).rc.Flush()
		panic(http.ErrAbortHandler)
	}
	kind := strings.ReplaceAll(http.StatusText(e.status), " ", "")
	switch e.status {
	case http.StatusBadRequest:
		kind = "BadRequest"
	case http.StatusInternalServerError:
		kind = "InternalServer"
	}
	body := errorBody{Message: e.message, Type: kind + "Error", Code: e.status}
	if api == apiMessages {
		a := anthropicError{Type: "error"}
		a.Error.Type, a.Error.Message = body.Type, body.Message
		if s.cfg.Protocol == ProtocolSGLang && e.status == http.StatusInternalServerError {
			a.Error.Type = "internal_error" // SGLang's AnthropicServing names every 500 so
		}
		writeJSON(w, e.status, a)
		return
	}
	if s.cfg.Protocol == ProtocolSGLang {
		body.Object = "error"
		writeJSON(w, e.status, body)
		return
	}
	writeJSON(w, e.status, map[string]errorBody{"error": body})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"error":{"message":"encoding failed"}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(b)
}

// serves says whether model is one the engine serves: its own or an
// adapter's (Config.LoRA).
func (s *Server) serves(model string) bool {
	return model == s.cfg.Model || slices.Contains(s.cfg.LoRA, model)
}

// retrieveModel is SGLang's GET /v1/models/{model}: the served model's
// card, or its 404 for any other name (retrieve_model,
// python/sglang/srt/entrypoints/http_server.py).
func (s *Server) retrieveModel(w http.ResponseWriter, r *http.Request) {
	model := r.PathValue("model")
	if model != s.cfg.Model {
		writeJSON(w, http.StatusNotFound, map[string]any{"error": map[string]any{
			"message": fmt.Sprintf("The model '%s' does not exist", model), "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": model, "object": "model", "created": time.Now().Unix(), "owned_by": "sglang", "root": model})
}

// models is the engine's model list; vLLM's cards carry max_model_len, null
// for an adapter (ModelCard, OpenAIServingModels.show_available_models), and
// so do SGLang's (ModelCard in python/sglang/srt/entrypoints/openai/protocol.py,
// available_models in python/sglang/srt/entrypoints/http_server.py).
func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	card := func(id, root string, parent, length any) map[string]any {
		return map[string]any{"id": id, "object": "model", "created": time.Now().Unix(), "owned_by": "pdsim", "root": root, "parent": parent,
			"max_model_len": length}
	}
	data := []map[string]any{card(s.cfg.Model, s.cfg.Model, nil, s.cfg.MaxModelLen)}
	for _, name := range s.cfg.LoRA { // as vLLM lists an adapter: its path as root, the base model as parent
		data = append(data, card(name, "/adapters/"+name, s.cfg.Model, nil))
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}
