package pdsim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// sglangDefaultBootstrapPort is what SGLang uses when bootstrap_port is null.
const sglangDefaultBootstrapPort = 8998

// bootstrapFields are SGLang's top-level P/D fields of one pairing; the same
// on both legs.
type bootstrapFields struct {
	host string
	port int64
	room int64
}

// bootstrapOf reads a request's pairings as SGLang's tokenizer manager hands
// them to its scheduler, one per request it makes of the HTTP request
// (_handle_parallel_sampling and _normalize_bootstrap_params in
// python/sglang/srt/managers/io_struct.py, _handle_batch_request in
// tokenizer_manager.py): a single prompt's fields as they are; prompt i of a
// batch gets room+i of a scalar room, or entry i of a list (the entries past
// the batch are never read), and a scalar host or port stands for every
// prompt. With n > 1, prompt i makes n+1 requests, its prefix-cache request
// and its n samples, all copies of prompt i's fields: they share one room,
// which a prefill takes only once, so such a request fails on both legs (the
// decode's after HandshakeTimeout), as SGLang is reported to hang or fail.
func bootstrapOf(req *request, needHost bool) ([]bootstrapFields, error) {
	raw, ok := present(req.fields, "bootstrap_room")
	if !ok {
		return nil, badRequest("bootstrap_room is required for disaggregated serving")
	}
	prompts, batch := req.batch()
	if req.samples > 1 {
		batch = true // a single prompt with n > 1 becomes a batch of one
	}
	if !batch {
		f, err := bootstrapEntry(orNull(req.fields["bootstrap_host"]), orNull(req.fields["bootstrap_port"]), raw, needHost)
		return []bootstrapFields{f}, err
	}
	var fields [3]prompted
	for k, name := range []string{"bootstrap_host", "bootstrap_port", "bootstrap_room"} {
		fields[k] = promptedOf(req.fields[name])
		if fields[k].list && len(fields[k].values) < prompts {
			return nil, badRequest("%s has %d entries for a batch of %d prompts", name, len(fields[k].values), prompts)
		}
	}
	base, err := strconv.ParseInt(string(bytes.TrimSpace(raw)), 10, 64)
	if err != nil && !fields[2].list {
		return nil, badRequest("bootstrap_room: Input should be a valid integer in [0, 2^63-1], got %s", raw)
	}
	copies := 1
	if req.samples > 1 {
		copies = 1 + req.samples // the prompt's prefix-cache request and its samples
	}
	var out []bootstrapFields
	for i := range prompts {
		room := fields[2].at(i)
		if !fields[2].list {
			room = json.RawMessage(strconv.FormatInt(base+int64(i), 10))
		}
		f, err := bootstrapEntry(fields[0].at(i), fields[1].at(i), room, needHost)
		if err != nil {
			return nil, err
		}
		for range copies {
			out = append(out, f)
		}
	}
	return out, nil
}

// prompted is a bootstrap field of a batch: a list with an entry per
// prompt, or one value for all.
type prompted struct {
	values []json.RawMessage
	list   bool
}

func promptedOf(raw json.RawMessage) prompted {
	var values []json.RawMessage
	if bytes.HasPrefix(bytes.TrimSpace(raw), []byte("[")) && json.Unmarshal(raw, &values) == nil {
		return prompted{values, true}
	}
	return prompted{[]json.RawMessage{orNull(raw)}, false}
}

// at is prompt i's value.
func (p prompted) at(i int) json.RawMessage {
	if p.list {
		return p.values[i]
	}
	return p.values[0]
}

func isNull(raw json.RawMessage) bool { return string(bytes.TrimSpace(raw)) == "null" }

func bootstrapEntry(hostRaw, portRaw, roomRaw json.RawMessage, needHost bool) (bootstrapFields, error) {
	f := bootstrapFields{port: sglangDefaultBootstrapPort}
	// Strictly an integer literal: a string or float room means a router lost
	// precision or sent a UUID, and SGLang needs room % dp_size.
	room, err := strconv.ParseInt(string(bytes.TrimSpace(roomRaw)), 10, 64)
	if err != nil || room < 0 {
		return f, badRequest("bootstrap_room: Input should be a valid integer in [0, 2^63-1], got %s", roomRaw)
	}
	f.room = room
	if !isNull(hostRaw) {
		if json.Unmarshal(hostRaw, &f.host) != nil || f.host == "" {
			return f, badRequest("bootstrap_host: Input should be a valid string")
		}
	} else if needHost {
		return f, badRequest("bootstrap_host is required for disaggregated serving")
	}
	if !isNull(portRaw) {
		port, err := strconv.ParseInt(string(bytes.TrimSpace(portRaw)), 10, 64)
		if err != nil || port < 1 || port > 65535 {
			return f, badRequest("bootstrap_port: Input should be a valid port number, got %s", portRaw)
		}
		f.port = port
	}
	return f, nil
}

