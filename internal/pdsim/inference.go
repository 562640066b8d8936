package pdsim

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// connector is the engine side of one P/D protocol in one role.
type connector interface {
	// firstToken does everything that must happen before the first token can be
	// sampled: prefill compute, or loading KV computed elsewhere. An *apiError
	// rejects the request as the real engine would; any other error is a KV
	// load failure (vLLM's kv_load_failure_policy=fail).
	firstToken(ctx context.Context, req *request) (kvResult, error)
}

// KV outcomes, as recorded in Record.KV and the x-pdsim-kv header.
const (
	kvNone       = "none"
	kvIssued     = "issued"
	kvHit        = "hit"
	kvMiss       = "miss"
	kvLoadFailed = "load-failed"
)

type kvResult struct {
	outcome   string
	source    string          // where the KV came from (decode)
	requestID string          // X-Request-Id the prefill computed the KV for (decode)
	params    json.RawMessage // top-level kv_transfer_params of a non-streamed answer
	oneToken  bool            // a disaggregated prefill stops after its first token
}

// compute simulates the prefill forward pass on this engine: the prompt's
// blocks found in the prefix cache are looked up first, as vLLM's scheduler
// does, and once computed all its full blocks are in the cache.
func (s *Server) compute(ctx context.Context, req *request) error {
	req.cached = s.metrics.lookup(req)
	req.phase.run()
	if err := wait(ctx, s.cfg.TTFT); err != nil {
		return err
	}
	s.metrics.cache.insert(req.blocks, req.tokens, req.keys)
	return nil
}

func (s *Server) inference(api apiKind) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		w := &statusWriter{ResponseWriter: rw}
		ctx := r.Context()
		body, readErr := io.ReadAll(r.Body)
		ex := s.begin(r, body)
		ph := s.metrics.enter()
		defer func() {
			ph.exit()
			ex.rec.Status = w.status
			ex.rec.Canceled = ex.rec.Canceled || ctx.Err() != nil
			s.finish(ex)
		}()
		if readErr != nil {
			ex.rec.Canceled = true
			return
		}
		if s.injectFaults(ctx, w) {
			return
		}
		if media, _, _ := strings.Cut(strings.ToLower(r.Header.Get("Content-Type")), ";"); api.jsonOnly() && media != "application/json" {
			s.writeErrorFor(api, w, badRequest("Unsupported Media Type: Only 'application/json' is allowed"))
			return
		}
		req, aerr := s.parseRequest(api, ex.rec.RequestID, body)
		if aerr != nil {
			s.writeErrorFor(api, w, aerr)
			return
		}
		ex.rec.Stream = req.stream
		ph.blocks = blocksFor(req.promptTokens)
		req.phase = ph
		s.update(ex)

		scheduled := time.Now()
		res, err := s.kv.firstToken(ctx, req)
		if errors.As(err, &aerr) {
			s.writeErrorFor(api, w, aerr)
			return
		}
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			res.outcome = kvLoadFailed
			ex.err = err
		}
		if err == nil && res.outcome == kvHit {
			// vLLM counts KV from another engine as cached, all of the prompt,
			// and keeps the blocks it received for the prompts that follow.
			req.cached = req.promptTokens
			s.metrics.cache.insert(req.blocks, req.tokens, req.keys)
		}
		ex.rec.KV, ex.rec.KVSource, ex.rec.KVRequestID = res.outcome, res.source, res.requestID
		ex.rec.CachedTokens = req.cached
		w.Header().Set("x-pdsim-kv", res.outcome)
		w.Header().Set("x-pdsim-cached-tokens", strconv.Itoa(req.cached))
		if res.outcome == kvHit {
			w.Header().Set("x-pdsim-kv-source", res.source)
			w.Header().Set("x-pdsim-kv-request-id", res.requestID)
		}
		if err != nil {
			s.failLoad(w, req, err)
			return
		}
		s.metrics.promptTokens.Add(int64(req.promptTokens))
		prefill := time.Since(scheduled)
		ph.run()
		if err := s.answer(ctx, w, req, res); err != nil {
			ex.rec.Canceled, ex.err = true, fmt.Errorf("answer cut short: %w", err)
		}
		s.metrics.finished(req.promptTokens-req.cached, prefill)
	}
}

// answer emits the tokens after the first one has been made possible, in the
// request's API's shape.
func (s *Server) answer(ctx context.Context, w http.ResponseWriter, req *request, res kvResult) error {
	n, finish := req.outputTokens(s.cfg.OutputTokens)
	switch {
	case res.oneToken:
		n, finish = 1, "length"
	case s.stopsAtOnce(req):
		finish = "stop"
	}
	s.metrics.generationTokens.Add(int64(n))
	switch req.api {
	case apiResponses:
		return s.answerResponses(ctx, w, req, res, n, finish)
	case apiGenerate:
		return s.answerGenerate(ctx, w, req, res, n, finish)
	case apiSGLangGenerate:
		return s.answerSGLang(ctx, w, req, n, finish)
	case apiMessages:
		return s.answerMessages(ctx, w, req, res, n, finish)
	}
	return s.answerOpenAI(ctx, w, req, res, n, finish)
}

// tokens runs each of n output tokens, TPOT apart.
func (s *Server) tokens(ctx context.Context, n int, each func(i int) error) error {
	for i := range n {
		if i > 0 {
			if err := wait(ctx, s.cfg.TPOT); err != nil {
				return err
			}
		}
		if err := each(i); err != nil {
			return err
		}
	}
	return nil
}

