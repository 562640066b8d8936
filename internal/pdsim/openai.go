package pdsim

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

type apiKind int

// request is the part of an OpenAI request body the simulated engine acts on.
// The raw top-level fields are kept so protocol code reads its own keys with
// their exact JSON (big integers included).
type request struct {
	api          apiKind
	id           string // X-Request-Id, or a random id as vLLM makes one
	internalID   string // vLLM's engine request id: chatcmpl-<id>-<8 hex>
	fields       map[string]json.RawMessage
	model        string
	stream       bool
	includeUsage bool
	output
	kv           json.RawMessage // kv_transfer_params where the API reads it; nil when absent
	promptTokens int
	promptHash   string // model + prompt, so KV computed for one prompt is never served to another
	cachedPrompt
	cached int    // prompt tokens found in the KV cache (prompt_tokens_details.cached_tokens)
	phase  *phase // for the engine's load metrics
}

// cachedPrompt is a request's prompt as the prefix cache sees it.
type cachedPrompt struct {
	tokens []uint64    // as the simulated tokenizer cuts it
	keys   blockKeys   // what else keys its blocks: its adapter, its cache_salt
	blocks []blockHash // its full blocks, as the prefix cache names them
}

// apiError is an answer the engine gives instead of a completion.
type apiError struct {
	status  int
	message string
}

func (e *apiError) Error() string { return e.message }

func badRequest(format string, a ...any) *apiError {
	return &apiError{http.StatusBadRequest, fmt.Sprintf(format, a...)}
}