// room is one bootstrap_room on a prefill's bootstrap server. Each channel
// marks a step of the handoff and is closed at most once, in this order;
// gone may close at any point.
type room struct {
	registered chan struct{} // the prefill has arrived (requestID, promptHash set)
	connected  chan struct{} // a decode has handshaken
	ready      chan struct{} // the prefill's KV is computed
	fetched    chan struct{} // the decode has taken the KV
	gone       chan struct{} // the prefill has left, for whatever reason

	requestID, promptHash string
	taken                 bool // guarded by bootstrap.mu
	connectOnce           sync.Once
	fetchOnce             sync.Once
}

// bootstrap is an SGLang prefill's bootstrap server: the rendezvous where the
// two legs of a request, sent concurrently in either order, find each other.
type bootstrap struct {
	mu    sync.Mutex
	rooms map[int64]*room
}

func newBootstrap() *bootstrap { return &bootstrap{rooms: map[int64]*room{}} }

func (b *bootstrap) room(id int64) *room {
	b.mu.Lock()
	defer b.mu.Unlock()
	r, ok := b.rooms[id]
	if !ok {
		r = &room{registered: make(chan struct{}), connected: make(chan struct{}), ready: make(chan struct{}),
			fetched: make(chan struct{}), gone: make(chan struct{})}
		b.rooms[id] = r
	}
	return r
}

func (b *bootstrap) register(id int64, req *request) (*room, error) {
	r := b.room(id)
	b.mu.Lock()
	defer b.mu.Unlock()
	if r.taken {
		return nil, fmt.Errorf("bootstrap_room %d is already used by request %s", id, r.requestID)
	}
	r.taken, r.requestID, r.promptHash = true, req.id, req.promptHash
	close(r.registered)
	return r, nil
}

// leave is the prefill going away: waiting decodes learn it through gone.
func (b *bootstrap) leave(id int64, r *room) {
	close(r.gone)
	b.mu.Lock()
	if b.rooms[id] == r {
		delete(b.rooms, id)
	}
	b.mu.Unlock()
}

// abandon forgets a room a decode waited for in vain, unless the prefill came.
func (b *bootstrap) abandon(id int64, r *room) {
	b.mu.Lock()
	if b.rooms[id] == r && !r.taken {
		delete(b.rooms, id)
	}
	b.mu.Unlock()
}

// routes are the decode's side of the rendezvous, as long polls: handshake
// waits for the prefill to register the room, kv for its KV to be computed.
func (b *bootstrap) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /handshake/{room}", func(w http.ResponseWriter, r *http.Request) {
		id, err := strconv.ParseInt(r.PathValue("room"), 10, 64)
		var hello struct {
			PromptHash string `json:"prompt_hash"`
		}
		if err != nil || json.NewDecoder(r.Body).Decode(&hello) != nil {
			http.Error(w, "bad handshake", http.StatusBadRequest)
			return
		}
		rm := b.room(id)
		select {
		case <-rm.registered:
		case <-r.Context().Done():
			b.abandon(id, rm)
			return
		}
		if rm.promptHash != hello.PromptHash {
			http.Error(w, "the prefill in this room has a different prompt", http.StatusConflict)
			return
		}
		rm.connectOnce.Do(func() { close(rm.connected) })
		writeJSON(w, http.StatusOK, map[string]string{"request_id": rm.requestID})
	})
	mux.HandleFunc("GET /kv/{room}", func(w http.ResponseWriter, r *http.Request) {
		id, _ := strconv.ParseInt(r.PathValue("room"), 10, 64)
		b.mu.Lock()
		rm := b.rooms[id]
		b.mu.Unlock()
		if rm == nil {
			http.NotFound(w, r)
			return
		}
		select {
		case <-rm.ready:
		case <-rm.gone:
			http.Error(w, "the prefill left before its KV was ready", http.StatusGone)
			return
		case <-r.Context().Done():
			return
		}
		rm.fetchOnce.Do(func() { close(rm.fetched) })
		w.WriteHeader(http.StatusOK)
	})
	return mux
}

type sglangPrefill struct {
	s     *Server
	rooms *bootstrap
}

