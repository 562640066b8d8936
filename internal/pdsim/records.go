package pdsim

import (
	"encoding/json"
	"net/http"
	"slices"
	"time"
)

// Record is what the engine saw of one request: an inference request, or
// one of the other endpoints (otherRoutes).
type Record struct {
	Path        string `json:"path"`
	RequestID   string `json:"request_id"` // X-Request-Id header
	Body        []byte `json:"body"`       // exactly as received
	Status      int    `json:"status"`     // 0 when the connection was dropped
	Stream      bool   `json:"stream"`
	KV          string `json:"kv"` // "" | issued | hit | miss | recompute | load-failed | none
	KVSource    string `json:"kv_source,omitempty"`
	KVRequestID string `json:"kv_request_id,omitempty"` // X-Request-Id the prefill issued the KV for
	// CachedTokens are the prompt tokens the engine found in its KV cache, as
	// vLLM reports them (x-pdsim-cached-tokens): all of them when the KV came
	// from another engine, else the prefix cache's leading full blocks.
	CachedTokens int  `json:"cached_tokens"`
	Canceled     bool `json:"canceled"` // the client (or Close) ended it before the answer was complete
}

// MarshalJSON prints Body as text rather than base64, for people reading /pdsim/requests.
func (r Record) MarshalJSON() ([]byte, error) {
	type plain Record
	return json.Marshal(struct {
		plain
		Body string `json:"body"`
	}{plain(r), string(r.Body)})
}

func (r *Record) UnmarshalJSON(b []byte) error {
	type plain Record
	v := struct {
		*plain
		Body string `json:"body"`
	}{plain: (*plain)(r)}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	r.Body = []byte(v.Body)
	return nil
}

// exchange is one inference request on its way through the server.
type exchange struct {
	index int
	rec   Record
	start time.Time
	err   error // why the KV could not be loaded, or the answer was cut short, for the log
}

func (s *Server) begin(r *http.Request, body []byte) *exchange {
	ex := &exchange{rec: Record{Path: r.URL.Path, RequestID: r.Header.Get("X-Request-Id"), Body: body}, start: time.Now()}
	s.mu.Lock()
	ex.index = s.forgotten + len(s.records)
	s.records = append(s.records, ex.rec)
	if n := len(s.records); n > s.cfg.MaxRecords {
		s.records, s.forgotten = slices.Clone(s.records[n/2:]), s.forgotten+n/2
	}
	s.mu.Unlock()
	return ex
}

func (s *Server) update(ex *exchange) {
	s.mu.Lock()
	if i := ex.index - s.forgotten; i >= 0 {
		s.records[i] = ex.rec
	}
	s.mu.Unlock()
}

func (s *Server) finish(ex *exchange) {
	s.update(ex)
	r := ex.rec
	attrs := []any{"path", r.Path, "request_id", r.RequestID, "status", r.Status, "stream", r.Stream,
		"kv", r.KV, "kv_source", r.KVSource, "kv_request_id", r.KVRequestID,
		"cached_tokens", r.CachedTokens, "canceled", r.Canceled,
		"duration", time.Since(ex.start).Round(time.Microsecond)}
	if ex.err != nil {
		attrs = append(attrs, "err", ex.err)
	}
	s.log.Info("request", attrs...)
}

// statusWriter remembers the status for the Record; Unwrap lets
// http.ResponseController reach Flush and Hijack underneath.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
