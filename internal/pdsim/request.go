package pdsim

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

type apiKind int

// request is the part of an OpenAI request body the simulated engine acts on.
// The raw top-level fields are kept so protocol code reads its own keys with
// their exact JSON (big integers included).
type request struct {
	api        apiKind
	id         string // X-Request-Id, or a random id as vLLM makes one
	internalID string // vLLM's engine request id: chatcmpl-<id>-<8 hex>
	fields     map[string]json.RawMessage
	model      string
	stream     bool
	usageIn    streamUsage
	output
	kv           json.RawMessage // kv_transfer_params where the API reads it; nil when absent
	promptTokens int
	promptHash   string // model + prompt, so KV computed for one prompt is never served to another
	cachedPrompt
	cached int    // prompt tokens found in the KV cache (prompt_tokens_details.cached_tokens)
	phase  *phase // for the engine's load metrics
}

// streamUsage is where a stream states its usage (stream_options): in a last
// chunk (include_usage), and in every chunk (continuous_usage_stats, with
// include_usage), as vLLM's should_include_usage reads them
// (vllm/entrypoints/serve/utils/api_utils.py @ 95add872).
type streamUsage struct{ last, running bool }

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
		// vLLM serves "" as no name: its first model (_is_model_supported,
		// vllm/entrypoints/openai/engine/serving.py).
		req.model = cmp.Or(req.model, s.cfg.Model)
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
			Continuous   *bool `json:"continuous_usage_stats"`
		}
		if err := json.Unmarshal(raw, &opts); err != nil {
			return nil, badRequest("stream_options: Input should be a valid dictionary")
		}
		req.usageIn.last = opts.IncludeUsage != nil && *opts.IncludeUsage
		req.usageIn.running = req.usageIn.last && opts.Continuous != nil && *opts.Continuous
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

// boolField reads a bool as pydantic's lax mode does: JSON's bools, 0 and 1,
// and the strings it takes for them ("true", "no", ...; any case).
func boolField(fields map[string]json.RawMessage, key string) (bool, *apiError) {
	raw, ok := present(fields, key)
	if !ok {
		return false, nil
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		s = string(bytes.TrimSpace(raw))
	}
	switch strings.ToLower(s) {
	case "true", "1", "t", "y", "yes", "on":
		return true, nil
	case "false", "0", "f", "n", "no", "off":
		return false, nil
	}
	return false, badRequest("%s: Input should be a valid boolean", key)
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