// parseRequest validates a body the way vLLM's pydantic models and
// SamplingParams do, as far as a router can trip over them.
func (s *Server) parseRequest(api apiKind, requestID string, body []byte) (*request, *apiError) {
	var fields map[string]json.RawMessage // duplicate keys: the last wins, as in Python's json
	// Python's json.loads of bytes skips one leading BOM (utf-8-sig).
	if err := json.Unmarshal(bytes.TrimPrefix(body, []byte("\ufeff")), &fields); err != nil || fields == nil {
		return nil, badRequest("JSON decode error: the body must be a JSON object")
	}
	req := &request{api: api, fields: fields, model: s.cfg.Model, id: requestID}
	if req.id == "" {
		req.id = strings.ReplaceAll(newUUID(), "-", "")
	}
	req.internalID = api.idPrefix() + req.id + "-" + randomHex(4) // vLLM >= 0.14 randomizes the suffix

	if raw, ok := present(fields, "cache_salt"); ok && !isNull(raw) && api != apiMessages { // Anthropic's request has none: ignored
		// vLLM's check (validate_cache_salt, vllm/entrypoints/generate/base/protocol.py
		// @ 022e555d), made as it reads the body, before it looks the model up.
		if json.Unmarshal(raw, &req.keys.salt) != nil || req.keys.salt == "" {
			return nil, badRequest("Parameter 'cache_salt' must be a non-empty string if provided.")
		}
		if utf8.RuneCountInString(req.keys.salt) > 128 || strings.ContainsAny(req.keys.salt, "@/\\\x00") {
			return nil, badRequest("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.")
		}
	}
	if raw, ok := present(fields, "model"); ok && api.checksModel() {
		if err := json.Unmarshal(raw, &req.model); err != nil {
			return nil, badRequest("model: Input should be a valid string")
		}
		if !s.serves(req.model) {
			return nil, &apiError{http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", req.model)}
		}
	}
	if i := slices.Index(s.cfg.LoRA, req.model); i >= 0 {
		req.keys.adapter, req.keys.adapterID = req.model, i+1
	}

	prompt, promptKey := api.prompt(fields)
	if prompt == nil {
		return nil, badRequest("%s: Field required", promptKey)
	}
	if err := req.readPrompt(prompt); err != nil {
		return nil, badRequest("%s: %v", promptKey, err)
	}

	var aerr *apiError
	if req.stream, aerr = boolField(fields, "stream"); aerr != nil {
		return nil, aerr
	}
	if aerr := req.readTokenLimits(); aerr != nil {
		return nil, aerr
	}
	if aerr := s.fitsContext(req); aerr != nil {
		return nil, aerr
	}
	if aerr := req.readSamples(); aerr != nil {
		return nil, aerr
	}
	if raw, ok := present(fields, "stream_options"); ok && api != apiMessages { // Anthropic's request has none: ignored
		var opts struct {
			IncludeUsage *bool `json:"include_usage"`
		}
		if err := json.Unmarshal(raw, &opts); err != nil {
			return nil, badRequest("stream_options: Input should be a valid dictionary")
		}
		req.includeUsage = opts.IncludeUsage != nil && *opts.IncludeUsage
		// vLLM's check tests truthiness, so {} passes; SGLang has no such check.
		if s.cfg.Protocol != ProtocolSGLang && !req.stream && !bytes.Equal(bytes.TrimSpace(raw), []byte("{}")) {
			return nil, badRequest("Stream options can only be defined when `stream=True`.")
		}
	}
	if raw, ok := req.kvRaw(); ok && s.cfg.Protocol != ProtocolSGLang {
		var obj map[string]json.RawMessage
		if json.Unmarshal(raw, &obj) != nil {
			return nil, badRequest("kv_transfer_params: Input should be a valid dictionary")
		}
		req.kv = raw
	}
	if aerr := s.checkStored(req); aerr != nil {
		return nil, aerr
	}
	return req, nil
}

func (r *request) readPrompt(raw json.RawMessage) error {
	v, err := r.api.decodePrompt(raw)
	if err != nil {
		return err
	}
	canonical, _ := json.Marshal(v) // sorted keys, so a router may re-encode the body freely
	sum := sha256.Sum256(append([]byte(r.model+"\x00"), canonical...))
	r.promptHash = hex.EncodeToString(sum[:16])
	r.tokens = tokenize(v)
	r.promptTokens = max(1, len(r.tokens))
	r.blocks = blockHashes(r.model, r.keys, r.tokens)
	return nil
}

// decodePrompt reads a prompt (api.prompt) as the API validates it, numbers
// as written, ready to tokenize.
func (a apiKind) decodePrompt(raw json.RawMessage) (any, error) {
	var v any
	if err := decodeNumbers(raw, &v); err != nil {
		return nil, err
	}
	if list, ok := v.([]any); a == apiChat && (!ok || len(list) == 0) {
		return nil, fmt.Errorf("Input should be a non-empty list")
	}
	if a == apiGenerate && !tokenList(v) {
		return nil, fmt.Errorf("Input should be a list of integers")
	}
	return v, nil
}

// tokenList reports whether v is a non-empty list of integers.
func tokenList(v any) bool {
	list, ok := v.([]any)
	for _, e := range list {
		if n, isNumber := e.(json.Number); !isNumber || strings.ContainsAny(string(n), ".eE") {
			return false
		}
	}
	return ok && len(list) > 0
}

// present returns a top-level field unless it is absent or null (pydantic's None).
func present(fields map[string]json.RawMessage, key string) (json.RawMessage, bool) {
	raw, ok := fields[key]
	if !ok || isNull(raw) {
		return nil, false
	}
	return raw, true
}

func boolField(fields map[string]json.RawMessage, key string) (bool, *apiError) {
	var v bool
	if raw, ok := present(fields, key); ok && json.Unmarshal(raw, &v) != nil {
		return false, badRequest("%s: Input should be a valid boolean", key)
	}
	return v, nil
}

// intField accepts what pydantic's lax int does: integers and integral floats.
func intField(fields map[string]json.RawMessage, key string) (int64, *apiError) {
	raw, ok := present(fields, key)
	if !ok {
		return 0, nil
	}
	text := string(bytes.TrimSpace(raw))
	if v, err := strconv.ParseInt(text, 10, 64); err == nil {
		return v, nil
	}
	if f, err := strconv.ParseFloat(text, 64); err == nil && f == float64(int64(f)) {
		return int64(f), nil
	}
	return 0, badRequest("%s: Input should be a valid integer", key)
}

// decodeNumbers keeps numbers as written: a float64 would corrupt 63-bit ids.
func decodeNumbers(raw json.RawMessage, into any) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	return dec.Decode(into)
}

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