// firstToken holds the request in the bootstrap queue until a decode
// handshakes in each of its rooms, as SGLang does: a router that awaits the
// prefill before sending the decode waits for HandshakeTimeout.
func (p *sglangPrefill) firstToken(ctx context.Context, req *request) (kvResult, error) {
	pairings, err := bootstrapOf(req, false)
	if err != nil {
		return kvResult{}, err
	}
	rooms := make([]*room, 0, len(pairings))
	defer func() {
		for i, rm := range rooms {
			p.rooms.leave(pairings[i].room, rm)
		}
	}()
	for _, f := range pairings {
		rm, err := p.rooms.register(f.room, req)
		if err != nil {
			return kvResult{}, err
		}
		rooms = append(rooms, rm)
	}
	timeout := p.s.cfg.HandshakeTimeout
	for i, rm := range rooms {
		if err := awaitOrTimeout(ctx, rm.connected, timeout); err != nil {
			return kvResult{}, fmt.Errorf("no decode connected for bootstrap_room %d: %w", pairings[i].room, err)
		}
	}
	if err := p.s.compute(ctx, req); err != nil {
		return kvResult{}, err
	}
	for _, rm := range rooms {
		close(rm.ready)
	}
	for i, rm := range rooms {
		if err := awaitOrTimeout(ctx, rm.fetched, timeout); err != nil {
			return kvResult{}, fmt.Errorf("decode did not take the KV of bootstrap_room %d: %w", pairings[i].room, err)
		}
	}
	return kvResult{outcome: kvIssued, oneToken: true}, nil
}

type sglangDecode struct{ s *Server }

// firstToken handshakes in every room first, then takes every room's KV: the
// prefill computes once all its rooms have a decode.
func (d *sglangDecode) firstToken(ctx context.Context, req *request) (kvResult, error) {
	pairings, err := bootstrapOf(req, true)
	if err != nil {
		return kvResult{}, err
	}
	var res kvResult
	for _, f := range pairings {
		if res, err = d.handshake(ctx, req, f); err != nil {
			return kvResult{}, err
		}
	}
	for _, f := range pairings {
		if err := d.s.callPeer(ctx, http.MethodGet, peerURL(f, "kv"), nil, nil); err != nil {
			return kvResult{}, fmt.Errorf("receiving KV of bootstrap_room %d from %s: %w", f.room, res.source, err)
		}
	}
	if err := wait(ctx, d.s.cfg.KVTransfer); err != nil {
		return kvResult{}, err
	}
	return res, nil
}

// source is the prefill engine's bootstrap address, as SGLang's decode
// builds it (f"{req.bootstrap_host}:{req.bootstrap_port}",
// python/sglang/srt/disaggregation/decode.py): host, a colon and the port,
// with no brackets added. An IPv6 host must come bracketed ("[fd00::1]", as
// the router writes it); one that does not makes no address to dial, here
// as in SGLang.
func (f bootstrapFields) source() string {
	return f.host + ":" + strconv.FormatInt(f.port, 10)
}

func peerURL(f bootstrapFields, step string) string {
	return fmt.Sprintf("http://%s/%s/%d", f.source(), step, f.room)
}

// handshake joins the prefill in one room, bounded by HandshakeTimeout.
func (d *sglangDecode) handshake(ctx context.Context, req *request, f bootstrapFields) (kvResult, error) {
	hctx, cancel := context.WithTimeout(ctx, d.s.cfg.HandshakeTimeout)
	defer cancel()
	hello, _ := json.Marshal(map[string]string{"prompt_hash": req.promptHash})
	var peer struct {
		RequestID string `json:"request_id"`
	}
	err := d.s.callPeer(hctx, http.MethodPost, peerURL(f, "handshake"), hello, &peer)
	if errors.Is(hctx.Err(), context.DeadlineExceeded) {
		err = fmt.Errorf("timed out after %s", d.s.cfg.HandshakeTimeout)
	}
	if err != nil {
		return kvResult{}, fmt.Errorf("bootstrap handshake with %s for bootstrap_room %d: %w", f.source(), f.room, err)
	}
	return kvResult{outcome: kvHit, source: f.source(), requestID: peer.RequestID}, nil
}

// awaitOrTimeout waits for done, failing after timeout or when ctx ends.
func awaitOrTimeout(ctx context.Context, done <-chan struct{}, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return fmt.Errorf("timed out after %s", timeout)
		}
		return ctx.Err()
	}
}

// serverInfo answers as SGLang's GET /server_info (and its older name,
// /get_server_info) does: the server's arguments, the P/D ones among them
// (python/sglang/srt/entrypoints/http_server.py). A decode server reports
// the default bootstrap port, as SGLang's arguments carry one for every
// server.
func (s *Server) serverInfo(w http.ResponseWriter, _ *http.Request) {
	if s.cfg.RefuseServerInfo {
		writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "Unauthorized"}) // SGLang's --api-key middleware
		return
	}
	port := sglangDefaultBootstrapPort
	if s.cfg.Role == RolePrefill {
		_, p, _ := net.SplitHostPort(s.BootstrapAddr())
		port, _ = strconv.Atoi(p)
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"model_path":                      s.cfg.Model,
		"disaggregation_mode":             s.cfg.Role,
		"disaggregation_transfer_backend": "mooncake",
		"disaggregation_bootstrap_port":   port,
		"internal_states":                 []any{map[string]any{}},
		"version":                         "pdsim",
	})
}