// answerOpenAI answers chat and completions.
func (s *Server) answerOpenAI(ctx context.Context, w http.ResponseWriter, req *request, res kvResult, n int, finish string) error {
	u := s.usage(req, n)
	if !req.stream {
		text := ""
		if err := s.tokens(ctx, n, func(i int) error { text += token(i); return nil }); err != nil {
			return err
		}
		c := req.envelope(req.model, false)
		ch := choice{FinishReason: &finish, Text: &text}
		if req.api == apiChat {
			ch.Text, ch.Message = nil, &message{Role: "assistant", Content: text}
		}
		c.Choices, c.Usage, c.KVTransferParams = []choice{ch}, u, res.params
		if c.KVTransferParams == nil && s.cfg.Protocol != ProtocolSGLang {
			c.KVTransferParams = json.RawMessage("null") // vLLM always prints the field
		}
		writeJSON(w, http.StatusOK, c)
		return nil
	}

	out := newSSE(w)
	if req.api == apiChat {
		c := req.envelope(req.model, true)
		c.Choices, c.Usage = []choice{req.choice("", nil, true)}, req.runningUsage(0)
		if err := out.send(c); err != nil {
			return err
		}
	}
	err := s.tokens(ctx, n, func(i int) error {
		c := req.envelope(req.model, true)
		var fr *string
		if i == n-1 {
			fr = &finish
		}
		c.Choices, c.Usage = []choice{req.choice(token(i), fr, false)}, req.runningUsage(i+1)
		return out.send(c)
	})
	if err != nil {
		return err
	}
	if req.usageIn.last {
		c := req.envelope(req.model, true)
		c.Usage = u
		if err := out.send(c); err != nil {
			return err
		}
	}
	return out.raw([]byte("[DONE]"))
}

// callPeer makes one request to another engine's side channel or bootstrap server.
func (s *Server) callPeer(ctx context.Context, method, url string, body []byte, into any) error {
	r, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := s.client.Do(r)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
		return fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(msg))
	}
	if into != nil {
		return json.NewDecoder(resp.Body).Decode(into)
	}
	return nil
}

func newUUID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// failLoad answers a request whose KV could not be loaded as the engine
// does under vLLM's kv_load_failure_policy "fail": a 500, or, on a chat or
// completions stream, which has answered 200 already, an error event and
// [DONE]. vLLM sends its chat stream's role chunk first and its message
// says nothing of the KV ("Internal server error",
// vllm/entrypoints/generate/base/serving.py _raise_if_error); SGLang's
// servers send the event first, with their own message
// (disaggregation/decode.py, "Decode transfer failed ...", and prefill.py;
// entrypoints/openai/serving_chat.py). pdsim holds its headers until this
// point, so that they carry the KV outcome; a real engine sends them first.
//
// SGLang's /generate stream has no error event: the abort is its last
// chunk, meta_info.finish_reason {"type": "abort", "status_code": 500}.
//
// vLLM's Messages stream turns the chat stream's role chunk into
// message_start and its error event, which is not a chat chunk, into an
// Anthropic error event (AnthropicServingMessages.message_stream_converter,
// vllm/entrypoints/anthropic/serving.py).
func (s *Server) failLoad(w http.ResponseWriter, req *request, err error) {
	if req.stream && req.api == apiMessages && s.cfg.Protocol != ProtocolSGLang {
		out := newSSE(w)
		start := &messageStart{ID: req.internalID, Content: []contentBlock{}, Model: s.cfg.Model, Usage: messagesUsage{InputTokens: req.promptTokens}}
		out.event("message_start", messagesEvent{Type: "message_start", Message: start})
		type anthropicError struct {
			Type  string            `json:"type"` // first, as pydantic writes it
			Error map[string]string `json:"error"`
		}
		out.event("error", anthropicError{"error", map[string]string{"type": "internal_error", "message": err.Error()}})
		out.raw([]byte("[DONE]"))
		return
	}
	sglang := s.cfg.Protocol == ProtocolSGLang
	message := "Internal server error"
	if sglang {
		what := "Decode transfer failed"
		if s.cfg.Role == RolePrefill {
			what = "Prefill bootstrap failed"
		}
		message = what + " for request " + req.internalID + ": " + err.Error()
	}
	if sglang && req.stream && req.api == apiSGLangGenerate {
		// SGLang's native stream carries the scheduler's abort as its last
		// chunk, a chunk like the others, and no error event
		// (_handle_abort_finish_reason, managers/tokenizer_manager.py;
		// generate_request, entrypoints/http_server.py).
		ev := newSSE(w)
		ev.send(sglangAnswer{OutputIDs: []int{}, MetaInfo: sglangMeta{ID: req.id, PromptTokens: req.promptTokens,
			FinishReason: map[string]any{"type": "abort", "message": message, "status_code": http.StatusInternalServerError, "err_type": nil}}})
		ev.raw([]byte("[DONE]"))
		return
	}
	if !req.stream || req.api != apiChat && req.api != apiCompletion {
		s.writeErrorFor(req.api, w, &apiError{http.StatusInternalServerError, err.Error()})
		return
	}
	ev := newSSE(w)
	e := errorBody{Message: message, Type: "InternalServerError", Code: http.StatusInternalServerError}
	if sglang {
		e = errorBody{Object: "error", Message: message, Type: "INTERNAL_SERVER_ERROR", Code: http.StatusInternalServerError}
	} else if req.api == apiChat {
		c := req.envelope(req.model, true)
		c.Choices = append(c.Choices, req.choice("", nil, true))
		ev.send(c)
	}
	ev.send(map[string]errorBody{"error": e})
	ev.raw([]byte("[DONE]"))
}
